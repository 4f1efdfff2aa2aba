"""The real `tokenloom serve --kv-transfer-config` with the SharedStorageConnector, over HTTP with
the openai client, on a tiny random Llama with a 2k context (float32): a 1,500-token prompt sent,
the server stopped and started again on the same directory, the prompt sent again: the same
greedy text, the prefix counted as the connector's (metrics and usage's cached tokens) and only
the tail computed. Then disaggregated prefill: a kv_producer and a kv_consumer behind
examples/disaggregated_prefill_proxy.py answer as the first server did (a single instance with
nothing to load), the consumer computing only the tail. Time to first token is not asserted (benchmarks/BENCHMARKS.md records it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, RunningServer, free_port, start_server, stop_server, wait_ready

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PROMPT = [(37 * i + 11) % 3000 + 100 for i in range(1500)]
NUM_FROM_CONNECTOR = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 1488: all but the last token's block
MODEL = "tiny-long"


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory, smollm2_gguf):
    """A tiny random Llama (2 layers, seed 0) with a 2,048-token context and SmolLM2's tokenizer."""
    import torch
    from helpers.tiny_llama import tiny_llama_config
    from transformers import LlamaForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    directory = tmp_path_factory.mktemp("tiny-long-llama")
    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.save_pretrained(directory)
    config = tiny_llama_config(tokenizer, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    return str(directory)


def serve(model_dir: str, log_path: str, store=None, role: str = "kv_both") -> RunningServer:
    args = [
        model_dir,
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        "160",
        "--enable-prompt-tokens-details",
        "--plugin",
        "tokenloom.builtin_plugins.kv_connectors",
    ]
    if store is not None:
        kv_transfer = {
            "kv_connector": "SharedStorageConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
        args += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return start_server(args, log_path)


def complete(base_url: str) -> tuple[str, int, list[float]]:
    """Greedy text, usage's cached prompt tokens and the chosen tokens' logprobs for PROMPT (a
    wrong KV block that leaves a random model's greedy text unchanged still moves them)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    details = response.usage.prompt_tokens_details
    return (
        response.choices[0].text,
        details.cached_tokens if details else 0,
        response.choices[0].logprobs.token_logprobs,
    )


def assert_same_answer(got: tuple[str, int, list[float]], text: str, logprobs: list[float], cached: int) -> None:
    assert got[:2] == (text, cached)
    assert got[2] == pytest.approx(logprobs, abs=1e-3)


def metric(server: RunningServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for_blocks(store, count: int, timeout: float = 120.0) -> None:
    """The saver thread stores after the request returned: wait for its files."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [name for _, _, names in os.walk(store) for name in names if name.endswith(".kvblock")]
        if len(files) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{count} block files expected in {store}, found {len(files)}")


@pytest.fixture(scope="module")
def first_run(long_llama_dir, tmp_path_factory):
    """A server on an empty store answers PROMPT as any single instance does (nothing to load),
    stores its blocks and is stopped: (the store, the answer, the server's log)."""
    directory = tmp_path_factory.mktemp("first-run")
    store = directory / "kv"
    server = serve(long_llama_dir, str(directory / "serve.log"), store)
    try:
        text, cached, logprobs = complete(server.base_url)
        assert cached == 0 and metric(server, "vllm:external_prefix_cache_hits_total") == 0
        wait_for_blocks(store, NUM_FROM_CONNECTOR // BLOCK_SIZE)
    finally:
        stop_server(server)
    return store, (text, logprobs), server.log()


def test_a_restarted_server_takes_the_prefix_from_the_directory(long_llama_dir, tmp_path, first_run):
    store, answer, first_log = first_run
    assert re.search(r"KV connector SharedStorageConnector \(kv_both\): blocks in " + re.escape(str(store)), first_log)
    second = serve(long_llama_dir, str(tmp_path / "second.log"), store)
    try:
        assert_same_answer(complete(second.base_url), *answer, cached=NUM_FROM_CONNECTOR)
        assert metric(second, "vllm:external_prefix_cache_queries_total") == NUM_FROM_CONNECTOR
        assert metric(second, "vllm:external_prefix_cache_hits_total") == NUM_FROM_CONNECTOR
        assert metric(second, "vllm:kv_connector_blocks_loaded_total") == NUM_FROM_CONNECTOR // BLOCK_SIZE
        assert metric(second, "vllm:kv_connector_load_failures_total") == 0
        assert metric(second, "vllm:kv_connector_bytes_loaded_total") > 0
    finally:
        stop_server(second)


def test_a_producer_and_a_consumer_behind_the_proxy_answer_as_one_instance(long_llama_dir, tmp_path, first_run):
    answer = first_run[1]
    store = tmp_path / "kv"
    producer = serve(long_llama_dir, str(tmp_path / "producer.log"), store, "kv_producer")
    consumer = serve(long_llama_dir, str(tmp_path / "consumer.log"), store, "kv_consumer")
    port = free_port()
    proxy_log = open(tmp_path / "proxy.log", "w")
    proxy = subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "examples", "disaggregated_prefill_proxy.py"),
            "--prefill",
            producer.base_url,
            "--decode",
            consumer.base_url,
            "--port",
            str(port),
        ],
        stdout=proxy_log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(RunningServer(proxy, f"http://127.0.0.1:{port}", str(tmp_path / "proxy.log")), timeout=60)
        assert_same_answer(complete(f"http://127.0.0.1:{port}"), *answer, cached=NUM_FROM_CONNECTOR)
        # the producer computed the prompt and stored it; the consumer loaded it and stored nothing
        assert metric(producer, "vllm:kv_connector_blocks_stored_total") == NUM_FROM_CONNECTOR // BLOCK_SIZE
        assert metric(producer, "vllm:external_prefix_cache_hits_total") == 0
        assert metric(consumer, "vllm:external_prefix_cache_hits_total") == NUM_FROM_CONNECTOR
        assert metric(consumer, "vllm:kv_connector_blocks_stored_total") == 0
        # streamed through the proxy too: the consumer's local cache now holds the prefix
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == answer[0]
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        proxy_log.close()
        stop_server(consumer)
        stop_server(producer)
