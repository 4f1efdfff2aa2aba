"""The model runner tells its platform of every step when it ends (``Platform.finish_step``):
with the step's token count, all its requests' together, and also when the step fails. On a tiny
random Llama GGUF through the offline API (``LLM``)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType
from helpers.gguf_files import tiny_model_state_dict, write_model_gguf

from tokenloom import LLM, SamplingParams

PROMPTS = [[5 + (7 * index + 3 * position) % 80 for position in range(9 + 5 * index)] for index in range(3)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    config, state_dict = tiny_model_state_dict("llama", seed=3)
    path = str(tmp_path_factory.mktemp("llama") / "model.gguf")
    model = write_model_gguf(path, "llama", config, state_dict, quant_type=GGMLQuantizationType.Q4_1)
    return LLM(
        model=model, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=3 * 2**20, skip_tokenizer_init=True
    )


def test_the_platform_hears_of_every_step_with_its_token_count(llm, monkeypatch):
    runner = llm.engine.executor.worker.runner
    steps: list[int] = []
    monkeypatch.setattr(runner.platform, "finish_step", steps.append)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params)
    # the three prompts (9 + 14 + 19 tokens) in one step, then two steps of one token each
    assert steps == [42, 3, 3]


def test_a_failed_step_is_heard_of_too(llm, monkeypatch):
    runner = llm.engine.executor.worker.runner
    steps: list[int] = []
    monkeypatch.setattr(runner.platform, "finish_step", steps.append)

    def broken(*args, **kwargs):
        raise RuntimeError("the model broke")

    monkeypatch.setattr(runner, "_run_model", broken)
    with pytest.raises(RuntimeError, match="the model broke"):
        runner.execute(_one_prompt_step(llm))
    assert steps == [9]


def _one_prompt_step(llm: LLM):
    """A scheduler's first step for PROMPTS[0] alone."""
    engine = llm.engine
    engine.add_request("failing", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=1))
    return engine.scheduler.schedule()
