"""Speculative decoding on the real SmolLM2 GGUF, over HTTP with the ``openai`` client, by three
draft sources: n-gram prompt lookup, a draft model that agrees (SmolLM2 itself, whose greedy
drafts the target must all accept) and one that disagrees (a tiny random Llama with SmolLM2's
tokenizer, whose drafts the target rejects). Each must give the greedy token ids of a server
without speculation, at c=1 (plain and JSON-schema constrained, completions and chat) and in a
concurrent mixed batch (plain, constrained, stop strings, logprobs, sampled), and the vLLM
spec-decode metrics must show the drafts verified as that source predicts.

The plain server is the module's one reference and its outputs are computed once; the
speculative servers run one at a time (one method per server), each through the same proofs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import openai
import pytest

from tests.e2e.conftest import (
    API_KEY,
    REWRITE,
    RunningServer,
    spec_decode_accepted_per_position,
    spec_decode_counter,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2"
# float32: in bfloat16 a verification step (several query rows) runs other kernels than a
# one-token decode step, and their rounding can flip a near-tie argmax (as in vLLM)
COMMON = [MODEL, "--dtype", "float32", "--max-model-len", "1024", "--api-key", API_KEY]
COMMON += ["--kv-cache-memory-bytes", "256M"]
# the proposers' entry point is only discovered once tokenloom is reinstalled; --plugin loads it
# by name meanwhile (and is a no-op after)
PROPOSERS = ["--plugin", "tokenloom.builtin_plugins.proposers"]

# method -> its --speculative-config ("{draft}" is the random draft's directory) and what the
# target must do with its greedy drafts: accept "some" (prompt lookup hits where the output
# repeats text it has seen), "all" (the target drafting for itself proposes its own argmax) or
# "few" (a random draft that disagrees: when written it got 1 of 180 drafts accepted at c=1 and 2
# of 441 in the mixed batch, all at position 0, so a step that accepts some drafts and rejects the
# rest runs too). Never a fixed number per step: how many tokens a step drafts is the runner's.
METHODS = {
    "ngram": (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}',
        "some",
    ),
    "self-draft": ('{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3}', "all"),
    "random-draft": ('{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3}', "few"),
}

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEEK = [{"role": "user", "content": "Give the city of Paris and the days of the week as JSON."}]
WEEK_FORMAT = {"type": "json_schema", "json_schema": {"name": "week", "schema": SCHEMA}}
# the output's tokens as "token_id:N": the proofs compare ids, not their text
TOKEN_IDS = {"return_tokens_as_token_ids": True}


@dataclass
class SpeculativeServer:
    method: str
    expected_acceptance: str  # "some", "all" or "few" (see METHODS)
    server: RunningServer


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    server = start_server(COMMON, str(tmp_path_factory.mktemp("spec-plain") / "plain.log"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module", params=list(METHODS))
def speculative(request, plain_server, tmp_path_factory):
    # after the plain server, so the reference is up first; pytest runs every test of one
    # method before starting the next method's server, so at most two servers run at once
    config, expected_acceptance = METHODS[request.param]
    if "{draft}" in config:
        config = config.replace("{draft}", request.getfixturevalue("tiny_llama_dir"))
    log_path = str(tmp_path_factory.mktemp(f"spec-{request.param}") / "speculative.log")
    server = start_server(COMMON + PROPOSERS + ["--speculative-config", config], log_path)
    yield SpeculativeServer(request.param, expected_acceptance, server)
    stop_server(server)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY)


def single_stream(server: RunningServer) -> list[tuple[list[str], str]]:
    """One request at a time: the rewrite (chat: its answer quotes the prompt's code, where
    prompt lookup hits), a completion that repeats its own pattern (a numbered list of days),
    and a JSON-schema constrained chat. Each as its token ids and finish reason (the first and
    last end by themselves, well inside max_tokens)."""
    api = client(server)
    rewrite = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": REWRITE}],
        temperature=0.0,
        max_tokens=72,
        logprobs=True,
        extra_body=TOKEN_IDS,
    ).choices[0]
    days = api.completions.create(
        model=MODEL,
        prompt="List the days of the week:",
        temperature=0.0,
        max_tokens=32,
        logprobs=1,
        extra_body=TOKEN_IDS,
    ).choices[0]
    week = api.chat.completions.create(
        model=MODEL,
        messages=WEEK,
        temperature=0.0,
        max_tokens=96,
        response_format=WEEK_FORMAT,
        logprobs=True,
        extra_body=TOKEN_IDS,
    ).choices[0]
    json.loads(week.message.content)  # the constraint held
    return [
        ([entry.token for entry in rewrite.logprobs.content], rewrite.finish_reason),
        (days.logprobs.tokens, days.finish_reason),
        ([entry.token for entry in week.logprobs.content], week.finish_reason),
    ]


async def mixed_batch(server: RunningServer) -> list:
    # closed inside this event loop: a client left to the garbage collector closes its
    # connections later, in whichever test's loop is running then, and fails that test
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY) as api:
        requests = [
            api.completions.create(model=MODEL, prompt=REWRITE, temperature=0.0, max_tokens=48),
            api.chat.completions.create(
                model=MODEL, messages=WEEK, temperature=0.0, max_tokens=96, response_format=WEEK_FORMAT
            ),
            api.completions.create(
                model=MODEL, prompt="List the days of the week:", temperature=0.0, max_tokens=64, stop=["Friday"]
            ),
            api.completions.create(
                model=MODEL, prompt="Q: What is 12 times 7?\nA:", temperature=0.0, max_tokens=24, logprobs=2
            ),
            api.completions.create(
                model=MODEL,
                prompt="The capital of France is",
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


@dataclass
class Verified:
    """What a server's spec-decode counters gained over a stretch of requests."""

    drafted: float
    accepted: float
    accepted_per_position: list[float]


class VerificationCounter:
    def __init__(self, server: RunningServer):
        self.server = server
        self.start = self.read()

    def read(self) -> Verified:
        return Verified(
            spec_decode_counter(self.server, MODEL, "num_draft_tokens"),
            spec_decode_counter(self.server, MODEL, "num_accepted_tokens"),
            spec_decode_accepted_per_position(self.server, MODEL),
        )

    def since_start(self) -> Verified:
        now = self.read()
        return Verified(
            now.drafted - self.start.drafted,
            now.accepted - self.start.accepted,
            [after - before for after, before in zip(now.accepted_per_position, self.start.accepted_per_position)],
        )


def assert_verified_as_expected(verified: Verified, expected_acceptance: str) -> None:
    """Drafts were verified, the counters agree with each other, and the acceptance is what
    the draft source predicts ("some", "all", "few", or "any")."""
    counts = (
        f"{verified.accepted:g} of {verified.drafted:g} drafts accepted, per position {verified.accepted_per_position}"
    )
    assert verified.drafted > 0, counts
    assert 0 <= verified.accepted <= verified.drafted, counts
    # a draft at position j counts only after the ones before it were accepted
    assert sum(verified.accepted_per_position) == verified.accepted, counts
    per_position = verified.accepted_per_position
    assert all(later <= earlier for earlier, later in zip(per_position, per_position[1:])), counts
    if expected_acceptance == "all":
        assert verified.accepted == verified.drafted, counts
    elif expected_acceptance == "some":
        assert verified.accepted > 0, counts
    elif expected_acceptance == "few":
        assert verified.accepted < verified.drafted / 2, counts


def test_single_stream_greedy_ids_are_identical(speculative, plain_single_stream):
    counter = VerificationCounter(speculative.server)
    got = single_stream(speculative.server)
    for have, want in zip(got, plain_single_stream):
        assert have == want
    assert_verified_as_expected(counter.since_start(), speculative.expected_acceptance)


def test_concurrent_mixed_batch_is_identical(speculative, plain_mixed_batch):
    counter = VerificationCounter(speculative.server)
    got = asyncio.run(mixed_batch(speculative.server))
    expected = plain_mixed_batch
    assert got[0].choices[0].text == expected[0].choices[0].text
    assert got[1].choices[0].message.content == expected[1].choices[0].message.content
    json.loads(got[1].choices[0].message.content)  # the constraint held
    assert got[2].choices[0].text == expected[2].choices[0].text
    assert got[2].choices[0].finish_reason == expected[2].choices[0].finish_reason == "stop"
    assert got[3].choices[0].logprobs.tokens == expected[3].choices[0].logprobs.tokens
    for have, want in zip(got[3].choices[0].logprobs.token_logprobs, expected[3].choices[0].logprobs.token_logprobs):
        assert have == pytest.approx(want, abs=1e-3)
    # the sampled request keeps the target's distribution, not the plain server's draws (its
    # random stream is consumed by acceptance tests and residual draws): it just shares the batch
    assert got[4].usage.completion_tokens == 24
    verified = counter.since_start()
    # the sampled request's drafts are accepted with probability min(1, p/q), so even the target
    # drafting for itself may lose one to rounding: "all" holds for greedy drafts only
    expected_acceptance = "any" if speculative.expected_acceptance == "all" else speculative.expected_acceptance
    assert_verified_as_expected(verified, expected_acceptance)
