"""Adaptive draft lengths through the real engine (tiny random Llama): the runner asks the
proposer for the length the request's own verifies so far give (replayed exactly), the metrics
count the drafts actually verified, ``adaptive_num_speculative_tokens: false`` asks for
``num_speculative_tokens`` always, a draft model runs only as many steps as the longest request
asks for, and greedy output stays that of plain decoding."""

from __future__ import annotations

import pytest

from tests.core.spec_decode.test_spec_decode_engine import PROMPTS, PROPOSERS, greedy, token_ids
from tokenloom import LLM
from tokenloom.core.spec_decode.draft_length import AcceptanceEstimate, DraftLengthPolicy

NUM_SPECULATIVE_TOKENS = 6
ROW_COST = 0.2


def ngram(**extra) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "verify_row_cost": ROW_COST,
        **extra,
    }


class StepLog:
    """Per request, in order: ``("ask", max_draft_tokens)`` for each proposer call and
    ``("verify", num_verified, num_accepted)`` for each step that verified its drafts. Within a
    step the runner verifies before it proposes, and the log keeps that order."""

    def __init__(self, llm: LLM):
        self.runner = llm.engine.executor.worker.runner
        self.events: dict[str, list[tuple]] = {}
        self.asked_this_step: list[tuple[str, int]] = []
        self.propose_calls: list[list[int]] = []
        propose, execute = self.runner.proposer.propose, self.runner.execute

        def logging_propose(requests):
            self.asked_this_step.extend((request.req_id, request.max_draft_tokens) for request in requests)
            self.propose_calls.append([request.max_draft_tokens for request in requests])
            return propose(requests)

        def logging_execute(scheduler_output):
            self.asked_this_step = []
            output = execute(scheduler_output)
            for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                sampled = output.sampled_token_ids.get(req_id)
                if drafts and sampled:
                    self.events.setdefault(req_id, []).append(("verify", len(drafts), len(sampled) - 1))
            for req_id, length in self.asked_this_step:
                self.events.setdefault(req_id, []).append(("ask", length))
            return output

        self.runner.proposer.propose = logging_propose
        self.runner.execute = logging_execute

    def asked(self) -> list[int]:
        return [event[1] for events in self.events.values() for event in events if event[0] == "ask"]

    def verified(self) -> tuple[int, int]:
        verifies = [event for events in self.events.values() for event in events if event[0] == "verify"]
        return sum(event[1] for event in verifies), sum(event[2] for event in verifies)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32")


def test_the_runner_asks_for_the_length_each_requests_acceptance_gives(tiny_llama_dir, plain):
    llm = LLM(model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=ngram())
    log = StepLog(llm)
    params = greedy(max_tokens=60)
    assert token_ids(llm, PROMPTS, params) == token_ids(plain, PROMPTS, params)
    policy = DraftLengthPolicy(NUM_SPECULATIVE_TOKENS, adaptive=True, verify_row_cost=ROW_COST)
    for req_id, events in log.events.items():
        estimate = AcceptanceEstimate()
        for event in events:
            if event[0] == "ask":
                assert event[1] == policy.next_length(estimate), (req_id, events)
            else:
                _, num_verified, num_accepted = event
                assert num_verified <= NUM_SPECULATIVE_TOKENS
                estimate.observe(num_verified, num_accepted)
    asked = log.asked()
    # the lengths moved with acceptance, both below and up to the maximum
    assert min(asked) < NUM_SPECULATIVE_TOKENS and max(asked) == NUM_SPECULATIVE_TOKENS
    # the metrics count the drafts that were verified, not num_speculative_tokens per step
    stats = llm.engine.stats().spec_decoding
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == log.verified()
    assert stats.num_draft_tokens < NUM_SPECULATIVE_TOKENS * stats.num_drafts


def test_off_asks_for_num_speculative_tokens_every_time(tiny_llama_dir, plain):
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        plugins=PROPOSERS,
        speculative_config=ngram(adaptive_num_speculative_tokens=False),
    )
    log = StepLog(llm)
    params = greedy(max_tokens=40)
    assert token_ids(llm, PROMPTS, params) == token_ids(plain, PROMPTS, params)
    assert set(log.asked()) == {NUM_SPECULATIVE_TOKENS}


def test_a_draft_model_runs_as_many_steps_as_the_longest_request_asks(tiny_llama_dir, plain):
    # the target as its own draft (every draft accepted), with rows so dear that a new request
    # drafts one token and the length grows as the acceptance shows
    config = {
        "method": "draft_model",
        "model": tiny_llama_dir,
        "num_speculative_tokens": 4,
        "verify_row_cost": 0.5,
    }
    llm = LLM(model=tiny_llama_dir, dtype="float32", plugins=PROPOSERS, speculative_config=config)
    log = StepLog(llm)
    proposer = log.runner.proposer
    runs_per_call: list[int] = []
    run = proposer._run

    def counting_run(inputs, requests):
        runs_per_call[-1] += 1
        return run(inputs, requests)

    propose = proposer.propose

    def counting_propose(requests):
        runs_per_call.append(0)
        return propose(requests)

    proposer.propose = counting_propose
    proposer._run = counting_run
    params = greedy(max_tokens=40)
    assert token_ids(llm, PROMPTS[1], params) == token_ids(plain, PROMPTS[1], params)
    assert len(runs_per_call) == len(log.propose_calls)
    for runs, asked in zip(runs_per_call, log.propose_calls):
        assert runs <= max(asked)
    assert log.propose_calls[0] == [1] and runs_per_call[0] == 1  # one draft step, not four
    assert max(log.asked()) == 4  # full acceptance grew the length to the maximum
    # most calls ran all the steps asked for (the rest were cut by the context's end)
    assert sum(runs == max(asked) for runs, asked in zip(runs_per_call, log.propose_calls)) >= len(runs_per_call) - 1
