"""The model runner's profile run (for platforms whose memory profile must include peak
activations, as the CUDA platform's does): one forward pass of the largest step over a
throwaway KV cache, before the platform measures the KV budget; the engine's own cache and
results are untouched. The CPU platform never asks for it."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=32, max_num_batched_tokens=40, max_num_seqs=4)
    yield llm
    llm.engine.shutdown()


def greedy(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(["Hello there", "1, 2, 3,"], params)]


def test_profile_run_is_one_largest_step_over_a_throwaway_cache(llm, monkeypatch):
    runner = llm.engine.executor.worker.runner
    before = greedy(llm)
    caches = list(runner.kv_caches)
    snapshot = [cache.clone() for cache in caches]
    calls = []
    forward = runner.model.forward

    def recording_forward(input_ids, positions, attn_metadata):
        calls.append((input_ids.shape[0], list(attn_metadata.query_lens_cpu), attn_metadata.kv_caches[0].shape[1]))
        return forward(input_ids, positions, attn_metadata)

    monkeypatch.setattr(runner.model, "forward", recording_forward)
    assert runner.profile_run() == 40
    # the 40-token budget as prompts of at most max_model_len (32) tokens, in 2 + 1 blocks of 16
    assert calls == [(40, [32, 8], 3)]
    assert all(a is b for a, b in zip(runner.kv_caches, caches))
    assert all(cache.equal(saved) for cache, saved in zip(runner.kv_caches, snapshot))
    monkeypatch.undo()
    assert greedy(llm) == before


def test_determine_num_blocks_profiles_before_the_platform_measures(llm, monkeypatch):
    runner = llm.engine.executor.worker.runner
    events = []
    monkeypatch.setattr(runner, "profile_run", lambda: events.append("profile"))
    monkeypatch.setattr(
        runner.platform, "kv_cache_budget_bytes", lambda utilization: events.append("budget") or 10**9, raising=True
    )
    runner.determine_num_blocks()
    assert events == ["budget"]  # the CPU platform does not ask for a profile
    events.clear()
    monkeypatch.setattr(runner.platform, "profiles_activations", True, raising=False)
    runner.determine_num_blocks()
    assert events == ["profile", "budget"]
