"""The scripted test model (tests/plugins/scripted_model): which scenario a prompt selects,
how far its script has got, and that it loads and runs through the real engine."""

from __future__ import annotations

import pytest

from tests.plugins.scripted_model.model import Script

EOS = 2
START = [1, 520, 198]  # what the chat template writes before the answer
TABLE = {
    "response_start_ids": START,
    "scenarios": {
        "short": {"marker_ids": [7, 8], "response_ids": [40, 41, 42]},
        "long": {"marker_ids": [7, 8, 9], "response_ids": [50, 51]},
        "newline_first": {"marker_ids": [5], "response_ids": [198, 60]},
    },
}


@pytest.fixture
def script():
    return Script(TABLE, eos_token_id=EOS)


def test_replays_the_scenario_token_by_token(script):
    prompt = [9, 7, 8, 3, *START]
    assert script.next_token(prompt) == 40
    assert script.next_token(prompt + [40]) == 41
    assert script.next_token(prompt + [40, 41, 42]) == EOS


def test_the_longest_marker_at_the_latest_position_wins(script):
    assert script.next_token([7, 8, 9, *START]) == 50
    # a later marker (e.g. in a tool result) chooses the scenario of the next answer
    assert script.next_token([7, 8, 9, 4, 7, 8, *START]) == 40


def test_text_the_template_adds_after_the_start_is_skipped(script):
    assert script.next_token([7, 8, *START, 11, 12]) == 40
    assert script.next_token([7, 8, *START, 11, 12, 40]) == 41


def test_the_start_of_the_answer_is_not_taken_from_the_prompt(script):
    # the prompt ends with token 198, the script's first token: it must still be generated
    assert script.next_token([5, *START]) == 198
    assert script.next_token([5, *START, 198]) == 60


def test_no_marker_or_no_answer_start_means_eos(script):
    assert script.next_token([3, 4, *START]) == EOS
    assert script.next_token([7, 8]) == EOS


@pytest.mark.slow
def test_the_engine_runs_the_scripted_model(tmp_path, smollm2_gguf):
    from tests.plugins.scripted_model.model_dir import RESPONSE_START, load_tokenizer, marker, write_model_dir
    from tokenloom import LLM, SamplingParams

    tokenizer = load_tokenizer(smollm2_gguf)
    model_dir = write_model_dir(str(tmp_path / "model"), tokenizer, {"hello": "Hello, <b>world</b>! Grüße 👋"})
    llm = LLM(model=model_dir, plugins=["tests.plugins.scripted_model"], max_model_len=512)
    prompt = f"<|im_start|>user\n{marker('hello')}<|im_end|>\n{RESPONSE_START}"
    kept = llm.generate([prompt], SamplingParams(max_tokens=50, skip_special_tokens=False))[0].outputs[0]
    assert kept.text == "Hello, <b>world</b>! Grüße 👋"  # the EOS that ended it is not part of the text
    assert kept.finish_reason == "stop"


NAMED_SOURCE = """
import os

from tokenloom.plugin_api import ModelSource, ResolvedModel, hookimpl


class NamedSource(ModelSource):
    def matches(self, model):
        return model.startswith("named:")

    def resolve(self, model, *, revision=None, download_dir=None):
        return ResolvedModel(path=os.environ["NAMED_SOURCE_DIR"], name="a-display-name", source="named")


@hookimpl
def register_model_sources(register):
    register("named", NamedSource)
"""


@pytest.mark.hook("register_model_sources")
def test_resolved_model_name_is_not_the_served_name(tmp_path, smollm2_gguf, monkeypatch):
    """PLUGINS.md: clients name the model as the operator's tag (or --served-model-name),
    whatever ``ResolvedModel.name`` a source returns."""
    from tests.plugins.scripted_model.model_dir import load_tokenizer, write_model_dir
    from tokenloom import LLM

    model_dir = write_model_dir(str(tmp_path / "model"), load_tokenizer(smollm2_gguf), {"hello": "Hi"})
    (tmp_path / "named_source_plugin.py").write_text(NAMED_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NAMED_SOURCE_DIR", model_dir)
    llm = LLM(
        model="named:scripted", plugins=["tests.plugins.scripted_model", "named_source_plugin"], max_model_len=512
    )
    assert llm.engine.model_name == "named:scripted"
