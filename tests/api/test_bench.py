"""`tokenloom bench latency | throughput | serve`: the offline benches on a tiny random Llama,
`bench serve` against a real `tokenloom serve` of it, and the pieces (percentiles, metrics,
SSE timing, datasets, flag checks) on their own. No timing assertions: speed targets live in
benchmarks/, never in tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import start_server, stop_server
from tokenloom.api.bench import serve_metrics
from tokenloom.api.bench.common import LATENCY_PERCENTAGES, percentile, std
from tokenloom.api.bench.datasets import random_text_requests, random_token_requests, sharegpt_requests
from tokenloom.api.bench.serve_client import CHAT, COMPLETIONS, RequestResult, build_payload, send_request
from tokenloom.api.cli import main
from tokenloom.errors import ConfigError

SHAREGPT = [
    {
        "id": "story",
        "conversations": [
            {"from": "human", "value": "Tell me a story about a dragon who learned to fly over the mountains."},
            {"from": "gpt", "value": "Once upon a time a small dragon watched the birds every day and practised."},
        ],
    },
    {
        "id": "too-short",
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "Hello there, how can I help you today?"},
        ],
    },
    {"id": "one-turn", "conversations": [{"from": "human", "value": "What is the capital of France?"}]},
    {
        "id": "bicycle",
        "conversations": [
            {"from": "human", "value": "Explain how a bicycle stays upright when it is moving forward."},
            {"from": "gpt", "value": "Steering corrections and the geometry of the front fork keep it upright."},
        ],
    },
]


@pytest.fixture
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    return str(path)


def run_cli(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- bench latency ------------------------------------------------------------------------------------


def test_latency_reports_vllm_keys_and_ordered_percentiles(tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "latency.json"
    code, out, _ = run_cli(
        [
            "bench",
            "latency",
            "--model",
            tiny_llama_dir,
            "--dtype",
            "float32",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--batch-size",
            "2",
            "--n",
            "2",
            "--num-iters",
            "3",
            "--num-iters-warmup",
            "1",
            "--output-json",
            str(output),
        ],
        capsys,
    )
    assert code == 0
    results = json.loads(output.read_text())
    assert set(results) == {"avg_latency", "latencies", "percentiles"}
    latencies = results["latencies"]
    assert len(latencies) == 3 and all(latency > 0 for latency in latencies)
    assert results["avg_latency"] == pytest.approx(sum(latencies) / 3)
    assert list(results["percentiles"]) == [str(percent) for percent in LATENCY_PERCENTAGES]
    values = list(results["percentiles"].values())
    assert values == sorted(values) and min(latencies) <= values[0] and values[-1] <= max(latencies)
    assert f"Avg latency: {results['avg_latency']} seconds" in out
    assert f"99% percentile latency: {results['percentiles']['99']} seconds" in out


def test_latency_profile_writes_a_chrome_trace(tiny_llama_dir, tmp_path, capsys):
    code, out, _ = run_cli(
        [
            "bench",
            "latency",
            "--model",
            tiny_llama_dir,
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--batch-size",
            "1",
            "--num-iters-warmup",
            "0",
            "--profile",
            "--profile-result-dir",
            str(tmp_path / "profile"),
        ],
        capsys,
    )
    assert code == 0
    traces = os.listdir(tmp_path / "profile")
    assert len(traces) == 1 and traces[0].endswith(".pt.trace.json")
    trace = json.loads((tmp_path / "profile" / traces[0]).read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert "Self CPU" in out and "Avg latency" not in out  # profiling replaces the timed iterations


def test_latency_times_beam_search(tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "latency.json"
    code, out, _ = run_cli(
        [
            "bench",
            "latency",
            "--model",
            tiny_llama_dir,
            "--dtype",
            "float32",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--batch-size",
            "2",
            "--n",
            "2",
            "--use-beam-search",
            "--num-iters",
            "2",
            "--num-iters-warmup",
            "0",
            "--output-json",
            str(output),
        ],
        capsys,
    )
    assert code == 0
    assert len(json.loads(output.read_text())["latencies"]) == 2


def test_latency_refuses_a_batch_longer_than_the_context(tiny_llama_dir, capsys):
    code, _, err = run_cli(
        ["bench", "latency", "--model", tiny_llama_dir, "--input-len", "250", "--output-len", "10"], capsys
    )
    assert code == 2 and "260 tokens do not fit the context length 256" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "8000"], "--port is a flag of the HTTP server"),
        (["--max-model-lenn", "64"], "did you mean --max-model-len?"),
        (["--num-iter", "3"], "did you mean --num-iters?"),
        (["--num-iters", "0"], "must be at least 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs: must be at least 1"),
    ],
)
def test_latency_flag_errors_exit_2_before_loading_a_model(argv, message, capsys):
    code, _, err = run_cli(["bench", "latency", "--model", "/nonexistent/model", *argv], capsys)
    assert code == 2 and message in err


def test_engine_help_topics_come_from_the_serve_catalogue(capsys):
    code, out, _ = run_cli(["bench", "throughput", "--help=max-num-seqs"], capsys)
    assert code == 0 and "--max-num-seqs MAX_NUM_SEQS" in out
    code, out, _ = run_cli(["bench", "latency", "--help"], capsys)
    assert code == 0 and "--num-iters-warmup" in out and "--help=GROUP" in out


# -- bench throughput ---------------------------------------------------------------------------------


def test_throughput_random_counts_every_token(tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "throughput.json"
    code, out, _ = run_cli(
        [
            "bench",
            "throughput",
            "--model",
            tiny_llama_dir,
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--num-prompts",
            "6",
            "--n",
            "2",
            "--disable-detokenize",
            "--output-json",
            str(output),
        ],
        capsys,
    )
    assert code == 0
    results = json.loads(output.read_text())
    assert {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"} <= set(
        results
    )
    assert results["num_requests"] == 6
    assert results["total_prompt_tokens"] == 6 * 12
    assert results["total_output_tokens"] == 6 * 5 * 2  # ignore_eos: every sequence runs to --output-len
    assert results["total_num_tokens"] == 6 * 12 + 6 * 5 * 2
    assert results["requests_per_second"] * results["elapsed_time"] == pytest.approx(6)
    assert results["tokens_per_second"] * results["elapsed_time"] == pytest.approx(results["total_num_tokens"])
    assert f"Throughput: {results['requests_per_second']:.2f} requests/s" in out
    assert "Total num output tokens:  60" in out


def test_throughput_sharegpt_uses_the_conversations(tiny_llama_dir, sharegpt_file, tmp_path, capsys):
    output = tmp_path / "throughput.json"
    code, out, _ = run_cli(
        [
            "bench",
            "throughput",
            "--model",
            tiny_llama_dir,
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            sharegpt_file,
            "--num-prompts",
            "4",
            "--output-json",
            str(output),
        ],
        capsys,
    )
    assert code == 0
    results = json.loads(output.read_text())
    # two usable conversations, repeated to four requests
    assert results["num_requests"] == 4 and "repeating them" in out
    assert results["total_output_tokens"] > 0 and results["total_prompt_tokens"] > 0


def test_throughput_random_needs_an_input_length(capsys):
    code, _, err = run_cli(["bench", "throughput", "--num-prompts", "2"], capsys)
    assert code == 2 and "--input-len" in err


# -- bench serve against a real server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("bench-server") / "serve.log")
    server = start_server([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32"], log_path)
    yield server
    stop_server(server)


def serve_argv(server, tokenizer_dir, *extra):
    return [
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--model",
        "tiny",
        "--tokenizer",
        tokenizer_dir,
        "--disable-tqdm",
        *extra,
    ]


def summary_value(out: str, label: str) -> float:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return float(line[len(label) :].split()[0])


def test_serve_completions_summary_and_saved_result(tiny_server, tiny_llama_dir, tmp_path, capsys):
    code, out, _ = run_cli(
        serve_argv(
            tiny_server,
            tiny_llama_dir,
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--num-prompts",
            "5",
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "result.json",
        ),
        capsys,
    )
    assert code == 0, out
    assert summary_value(out, "Successful requests:") == 5
    assert summary_value(out, "Maximum request concurrency:") == 2
    assert summary_value(out, "Total input tokens:") == 5 * 24
    assert summary_value(out, "Total generated tokens:") == 5 * 6
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        for statistic in ("Mean", "Median", "P50", "P90", "P99"):
            assert summary_value(out, f"{statistic} {metric} (ms):") > 0

    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["completed"] == 5 and saved["failed"] == 0 and saved["max_concurrency"] == 2
    assert saved["model_id"] == "tiny" and saved["request_rate"] == "inf" and saved["num_prompts"] == 5
    assert saved["input_lens"] == [24] * 5 and saved["output_lens"] == [6] * 5
    assert saved["total_output_tokens"] == 30
    assert saved["output_throughput"] * saved["duration"] == pytest.approx(30)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for key in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{key}_{metric}_ms" in saved
    # a request's end-to-end latency is its first chunk plus the gaps between later chunks
    e2els = [ttft + sum(gaps) for ttft, gaps in zip(saved["ttfts"], saved["itls"])]
    assert saved["mean_e2el_ms"] == pytest.approx(1000 * sum(e2els) / 5)
    assert all(1 <= len(gaps) <= 5 for gaps in saved["itls"])
    assert saved["errors"] == [""] * 5


def test_serve_chat_endpoint_streams_deltas(tiny_server, tiny_llama_dir, capsys):
    code, out, _ = run_cli(
        serve_argv(
            tiny_server,
            tiny_llama_dir,
            "--backend",
            "openai-chat",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--num-prompts",
            "3",
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--request-rate",
            "50",
            "--num-warmups",
            "1",
        ),
        capsys,
    )
    assert code == 0, out
    assert summary_value(out, "Successful requests:") == 3
    assert summary_value(out, "Total generated tokens:") == 3 * 4
    assert summary_value(out, "Request rate configured (RPS):") == 50


def test_serve_failed_requests_are_counted_and_reported(tiny_server, tiny_llama_dir, tmp_path, capsys):
    # prompts longer than the model's 256-token context: the server refuses each with a 400
    code, out, _ = run_cli(
        serve_argv(
            tiny_server,
            tiny_llama_dir,
            "--random-input-len",
            "300",
            "--random-output-len",
            "4",
            "--num-prompts",
            "2",
            "--ready-check-timeout-sec",
            "0",
            "--save-result",
            "--result-dir",
            str(tmp_path),
        ),
        capsys,
    )
    assert code == 1
    assert summary_value(out, "Successful requests:") == 0 and summary_value(out, "Failed requests:") == 2
    assert "All requests failed; the first error: HTTP 400" in out
    [result_file] = os.listdir(tmp_path)
    assert result_file.startswith("openai-infqps-tiny-")
    assert "errors" not in json.loads((tmp_path / result_file).read_text())  # only --save-detailed keeps them


def test_serve_initial_request_fails_fast_on_a_wrong_model(tiny_server, tiny_llama_dir, capsys):
    argv = serve_argv(tiny_server, tiny_llama_dir, "--num-prompts", "1", "--random-input-len", "8")
    argv[argv.index("tiny")] = "no-such-model"
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "initial test request" in err and "HTTP 404" in err


def test_serve_lora_modules_name_the_adapter_in_each_request(tiny_server, tiny_llama_dir, capsys):
    argv = serve_argv(tiny_server, tiny_llama_dir, "--num-prompts", "1", "--random-input-len", "8")
    code, _, err = run_cli([*argv, "--lora-modules", "no-such-adapter"], capsys)
    assert code == 2 and "HTTP 404" in err and "no-such-adapter" in err


# -- the pieces -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [0.5, 9.0, 2.0, 7.5, 7.5, 1.0, 3.25]])
def test_percentile_and_std_match_numpy(values):
    for percent in (0, 10, 25, 50, 75, 90, 99, 99.9, 100):
        assert percentile(values, percent) == pytest.approx(float(np.percentile(values, percent)))
    assert std(values) == pytest.approx(float(np.std(values)))
    assert percentile([], 50) == 0.0


def test_metrics_from_known_results():
    results = [
        RequestResult(
            prompt_len=10,
            success=True,
            output_tokens=4,
            ttft=0.1,
            itl=[0.02, 0.03, 0.01],
            latency=0.16,
            start_time=100.0,
        ),
        RequestResult(
            prompt_len=20,
            success=True,
            output_tokens=None,
            generated_text="a b",
            ttft=0.3,
            itl=[0.1],
            latency=0.4,
            start_time=100.5,
        ),
        RequestResult(prompt_len=30, success=False, error="HTTP 400: too long", start_time=100.2),
    ]
    metrics = serve_metrics.calculate_metrics(
        results, duration=2.0, percents=[50, 99], count_tokens=lambda text: len(text.split())
    )
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert metrics.total_input == 30 and metrics.output_lens == [4, 2, 0] and metrics.total_output == 6
    assert metrics.request_throughput == 1.0 and metrics.output_throughput == 3.0
    assert metrics.total_token_throughput == 18.0
    assert metrics.stats["ttft"].mean == pytest.approx(200.0)
    # TPOT excludes the first token: (latency - ttft) / (output tokens - 1)
    assert metrics.stats["tpot"].mean == pytest.approx(1000 * (0.06 / 3 + 0.1 / 1) / 2)
    assert metrics.stats["itl"].median == pytest.approx(25.0)
    assert metrics.stats["e2el"].percentiles[1] == (99, pytest.approx(1000 * (0.16 + 0.99 * (0.4 - 0.16))))
    # six chunks, all inside the first second; both requests in flight during it
    assert (metrics.max_output_tokens_per_s, metrics.max_concurrent_requests) == (6.0, 2)

    lines = serve_metrics.summary_lines(metrics, ["ttft", "e2el"], max_concurrency=4, request_rate=float("inf"))
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert f"{'Successful requests:':<40} {2:<10}" in lines
    assert f"{'Failed requests:':<40} {1:<10}" in lines
    assert f"{'Output token throughput (tok/s):':<40} {3.0:<10.2f}" in lines
    assert "-" * 15 + "Time to First Token" + "-" * 16 in lines
    assert f"{'P99 E2EL (ms):':<40} {metrics.stats['e2el'].percentiles[1][1]:<10.2f}" in lines
    assert not any("TPOT" in line for line in lines) and lines[-1] == "=" * 50
    figures = serve_metrics.result_json(metrics, results, ["ttft"])
    assert figures["p99_ttft_ms"] == metrics.stats["ttft"].percentiles[1][1] and "p99_tpot_ms" not in figures


def sse_transport(chunks: list, status: int = 200):
    body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + ": ping\n\ndata: [DONE]\n\n"
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "the model 'x' does not exist"}})
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler), seen


def stream(transport, kind, payload):
    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/x", kind, payload, prompt_len=7)

    return asyncio.run(go())


def test_send_request_times_each_chunk_and_reads_usage():
    chunks = [
        {"choices": [{"text": "Hel"}]},
        {"choices": [{"text": "lo"}]},
        {"choices": [{"text": "!"}]},
        {"choices": [], "usage": {"completion_tokens": 3}},
    ]
    transport, seen = sse_transport(chunks)
    payload = build_payload(
        COMPLETIONS, "tiny", "Hi", 3, ignore_eos=True, sampling={"temperature": 0.0}, extra_body={"top_k": 5}
    )
    result = stream(transport, COMPLETIONS, payload)
    assert result.success and result.generated_text == "Hello!" and result.output_tokens == 3
    assert len(result.itl) == 2 and result.ttft > 0
    assert result.latency == pytest.approx(result.ttft + sum(result.itl))
    assert seen[0] == {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "repetition_penalty": 1.0,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 5,
    }


def test_send_request_chat_deltas_and_refusals():
    transport, seen = sse_transport(
        [
            {"choices": [{"delta": {"role": "assistant", "content": "Yes"}}]},
            {"choices": [{"delta": {"content": " sir"}}]},
        ]
    )
    result = stream(transport, CHAT, build_payload(CHAT, "tiny", "Hi", 2))
    assert result.success and result.generated_text == "Yes sir" and result.output_tokens is None
    assert seen[0]["messages"] == [{"role": "user", "content": "Hi"}] and seen[0]["max_completion_tokens"] == 2

    refused = stream(sse_transport([], status=404)[0], CHAT, {})
    assert not refused.success and refused.status_code == 404
    assert refused.error == "HTTP 404: the model 'x' does not exist"
    empty = stream(sse_transport([{"choices": [], "usage": {"completion_tokens": 0}}])[0], COMPLETIONS, {})
    assert not empty.success and "no time to first token" in empty.error


def test_random_text_prompts_have_the_asked_token_lengths(tokenizer):
    requests = random_text_requests(np.random.default_rng(1), tokenizer, 8, 64, 16)
    assert [request.prompt_len for request in requests] == [64] * 8
    assert all(len(tokenizer.encode(request.prompt, add_special_tokens=False)) == 64 for request in requests)
    assert len({request.prompt for request in requests}) == 8
    again = random_text_requests(np.random.default_rng(1), tokenizer, 8, 64, 16)
    assert [request.prompt for request in again] == [request.prompt for request in requests]

    ranged = random_text_requests(np.random.default_rng(2), tokenizer, 20, 40, 10, range_ratio=0.5, prefix_len=6)
    assert all(6 + 20 <= request.prompt_len <= 6 + 60 for request in ranged)
    assert all(5 <= request.expected_output_len <= 15 for request in ranged)
    assert len({request.prompt_len for request in ranged}) > 1


def test_random_token_prompts_share_the_prefix_and_skip_special_ids():
    allowed = [token for token in range(100) if token not in (0, 1, 2)]
    requests = random_token_requests(np.random.default_rng(0), 5, 30, 7, allowed, prefix_len=4)
    assert all(len(request.prompt) == request.prompt_len == 34 for request in requests)
    assert len({tuple(request.prompt[:4]) for request in requests}) == 1
    assert not {0, 1, 2} & {token for request in requests for token in request.prompt}
    assert [request.expected_output_len for request in requests] == [7] * 5


def test_sharegpt_filters_short_and_one_turn_conversations(tokenizer, sharegpt_file):
    requests = sharegpt_requests(np.random.default_rng(0), sharegpt_file, tokenizer, 2)
    prompts = {request.prompt for request in requests}
    assert prompts == {SHAREGPT[0]["conversations"][0]["value"], SHAREGPT[3]["conversations"][0]["value"]}
    for request in requests:
        assert request.prompt_len == len(tokenizer.encode(request.prompt))
    fixed = sharegpt_requests(np.random.default_rng(0), sharegpt_file, tokenizer, 2, output_len=9)
    assert [request.expected_output_len for request in fixed] == [9, 9]
    with pytest.raises(ConfigError, match="fits --max-model-len 10"):
        sharegpt_requests(np.random.default_rng(0), sharegpt_file, tokenizer, 2, max_model_len=10)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"conversations": []}', "expected a JSON list"),
        ('[{"conversations": [{"from": "human", "value": "x"}]}]', "at least two turns"),
    ],
)
def test_sharegpt_bad_files_say_what_is_wrong(tokenizer, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        sharegpt_requests(np.random.default_rng(0), str(path), tokenizer, 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "serve", "--percentile-metrics", "ttft,foo"], "unknown metric 'foo'"),
        (["bench", "serve", "--metric-percentiles", "50,x"], "expected numbers"),
        (["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/completions"], "not one"),
        (["bench", "serve", "--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["bench", "serve", "--extra-body", "[1]"], "expected a JSON object"),
        (["bench", "nope"], "unknown bench command 'nope'"),
    ],
)
def test_serve_flag_errors_exit_2(argv, message, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and message in err


HEAVY_MODULES = ("torch", "transformers", "numpy", "httpx", "tokenloom.builtin_plugins", "tokenloom.plugins.manager")


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--help"],
        ["bench", "latency", "--help"],
        ["bench", "serve", "--help"],
        ["bench", "throughput", "--help=SchedulerConfig"],
    ],
)
def test_bench_help_imports_nothing_heavy(argv):
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from tokenloom.api.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            code = main({argv!r})
        print(json.dumps({{"code": code, "heavy": sorted(name for name in sys.modules
                                                        if name.startswith({HEAVY_MODULES!r}))}}))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert json.loads(result.stdout) == {"code": 0, "heavy": []}, result.stderr
