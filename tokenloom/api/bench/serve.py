"""``tokenloom bench serve``: a streaming HTTP load generator for any OpenAI-compatible server,
with the flags, printed summary and result-file keys of vLLM's ``bench serve``, so the same
command line measures tokenloom and its peers."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenloom.api.bench.common import BenchParser, non_negative_int, positive_int, ratio, write_json
from tokenloom.api.bench.datasets import SampleRequest, random_text_requests, sharegpt_requests
from tokenloom.api.bench.serve_client import (
    CHAT,
    RequestResult,
    build_payload,
    endpoint_kind,
    request_headers,
    send_request,
)
from tokenloom.api.bench.serve_metrics import DETAILED_KEYS, METRICS, calculate_metrics, result_json, summary_lines
from tokenloom.api.flags import parse_json_object
from tokenloom.api.serve_help import help_request
from tokenloom.errors import ConfigError, TokenloomError

BACKENDS = ("openai", "vllm", "openai-chat")  # vLLM's names; the first two stream /v1/completions
REQUEST_TIMEOUT_S = 6 * 3600.0  # vLLM's client allows a request six hours
RETRY_STATUSES = (502, 503, 504)  # a server still starting, behind a proxy


def build_parser() -> BenchParser:
    parser = BenchParser(
        prog="tokenloom bench serve",
        description=(
            "Benchmark an OpenAI-compatible server (tokenloom, vLLM, llama.cpp, ...) with streamed requests: "
            "TTFT, TPOT, ITL, end-to-end latency and throughput, printed and saved as vLLM's bench serve does."
        ),
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai/vllm: /v1/completions; openai-chat: /v1/chat/completions",
    )
    server.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (else --host/--port)")
    server.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    server.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    server.add_argument(
        "--endpoint", default=None, help="API path: /v1/completions or /v1/chat/completions (unset: the backend's)"
    )
    server.add_argument(
        "--model",
        default=None,
        help="model name for requests and the tokenizer (unset: the first of the server's /v1/models)",
    )
    server.add_argument(
        "--served-model-name", default=None, help="model name for requests when it differs from --model"
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapter names the server serves: each request names one of them, at random (seeded)",
    )
    server.add_argument(
        "--tokenizer",
        default=None,
        help="model name or path to load the tokenizer from, as tokenloom resolves models: a packaged "
        "name (smollm2), a directory, a .gguf file (unset: --model)",
    )
    server.add_argument(
        "--tokenizer-mode", choices=("auto", "slow"), default="auto", help="slow: the slow (Python) tokenizer"
    )
    server.add_argument(
        "--ready-check-timeout-sec",
        type=non_negative_int,
        default=600,
        help="retry the first request this long while the server is not up yet (0: no check)",
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt"),
        default="random",
        help="random prompts decoded from random token ids, or a ShareGPT-format file",
    )
    data.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    data.add_argument("--num-prompts", type=positive_int, default=1000, help="number of prompts to send")
    data.add_argument("--random-input-len", type=positive_int, default=1024, help="random dataset: prompt tokens")
    data.add_argument("--random-output-len", type=positive_int, default=128, help="random dataset: output tokens")
    data.add_argument(
        "--random-range-ratio",
        type=ratio,
        default=0.0,
        help="random dataset: draw lengths uniformly from [len*(1-r), len*(1+r)]",
    )
    data.add_argument(
        "--random-prefix-len",
        type=non_negative_int,
        default=0,
        help="random dataset: a shared random prefix of this many tokens before each prompt",
    )
    data.add_argument(
        "--sharegpt-output-len",
        type=positive_int,
        default=None,
        help="sharegpt dataset: output tokens per request instead of the reply's length",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")

    traffic = parser.add_argument_group("traffic and sampling")
    traffic.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, arriving as a Poisson process (inf: all at once)",
    )
    traffic.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier"
    )
    traffic.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    traffic.add_argument("--num-warmups", type=non_negative_int, default=0, help="requests to send before measuring")
    traffic.add_argument("--ignore-eos", action="store_true", help="generate every requested token (ignore_eos)")
    traffic.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: 0, greedy)")
    traffic.add_argument("--top-p", type=float, default=None)
    traffic.add_argument("--top-k", type=int, default=None)
    traffic.add_argument("--min-p", type=float, default=None)
    traffic.add_argument(
        "--extra-body", type=parse_json_object, default=None, help="JSON object merged into every request body"
    )
    traffic.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    report = parser.add_argument_group("results")
    report.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el",
    )
    report.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    report.add_argument("--save-result", action="store_true", help="save the results as a JSON file")
    report.add_argument(
        "--save-detailed", action="store_true", help="also save per-request lengths, times, texts and errors"
    )
    report.add_argument("--result-dir", default=None, help="directory of the result file (default: current)")
    report.add_argument(
        "--result-filename",
        default=None,
        help="result file name (unset: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)",
    )
    report.add_argument("--label", default=None, help="label of the results (default: the backend)")
    return parser


def parse_metric_options(options: Any) -> tuple[list[str], list[float]]:
    selected = [name.strip() for name in options.percentile_metrics.split(",") if name.strip()]
    unknown = [name for name in selected if name not in METRICS]
    if unknown:
        raise ConfigError(
            f"--percentile-metrics: unknown metric {unknown[0]!r}; choose from {', '.join(METRICS)}",
            param="percentile-metrics",
        )
    try:
        percents = [float(value) for value in options.metric_percentiles.split(",") if value.strip()]
    except ValueError:
        raise ConfigError(
            f"--metric-percentiles: expected numbers like 50,90,99, got {options.metric_percentiles!r}",
            param="metric-percentiles",
        ) from None
    if any(not 0 < percent < 100 for percent in percents):
        raise ConfigError(
            "--metric-percentiles: each must be between 0 and 100 (exclusive)", param="metric-percentiles"
        )
    return selected, percents


def run(argv: list[str]) -> int:
    parser = build_parser()
    if help_request(argv) is not None:
        print(parser.format_help())
        return 0
    options = parser.parse_args(argv)
    selected, percents = parse_metric_options(options)
    endpoint = options.endpoint or ("/v1/chat/completions" if options.backend == "openai-chat" else "/v1/completions")
    kind = endpoint_kind(endpoint)
    if options.backend == "openai-chat" and kind != CHAT:
        raise ConfigError(
            f"--backend openai-chat streams chat completions; --endpoint {endpoint} is not one", param="endpoint"
        )
    if options.dataset_name == "sharegpt" and not options.dataset_path:
        raise ConfigError(
            "--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)", param="dataset-path"
        )
    base_url = (options.base_url or f"http://{options.host}:{options.port}").rstrip("/")
    headers = request_headers()
    model = options.model or fetch_model_id(base_url, headers)
    tokenizer_tag = options.tokenizer or model
    tokenizer = load_tokenizer(tokenizer_tag, options.tokenizer_mode)

    import numpy as np

    rng = np.random.default_rng(options.seed)
    if options.dataset_name == "random":
        requests = random_text_requests(
            rng,
            tokenizer,
            options.num_prompts,
            options.random_input_len,
            options.random_output_len,
            range_ratio=options.random_range_ratio,
            prefix_len=options.random_prefix_len,
        )
    else:
        requests = sharegpt_requests(
            rng, options.dataset_path, tokenizer, options.num_prompts, output_len=options.sharegpt_output_len
        )
    sampling = {
        name: value
        for name, value in (
            ("temperature", options.temperature),
            ("top_p", options.top_p),
            ("top_k", options.top_k),
            ("min_p", options.min_p),
        )
        if value is not None
    }
    sampling.setdefault("temperature", 0.0)  # greedy unless asked, as vLLM's client does

    # vLLM's --lora-modules: an adapter per request, drawn once so every run sends the same mix
    lora_rng = random.Random(options.seed)
    adapter_of = (
        {id(request): lora_rng.choice(options.lora_modules) for request in requests} if options.lora_modules else {}
    )

    def payload_for(request: SampleRequest) -> dict[str, Any]:
        if not isinstance(request.prompt, str):  # both datasets above give text prompts
            raise TypeError(f"bench serve sends text prompts, got token ids: {request.prompt[:8]}...")
        return build_payload(
            kind,
            adapter_of.get(id(request)) or options.served_model_name or model,
            request.prompt,
            request.expected_output_len,
            ignore_eos=options.ignore_eos,
            sampling=sampling,
            extra_body=options.extra_body,
        )

    run_results, duration = asyncio.run(
        benchmark(
            requests,
            url=base_url + endpoint,
            kind=kind,
            payload_for=payload_for,
            headers=headers,
            rng=rng,
            request_rate=options.request_rate,
            burstiness=options.burstiness,
            max_concurrency=options.max_concurrency,
            num_warmups=options.num_warmups,
            ready_timeout=options.ready_check_timeout_sec,
            show_progress=not options.disable_tqdm,
        )
    )
    metrics = calculate_metrics(
        run_results, duration, percents, lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    )
    print(
        "\n".join(
            summary_lines(metrics, selected, max_concurrency=options.max_concurrency, request_rate=options.request_rate)
        )
    )
    if metrics.completed == 0:
        first_error = next((result.error for result in run_results if result.error), "")
        print(f"All requests failed; the first error: {first_error}")
    if options.save_result:
        path = save_result(options, metrics, run_results, selected, model=model, tokenizer_id=tokenizer_tag)
        print(f"Results saved to {path}")
    return 0 if metrics.completed else 1


async def benchmark(
    requests: Sequence[SampleRequest],
    *,
    url: str,
    kind: str,
    payload_for: Any,
    headers: dict[str, str],
    rng: Any,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    ready_timeout: float = 600,
    show_progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (after a readiness check and warm-up) as they arrive, at most
    ``max_concurrency`` at a time; returns their results in order and the duration in seconds."""
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:

        async def send(request: SampleRequest) -> RequestResult:
            if semaphore is None:
                return await send_request(client, url, kind, payload_for(request), request.prompt_len, headers)
            async with semaphore:
                return await send_request(client, url, kind, payload_for(request), request.prompt_len, headers)

        if ready_timeout > 0:
            print("Starting initial single prompt test run...")
            await wait_until_ready(lambda: send(requests[0]), url, ready_timeout)
            print("Initial test run completed. Starting main benchmark run...")
        if num_warmups:
            print(f"Warming up with {num_warmups} requests...")
            warmups = await asyncio.gather(*(send(requests[index % len(requests)]) for index in range(num_warmups)))
            print(f"Warmup done ({sum(not result.success for result in warmups)} failed)")
        print(f"Traffic request rate: {request_rate}")
        print(f"Burstiness factor: {burstiness} ({'Poisson process' if burstiness == 1.0 else 'Gamma distribution'})")
        print(f"Maximum request concurrency: {max_concurrency}")

        progress = tqdm(total=len(requests), disable=not show_progress)

        async def send_and_count(request: SampleRequest) -> RequestResult:
            result = await send(request)
            progress.update(1)
            return result

        started = time.perf_counter()
        tasks = []
        for index, request in enumerate(requests):
            if index and request_rate != float("inf"):
                # gamma gaps of mean 1/rate; shape 1 is the exponential gap of a Poisson process
                await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))))
            tasks.append(asyncio.create_task(send_and_count(request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started
        progress.close()
    return results, duration


async def wait_until_ready(send_one: Any, url: str, timeout: float) -> None:
    """Send one request until it succeeds; retry only while the server is unreachable or
    starting (a refused request is a wrong argument, reported at once)."""
    deadline = time.monotonic() + timeout
    while True:
        result = await send_one()
        if result.success:
            return
        retry = result.unreachable or result.status_code in RETRY_STATUSES
        if not retry or time.monotonic() >= deadline:
            waited = f" (waited {timeout:.0f}s for the server)" if retry else ""
            raise ConfigError(
                f"the initial test request to {url} failed{waited}: {result.error}; check --base-url, "
                "--endpoint and --model"
            )
        await asyncio.sleep(1.0)


def fetch_model_id(base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists at /v1/models (when --model is not given)."""
    import httpx

    try:
        response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        model_id: str = response.json()["data"][0]["id"]
        return model_id
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the model name from {base_url}/v1/models ({type(exc).__name__}: {exc}); pass --model",
            param="model",
        ) from None


def load_tokenizer(tag: str, tokenizer_mode: str = "auto") -> Any:
    """The tokenizer of a model as tokenloom resolves it (a packaged name, a directory, a .gguf
    file, a cached Hugging Face repo): its model source and load format read it offline. A
    directory that holds only tokenizer files is read with ``AutoTokenizer``."""
    from tokenloom.core.config import ModelConfig
    from tokenloom.core.model_loader import choose_load_format, resolve_source
    from tokenloom.plugins.manager import load_plugins

    model_config = ModelConfig(model=tag, tokenizer_mode=tokenizer_mode)
    plugins = load_plugins()
    try:
        resolved = resolve_source(tag, plugins, model_config, None)
        try:
            _, load_format = choose_load_format("auto", resolved.path, resolved.load_format, plugins)
        except TokenloomError:
            if not os.path.isdir(resolved.path):
                raise
            return _tokenizer_directory(resolved.path, tokenizer_mode)
        return load_format.load_tokenizer(resolved.path, model_config)
    except TokenloomError as exc:
        raise ConfigError(
            f"cannot load a tokenizer for {tag!r}: {exc}; pass --tokenizer with a packaged model name, "
            "a model directory or a .gguf file",
            param="tokenizer",
        ) from None


def _tokenizer_directory(path: str, tokenizer_mode: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=tokenizer_mode != "slow")
    except Exception as exc:  # transformers raises many kinds for missing or broken files
        raise ConfigError(
            f"cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}", param="tokenizer"
        ) from None


def save_result(
    options: Any,
    metrics: Any,
    results: Sequence[RequestResult],
    selected: Sequence[str],
    *,
    model: str,
    tokenizer_id: str,
) -> str:
    """Write the result file as vLLM names and fills it; returns its path."""
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = options.label or options.backend
    document: dict[str, Any] = {
        "date": now,
        "endpoint_type": options.backend,
        "backend": options.backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": options.num_prompts,
        "request_rate": options.request_rate if options.request_rate != float("inf") else "inf",
        "burstiness": options.burstiness,
        "max_concurrency": options.max_concurrency,
        **result_json(metrics, results, selected),
    }
    if not options.save_detailed:
        for key in DETAILED_KEYS:
            document.pop(key, None)
    concurrency = f"-concurrency{options.max_concurrency}" if options.max_concurrency is not None else ""
    model_base = model.rstrip("/").split("/")[-1]
    filename = options.result_filename or f"{label}-{options.request_rate}qps{concurrency}-{model_base}-{now}.json"
    path = os.path.join(options.result_dir, filename) if options.result_dir else filename
    write_json(path, document)
    return path
