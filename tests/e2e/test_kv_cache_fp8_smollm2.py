"""The real `tokenloom serve smollm2 --kv-cache-dtype fp8`: it serves chat and completions over
HTTP (the official `openai` client), its start-up log reports an 8-bit cache of twice the
blocks a 16-bit cache gets from the same memory, and the CLI refuses `fp8_inc` by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server

pytestmark = pytest.mark.slow

KV_CACHE_BYTES = 64 * 2**20  # --kv-cache-memory-bytes 64M: the budget, not the sequence cap, sizes the cache
# SmolLM2-135M: 30 layers, 3 KV heads of 64; a block of 16 tokens holds K and V of each
FP8_BYTES_PER_BLOCK = 30 * 2 * 16 * 3 * 64
BFLOAT16_BYTES_PER_BLOCK = 2 * FP8_BYTES_PER_BLOCK


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    server = start_server(
        ["smollm2", "--max-model-len", "1024", "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "64M"],
        log_path,
        timeout=600.0,  # a start on a busy shared CPU
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(fp8_server):
    return openai.OpenAI(base_url=fp8_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_the_cache_is_fp8_e4m3_with_twice_the_blocks_of_a_16_bit_cache(fp8_server):
    log = fp8_server.log()
    match = re.search(r"KV cache: (\d+) blocks of 16 tokens, (\w+), (\d+) bytes per block", log)
    assert match, log[-3000:]
    num_blocks, dtype, bytes_per_block = int(match[1]), match[2], int(match[3])
    assert dtype == "float8_e4m3fn"  # fp8 is e4m3, as in vLLM
    assert bytes_per_block == FP8_BYTES_PER_BLOCK
    assert num_blocks == KV_CACHE_BYTES // FP8_BYTES_PER_BLOCK
    assert num_blocks >= 2 * (KV_CACHE_BYTES // BFLOAT16_BYTES_PER_BLOCK)
    assert re.search(rf"engine ready in [\d.]+s: \w+, {num_blocks} KV blocks of 16 tokens", log)


def test_chat_and_completions_are_served_from_the_fp8_cache(client):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0.0,
    )
    # (the content is not checked: this small model answers this one in French, with a 16-bit cache too)
    assert chat.choices[0].message.content.strip() and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 24
    completion = client.completions.create(
        model="smollm2", prompt="One, two, three, four,", max_tokens=12, temperature=0.0
    )
    assert "five" in completion.choices[0].text.lower()
    assert completion.usage.completion_tokens == 12


def test_streamed_greedy_tokens_equal_the_whole_response(client):
    prompt = "Write a haiku about the sea.\n"
    whole = client.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0.0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=40, temperature=0.0, stream=True
        )
        if chunk.choices
    )
    assert streamed == whole.choices[0].text


def test_the_cli_refuses_fp8_inc_by_name():
    result = subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", "smollm2", "--kv-cache-dtype", "fp8_inc"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        timeout=120,
    )
    assert result.returncode != 0
    assert "--kv-cache-dtype: fp8_inc" in result.stderr + result.stdout
