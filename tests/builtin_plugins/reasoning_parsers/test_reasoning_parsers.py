"""The built-in reasoning parsers on their model families' real output formats: exact
``(reasoning_content, content)`` for whole outputs, the same from every split into streamed
deltas, ``is_reasoning_end`` on token ids, and ``adjust_request`` for special-token markers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.builtin_plugins.reasoning_parsers import REASONING_PARSERS
from tokenloom.plugins.registry import resolve_target


def parser_for(name: str, tokenizer=None):
    module, _, cls = REASONING_PARSERS[name].partition(":")
    return resolve_target(f"tokenloom.builtin_plugins.reasoning_parsers.{module}:{cls}")(tokenizer)


REASONING = 'Two plus two is four; 2² = 4 — easy. {"json": [1]}'
ANSWER = "The answer is 4. 答案是四。"

# Expected results are vLLM's, byte for byte: its parsers keep the text between and after the
# markers as written (``partition`` on the marker, no strip), give an empty answer as None and
# an opened-and-closed empty reasoning as "", and pass an output with no section through as
# content unchanged. Where vLLM's whole-output and streamed results differ (an unclosed
# ``<think>`` for qwen3/glm45: content whole, reasoning streamed), tokenloom gives the streamed
# one for both, since any split must give extract()'s result.
CASES = [
    # (parser, output, reasoning_content, content)
    ("deepseek_r1", f"{REASONING}</think>{ANSWER}", REASONING, ANSWER),
    ("deepseek_r1", f"<think>\n{REASONING}\n</think>\n\n{ANSWER}", f"\n{REASONING}\n", f"\n\n{ANSWER}"),
    ("deepseek_r1", f"\n{REASONING} and still thinking", f"\n{REASONING} and still thinking", None),
    ("deepseek_r1", f"</think>\n\n{ANSWER}", "", f"\n\n{ANSWER}"),
    ("deepseek_r1", f"{REASONING}</think>", REASONING, None),
    ("deepseek_r1", "", "", None),
    ("qwen3", f"<think>\n{REASONING}\n</think>\n\n{ANSWER}", f"\n{REASONING}\n", f"\n\n{ANSWER}"),
    ("qwen3", f"<think>\n\n</think>\n\n{ANSWER}", "\n\n", f"\n\n{ANSWER}"),
    ("qwen3", f"  {ANSWER} ", None, f"  {ANSWER} "),
    ("qwen3", f"{ANSWER} and a stray </think> tag", None, f"{ANSWER} and a stray </think> tag"),
    ("qwen3", f"<think>{REASONING}", REASONING, None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, ""),
    (
        "granite",
        f"Here is my thought process:\n{REASONING}\nHere is my response:\n{ANSWER}",
        f"\n{REASONING}\n",
        f"\n{ANSWER}",
    ),
    (
        "granite",
        f"Here's my thought process: {REASONING} Here's my response: {ANSWER}",
        f" {REASONING} ",
        f" {ANSWER}",
    ),
    ("granite", f"Here is my thought process:\n{REASONING}\nHere is my response:", f"\n{REASONING}\n", None),
    ("granite", f"Here is the answer: {ANSWER}", None, f"Here is the answer: {ANSWER}"),
    ("mistral", f"[THINK]{REASONING}[/THINK]{ANSWER}", REASONING, ANSWER),
    ("mistral", f"[THINK]\n{REASONING}\n[/THINK]\n\n{ANSWER}", f"\n{REASONING}\n", f"\n\n{ANSWER}"),
    ("mistral", f"{ANSWER}[THINK]", None, f"{ANSWER}[THINK]"),
    ("mistral", f"[THINK]{REASONING}[/THINK]", REASONING, None),
    ("glm45", f"<think>{REASONING}</think>\n{ANSWER}", REASONING, f"\n{ANSWER}"),
    ("glm45", f"<think></think>\n{ANSWER}", "", f"\n{ANSWER}"),
    ("glm45", f"\n{ANSWER}", None, f"\n{ANSWER}"),
    ("glm45", f"<think>{REASONING}", REASONING, None),
    (
        "hunyuan_a13b",
        f"<think>\n{REASONING}\n</think>\n<answer>\n{ANSWER}\n</answer>",
        REASONING,
        ANSWER,
    ),
    # fast thinking: an empty section, which vLLM's hunyuan parser gives as None
    ("hunyuan_a13b", f"<think>\n\n</think>\n<answer>\n{ANSWER}\n</answer>", None, ANSWER),
    ("hunyuan_a13b", f"{ANSWER}\n</answer>", None, ANSWER),
    ("hunyuan_a13b", f"<think>\n{REASONING}\n</think>\n<answer>\n{ANSWER}", REASONING, ANSWER),
    ("hunyuan_a13b", f"<think>\n{REASONING}", REASONING, None),
    ("hunyuan_a13b", ANSWER, None, ANSWER),
    ("seed_oss", f"<seed:think>{REASONING}</seed:think>{ANSWER}", REASONING, ANSWER),
    ("seed_oss", f"{REASONING}</seed:think>\n{ANSWER}", REASONING, f"\n{ANSWER}"),
    ("seed_oss", f"<seed:think>\n{REASONING}", f"\n{REASONING}", None),
    ("step3", f"{REASONING}</think>{ANSWER}", REASONING, ANSWER),
    # step3 looks for no start marker: a "<think>" is reasoning text, as vLLM's step3 parser keeps it
    ("step3", f"<think>{REASONING}</think>\n{ANSWER}", f"<think>{REASONING}", f"\n{ANSWER}"),
    ("step3", f"{REASONING}", REASONING, None),
    (
        "openai_gptoss",
        f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
        REASONING,
        ANSWER,
    ),
    (
        "openai_gptoss",
        f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>analysis<|message|>"
        f"More.<|end|><|start|>assistant<|channel|>final<|message|> {ANSWER}\n<|return|>",
        f"{REASONING}\nMore.",
        f" {ANSWER}\n",
    ),
    ("openai_gptoss", f"<|channel|>analysis<|message|>{REASONING}", REASONING, None),
    (
        "openai_gptoss",
        f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
        '<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        REASONING,
        '<|start|>assistant<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    ),
    ("openai_gptoss", ANSWER, None, ANSWER),
]
IDS = [f"{name}-{index}" for index, (name, *_rest) in enumerate(CASES)]


def streamed(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    messages = [parser.extract_reasoning_delta(piece, None) for piece in pieces] + [parser.finish(None)]
    reasoning = "".join(m.reasoning_content or "" for m in messages if m is not None)
    content = "".join(m.content or "" for m in messages if m is not None)
    return reasoning or None, content or None


def test_every_parser_has_cases():
    assert {name for name, *_ in CASES} == set(REASONING_PARSERS)


@pytest.mark.parametrize("name,output,reasoning,content", CASES, ids=IDS)
def test_extract_reasoning_is_exact(name, output, reasoning, content):
    assert parser_for(name).extract_reasoning(output, None) == (reasoning, content)


@pytest.mark.parametrize("name,output,reasoning,content", CASES, ids=IDS)
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=30))
def test_any_split_streams_the_non_streaming_result(name, output, reasoning, content, cuts):
    points = sorted({cut % (len(output) + 1) for cut in cuts})
    bounds = [0, *points, len(output)]
    pieces = [output[start:end] for start, end in zip(bounds, bounds[1:])]
    # deltas cannot carry an empty string: "" streams as nothing, like None
    expected = (reasoning or None, content or None)
    assert streamed(parser_for(name), pieces) == expected
    assert streamed(parser_for(name), list(output)) == expected


def test_reasoning_streams_before_the_end_marker_arrives():
    parser = parser_for("deepseek_r1")
    first = parser.extract_reasoning_delta("Let me think</th", None)
    assert first.reasoning_content == "Let me think" and first.content is None  # "</th" waits
    second = parser.extract_reasoning_delta("ink>Yes.", None)
    assert second.reasoning_content is None and second.content == "Yes."


class CharTokenizer:
    """One token per character: enough to check is_reasoning_end on token ids."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(token_id) for token_id in token_ids)


def ids(text: str) -> list[int]:
    return [ord(char) for char in text]


@pytest.mark.parametrize(
    "name,output,ended",
    [
        # the contract for the empty output (PLUGINS.md): False while the model may still open a
        # section (qwen3) or is in one from the start (deepseek_r1)
        ("deepseek_r1", "", False),
        ("qwen3", "", False),
        ("deepseek_r1", "still thinking", False),
        ("deepseek_r1", "done</think>", True),
        ("qwen3", "<think>thinking", False),
        ("qwen3", "<thi", False),
        ("qwen3", "No thinking here", True),
        ("granite", "Here is my thought process: hmm Here is my response:", True),
        ("mistral", "[THINK]hmm", False),
        ("glm45", "<think>hmm", False),
        ("glm45", "No thinking", True),
        ("hunyuan_a13b", "<think>\nhmm", False),
        ("hunyuan_a13b", "<think>\nhmm\n</think>\n<answer>\n", True),
        ("hunyuan_a13b", "The answer", True),
        ("seed_oss", "", False),
        ("seed_oss", "hmm</seed:think>", True),
        ("step3", "", False),
        ("step3", "<think>hmm", False),
        ("step3", "hmm</think>", True),
        ("openai_gptoss", "", False),
        ("openai_gptoss", "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant", False),
        (
            "openai_gptoss",
            "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>",
            True,
        ),
        ("openai_gptoss", "Plain text", True),
    ],
)
def test_is_reasoning_end(name, output, ended):
    assert parser_for(name, CharTokenizer()).is_reasoning_end(ids(output)) is ended


def test_only_special_token_markers_are_kept_in_the_text():
    from tokenloom.api.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    for name in ("mistral", "openai_gptoss"):  # [THINK]; harmony's <|channel|>, <|message|> ...
        assert parser_for(name).adjust_request(request).skip_special_tokens is False
    for name in ("qwen3", "glm45", "seed_oss", "step3", "hunyuan_a13b"):  # plain text in their vocabularies
        assert parser_for(name).adjust_request(request) is request


@pytest.mark.parametrize("name,output,reasoning,content", CASES, ids=IDS)
def test_every_cut_into_two_streams_the_non_streaming_result(name, output, reasoning, content):
    # plugin_testing's exhaustive check (every 2-way cut, a sample of 3-way ones), the one
    # third-party parsers are held to
    from tokenloom.plugin_testing import assert_reasoning_parser_streams_like_extract

    assert_reasoning_parser_streams_like_extract(lambda: parser_for(name), output, max_three_way=60)
