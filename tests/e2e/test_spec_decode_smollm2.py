"""Speculative decoding on the real SmolLM2 GGUF, over HTTP with the ``openai`` client, by
n-gram prompt lookup and by a draft model (SmolLM2 itself, whose greedy drafts the target must
all accept): greedy output identical to a server without speculation, at c=1 and in a
concurrent mixed batch (plain, JSON-schema constrained, stop strings, logprobs, sampled), with
drafts really accepted (the vLLM spec-decode metrics say so)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, REWRITE, spec_decode_counter, start_server, stop_server

pytestmark = pytest.mark.slow

# float32: in bfloat16 a verification step (several query rows) runs other kernels than a
# one-token decode step, and their rounding can flip a near-tie argmax (as in vLLM)
COMMON = ["smollm2", "--dtype", "float32", "--max-model-len", "1024", "--api-key", API_KEY]
COMMON += ["--kv-cache-memory-bytes", "256M"]
# the proposers' entry point is only discovered once tokenloom is reinstalled; --plugin loads it
# by name meanwhile (and is a no-op after)
SPECULATIVE = [
    "--plugin",
    "tokenloom.builtin_plugins.proposers",
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}',
]
PROMPTS = [REWRITE, "The capital of France is", "List the days of the week:", "Q: What is 12 times 7?\nA:"]


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    server = start_server(COMMON, str(tmp_path_factory.mktemp("spec-plain") / "plain.log"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def servers(plain_server, tmp_path_factory):
    speculative = start_server(COMMON + SPECULATIVE, str(tmp_path_factory.mktemp("spec-ngram") / "speculative.log"))
    yield plain_server, speculative
    stop_server(speculative)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


def accepted_tokens(server) -> float:
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    match = re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{model_name="smollm2"\} (\S+)$', text, re.M)
    assert match, "the spec-decode metrics are missing"
    return float(match.group(1))


def completion_tokens(server, prompt: str, max_tokens: int = 80) -> tuple[list[str], str]:
    response = client(server).completions.create(
        model="smollm2", prompt=prompt, temperature=0.0, max_tokens=max_tokens, logprobs=1
    )
    choice = response.choices[0]
    return choice.logprobs.tokens, choice.finish_reason


def test_single_stream_greedy_is_identical_and_drafts_are_accepted(servers):
    plain, speculative = servers
    before = accepted_tokens(speculative)
    for prompt in PROMPTS:
        assert completion_tokens(speculative, prompt) == completion_tokens(plain, prompt)
    assert accepted_tokens(speculative) > before


def test_chat_rewrite_is_identical(servers):
    plain, speculative = servers

    def chat(server) -> str:
        response = client(server).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": REWRITE}], temperature=0.0, max_tokens=120
        )
        return response.choices[0].message.content

    assert chat(speculative) == chat(plain)


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


async def mixed_batch(server) -> list:
    # closed inside this event loop: a client left to the garbage collector closes its
    # connections later, in whichever test's loop is running then, and fails that test
    async with async_client(server) as api:
        requests = [
            api.completions.create(model="smollm2", prompt=PROMPTS[0], temperature=0.0, max_tokens=60),
            api.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Give the city of Paris and the days of the week as JSON."}],
                temperature=0.0,
                max_tokens=120,
                response_format={"type": "json_schema", "json_schema": {"name": "week", "schema": SCHEMA}},
            ),
            api.completions.create(model="smollm2", prompt=PROMPTS[2], temperature=0.0, max_tokens=60, stop=["Friday"]),
            api.completions.create(model="smollm2", prompt=PROMPTS[3], temperature=0.0, max_tokens=40, logprobs=2),
            api.completions.create(model="smollm2", prompt=PROMPTS[1], temperature=0.9, seed=3, max_tokens=40),
        ]
        return await asyncio.gather(*requests)


@pytest.fixture(scope="module")
def plain_mixed_batch(plain_server):
    return asyncio.run(mixed_batch(plain_server))


def test_concurrent_mixed_batch_is_identical(servers, plain_mixed_batch):
    assert_mixed_batches_match(asyncio.run(mixed_batch(servers[1])), plain_mixed_batch)


def assert_mixed_batches_match(got: list, expected: list) -> None:
    assert got[0].choices[0].text == expected[0].choices[0].text
    assert got[1].choices[0].message.content == expected[1].choices[0].message.content
    json.loads(got[1].choices[0].message.content)  # the constraint held
    assert got[2].choices[0].text == expected[2].choices[0].text
    assert got[2].choices[0].finish_reason == expected[2].choices[0].finish_reason
    assert got[3].choices[0].logprobs.tokens == expected[3].choices[0].logprobs.tokens
    for have, want in zip(got[3].choices[0].logprobs.token_logprobs, expected[3].choices[0].logprobs.token_logprobs):
        assert have == pytest.approx(want, abs=1e-3)
    assert got[4].usage.completion_tokens == 40  # the sampled one just shares the batch


# -- the draft-model method: SmolLM2 drafting for itself --------------------------------------

DRAFT_MODEL = [
    "--plugin",
    "tokenloom.builtin_plugins.proposers",
    "--speculative-config",
    '{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3}',
]


@pytest.fixture(scope="module")
def draft_server(plain_server, tmp_path_factory):
    # beside the module's plain server (its reference), started only when a draft test runs
    server = start_server(COMMON + DRAFT_MODEL, str(tmp_path_factory.mktemp("spec-draft") / "draft.log"))
    yield server
    stop_server(server)


def test_draft_model_single_stream_is_identical_and_fully_accepted(plain_server, draft_server):
    drafted_before = spec_decode_counter(draft_server, "smollm2", "num_draft_tokens")
    accepted_before = spec_decode_counter(draft_server, "smollm2", "num_accepted_tokens")
    for prompt in PROMPTS[:3]:
        assert completion_tokens(draft_server, prompt, 48) == completion_tokens(plain_server, prompt, 48)
    drafted = spec_decode_counter(draft_server, "smollm2", "num_draft_tokens") - drafted_before
    accepted = spec_decode_counter(draft_server, "smollm2", "num_accepted_tokens") - accepted_before
    # the target drafting for itself: its greedy drafts are its own argmax, every one accepted
    assert drafted > 0
    assert accepted == drafted


def test_draft_model_structured_output_is_identical(plain_server, draft_server):
    def week(server) -> str:
        response = client(server).chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Give the city of Paris and the days of the week as JSON."}],
            temperature=0.0,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "week", "schema": SCHEMA}},
        )
        return response.choices[0].message.content

    got = week(draft_server)
    assert got == week(plain_server)
    json.loads(got)  # the constraint held


def test_draft_model_concurrent_mixed_batch_is_identical(draft_server, plain_mixed_batch):
    assert_mixed_batches_match(asyncio.run(mixed_batch(draft_server)), plain_mixed_batch)
