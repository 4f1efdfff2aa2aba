"""LLMEngine's wiring: it never writes into the EngineConfig it was given; what it resolved
reaches the executor in a WorkerSpec; runner_type says which requests it serves."""

from __future__ import annotations

import pytest

from tokenloom import LLM
from tokenloom.core.config import EngineArgs
from tokenloom.core.executor import WorkerSpec
from tokenloom.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=4)


def test_the_config_stays_as_given_and_the_executor_gets_a_worker_spec(llm, tiny_llama_dir):
    engine = llm.engine
    assert engine.config == EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4).create_engine_config()
    assert engine.config.device.device == "auto"  # the choice is the engine's, not the config's
    spec = engine.executor.spec
    assert isinstance(spec, WorkerSpec) and spec.config is engine.config
    assert spec.model_info is engine.model_info and spec.platform == engine.platform == "cpu"
    assert (
        spec.plugin_tables["executor"]["uni"]["target"] == "tokenloom.builtin_plugins.executors.uniproc:UniProcExecutor"
    )


def test_runner_type_and_a_pooling_request_refused(llm):
    assert llm.engine.runner_type == "generate"
    with pytest.raises(InvalidRequestError, match="served for generation: it does not pool"):
        llm.engine.prepare_pooling_prompt("hello", None)
