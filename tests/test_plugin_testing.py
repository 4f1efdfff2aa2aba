"""The public test helpers for plugin authors: the any-split streaming property passes for
conforming parsers and fails, naming the split, for one that does not hold text back; the
registration check loads a plugin alone and reports what it registered and what is wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tokenloom.builtin_plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from tokenloom.errors import PluginError
from tokenloom.plugin_api import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta, ToolParser
from tokenloom.plugin_testing import (
    assert_reasoning_parser_streams_like_extract,
    assert_registers,
    assert_tool_parser_streams_like_extract,
    load_plugin,
    splits,
)
from tokenloom.plugins.manager import load_plugins

EXAMPLE_FILE = Path(__file__).resolve().parents[1] / "examples" / "my_tool_parser.py"
CALLS = 'Sure. <function=get_weather>{"city": "Paris"}</function><function=now>{}</function>'


def example_parser_class():
    return (
        load_plugins(files=[str(EXAMPLE_FILE)], entry_points=False).registry("tool_parser").get("llama3_function_tags")
    )


def test_splits_cover_whole_characters_every_cut_and_a_sample_of_three_way_cuts():
    ways = list(splits("abcd", max_three_way=2))
    assert ways[:2] == [["abcd"], ["a", "b", "c", "d"]]
    assert ways[2:5] == [["a", "bcd"], ["ab", "cd"], ["abc", "d"]]
    assert len(ways) == 7 and all(len(way) == 3 and "".join(way) == "abcd" for way in ways[5:])


def test_a_conforming_tool_parser_passes():
    assert_tool_parser_streams_like_extract(example_parser_class(), CALLS, max_three_way=50)


class EagerParser(ToolParser):
    """Finds ``<call>NAME</call>`` in whole outputs, but streams text as it comes: a tag split
    across deltas leaks into the content."""

    def extract(self, model_output, request=None):
        if model_output.startswith("<call>") and model_output.endswith("</call>"):
            return ExtractedToolCalls(True, [ToolCall(model_output[6:-7], "{}")], None)
        return ExtractedToolCalls(False, [], model_output or None)

    def extract_delta(self, delta_text, request=None):
        self.seen = getattr(self, "seen", "") + delta_text
        if self.seen.startswith("<call>") and self.seen.endswith("</call>"):
            return DeltaMessage(tool_calls=[ToolCallDelta(0, name=self.seen[6:-7], arguments="{}")])
        return DeltaMessage(content=delta_text)


def test_a_parser_that_does_not_hold_text_back_fails_naming_the_split():
    with pytest.raises(AssertionError) as caught:
        assert_tool_parser_streams_like_extract(EagerParser, "<call>f</call>")
    assert str(caught.value).startswith("split ['<', 'c', 'a'")
    assert "streamed content '<call>f</call" in str(caught.value) and "extract() gives None" in str(caught.value)


def test_reasoning_parsers_are_checked_the_same_way():
    assert_reasoning_parser_streams_like_extract(Qwen3ReasoningParser, "<think>\nhm</think>\n\nYes.", max_three_way=50)

    class ForgetfulEnd(Qwen3ReasoningParser):
        def finish(self, request=None):
            return None  # drops a held-back partial end marker

    with pytest.raises(AssertionError, match="extract_reasoning\\(\\) gives"):
        assert_reasoning_parser_streams_like_extract(ForgetfulEnd, "<think>a</thi")


def test_assert_registers_checks_names_and_imports_targets(tmp_path):
    assert_registers(file=str(EXAMPLE_FILE), expected={"tool_parser": ["llama3_function_tags"]})
    with pytest.raises(AssertionError, match=r"registered \{'tool_parser': \['llama3_function_tags'\]\}, expected"):
        assert_registers(file=str(EXAMPLE_FILE), expected={"tool_parser": ["other"]})

    hooks = tmp_path / "typo_target_hooks.py"
    hooks.write_text(
        textwrap.dedent("""
        from tokenloom.plugin_api import hookimpl

        @hookimpl
        def register_reasoning_parsers(register):
            register("mine", "json:NoSuchParser")
    """)
    )
    with pytest.raises(PluginError, match="reasoning_parser 'mine' \\(registered by plugin 'typo_target_hooks.py'\\)"):
        assert_registers(file=str(hooks), expected={"reasoning_parser": ["mine"]})
    assert_registers(file=str(hooks), expected={"reasoning_parser": ["mine"]}, resolve=False)


def test_load_plugin_says_when_nothing_was_registered(tmp_path):
    empty = tmp_path / "empty_plugin.py"
    empty.write_text("class NotRegistered:\n    pass\n")
    with pytest.raises(AssertionError, match="registered nothing: it implements no hook"):
        load_plugin(file=str(empty))
