"""Draft-model speculation on the real SmolLM2 GGUF, over HTTP with the ``openai`` client: the
target as its own draft, named by the packaged name ``smollm2`` in ``--speculative-config``
(the older ``--speculative-model`` flags map onto the same config: tests/api/test_serve_args.py).
Greedy output identical to a server without speculation at c=1 and in a concurrent mixed batch
(plain, JSON-schema constrained, stop strings, logprobs, a sampled request), with every greedy
draft accepted (the vLLM spec-decode metrics say so: the draft computes what the target does);
and a draft with another tokenizer stops the server with a message naming both models."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from tests.e2e.conftest import API_KEY, start_server, stop_server
from tests.e2e.test_spec_decode_smollm2 import COMMON, PROMPTS, client, mixed_batch

pytestmark = pytest.mark.slow

PROPOSERS = ["--plugin", "tokenloom.builtin_plugins.proposers"]  # until the entry point is installed
DRAFT = ["--speculative-config", '{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3}']


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("draft-servers")
    plain = start_server(COMMON, str(directory / "plain.log"))
    try:
        speculative = start_server(COMMON + PROPOSERS + DRAFT, str(directory / "draft.log"))
    except Exception:
        stop_server(plain)
        raise
    yield plain, speculative
    stop_server(speculative)
    stop_server(plain)


def completion_tokens(server, prompt: str) -> tuple[list[str], str]:
    response = client(server).completions.create(
        model="smollm2", prompt=prompt, temperature=0.0, max_tokens=40, logprobs=1
    )
    choice = response.choices[0]
    return choice.logprobs.tokens, choice.finish_reason


def spec_counters(server) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from /metrics."""
    text = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    values = []
    for name in ("num_draft_tokens", "num_accepted_tokens"):
        match = re.search(rf'^vllm:spec_decode_{name}_total\{{model_name="smollm2"\}} (\S+)$', text, re.M)
        assert match, f"the spec-decode metric {name} is missing"
        values.append(float(match.group(1)))
    return values[0], values[1]


def test_single_stream_greedy_is_identical_and_every_draft_accepted(servers):
    plain, speculative = servers
    drafted_before, accepted_before = spec_counters(speculative)
    for prompt in PROMPTS[:3]:
        assert completion_tokens(speculative, prompt) == completion_tokens(plain, prompt)
    drafted, accepted = spec_counters(speculative)
    assert drafted > drafted_before
    assert accepted - accepted_before == drafted - drafted_before  # acceptance 100%


def test_concurrent_mixed_batch_is_identical(servers):
    plain, speculative = servers
    expected = asyncio.run(mixed_batch(plain))
    got = asyncio.run(mixed_batch(speculative))
    assert got[0].choices[0].text == expected[0].choices[0].text
    assert got[1].choices[0].message.content == expected[1].choices[0].message.content
    json.loads(got[1].choices[0].message.content)  # the constraint held
    assert got[2].choices[0].text == expected[2].choices[0].text
    assert got[2].choices[0].finish_reason == expected[2].choices[0].finish_reason
    assert got[3].choices[0].logprobs.tokens == expected[3].choices[0].logprobs.tokens
    for have, want in zip(
        got[3].choices[0].logprobs.token_logprobs, expected[3].choices[0].logprobs.token_logprobs, strict=True
    ):
        assert have == pytest.approx(want, abs=1e-3)
    assert got[4].usage.completion_tokens == 40  # the sampled one, its drafts with probabilities


def test_a_draft_with_another_tokenizer_stops_the_server_naming_both(tmp_path):
    """Gemma 3 as the draft of SmolLM2: the server refuses to start, and says why."""
    log = tmp_path / "refused.log"
    with pytest.raises(RuntimeError, match="exited"):
        start_server(
            COMMON + PROPOSERS + ["--speculative-model", "gemma3-270m", "--num-speculative-tokens", "3"], str(log)
        )
    text = log.read_text()
    assert "different vocabularies" in text and "gemma3-270m" in text
