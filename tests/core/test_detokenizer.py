"""Tests for tokenloom.core.detokenizer with the real SmolLM2 tokenizer (byte-level BPE, so
multi-byte characters really are split across tokens)."""

from __future__ import annotations

import random

import pytest

from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import InvalidRequestError

pytestmark = pytest.mark.slow

MULTILINGUAL = "Héllo wörld, naïve café! 😀 日本語のテキスト 🎉👍🏽 Ωμέγα — “quotes” 한국어"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    # the server's own loader (identical to transformers', see
    # tests/builtin_plugins/loaders/test_gguf_real_models.py; transformers' takes tens of seconds)
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    return GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes=None) -> list[str]:
    """Feed the tokens (one at a time, or in the given chunk sizes) until a stop; then flush."""
    deltas, start = [], 0
    sizes = iter(chunk_sizes or [])
    while start < len(token_ids) and detokenizer.stop_string is None:
        size = next(sizes, 1)
        deltas.append(detokenizer.update(token_ids[start : start + size]))
        start += size
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("prompt", ["", "Translate this:", "日本"])
def test_token_by_token_text_equals_a_full_decode(tokenizer, prompt):
    token_ids = encode(tokenizer, MULTILINGUAL)
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in token_ids), "needs split characters"
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams())
    deltas = stream(detokenizer, token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == MULTILINGUAL
    assert detokenizer.output_text == MULTILINGUAL
    assert not any("\ufffd" in delta for delta in deltas)


def test_any_split_into_chunks_gives_the_same_text(tokenizer):
    token_ids = encode(tokenizer, MULTILINGUAL)
    rng = random.Random(0)
    for _ in range(10):
        sizes = [rng.randint(1, 4) for _ in token_ids]
        detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
        deltas = stream(detokenizer, token_ids, sizes)
        assert "".join(deltas) == MULTILINGUAL
        assert not any("\ufffd" in delta for delta in deltas)


def test_each_step_decodes_a_bounded_window(tokenizer):
    class CountingTokenizer:
        """Delegates to the real tokenizer, recording how many tokens each decode sees."""

        def __init__(self, inner):
            self.inner = inner
            self.window_sizes = []

        def convert_tokens_to_string(self, tokens):
            self.window_sizes.append(len(tokens))
            return self.inner.convert_tokens_to_string(tokens)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counting = CountingTokenizer(tokenizer)
    token_ids = encode(tokenizer, (MULTILINGUAL + " ") * 20)
    detokenizer = IncrementalDetokenizer(counting, encode(tokenizer, "a long prompt " * 50), SamplingParams())
    stream(detokenizer, token_ids)
    assert len(token_ids) > 400
    assert max(counting.window_sizes) <= 12


def test_an_incomplete_character_is_held_until_flush(tokenizer):
    token_ids = encode(tokenizer, "ok 😀")
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = [detokenizer.update([token_id]) for token_id in token_ids[:-1]]
    assert "".join(deltas) == "ok"
    # the request ends mid-character (e.g. max_tokens): the final text is the tokenizer's
    assert detokenizer.flush() == tokenizer.decode(token_ids[:-1])[len("ok") :]


def test_stop_string_spanning_tokens_truncates_the_text(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    token_ids = encode(tokenizer, text)
    tokens = [tokenizer.decode([token_id]) for token_id in token_ids]
    assert not any("ck bro" in token for token in tokens)  # the stop string spans tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["zebra", "ck bro"]))
    deltas = stream(detokenizer, token_ids)
    assert detokenizer.stop_string == "ck bro"
    assert detokenizer.output_text == "The qui"
    assert "".join(deltas) == "The qui"


def test_include_stop_str_in_output(tokenizer):
    token_ids = encode(tokenizer, "The quick brown fox jumps")
    params = SamplingParams(stop=["ck bro"], include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    deltas = stream(detokenizer, token_ids)
    assert detokenizer.output_text == "".join(deltas) == "The quick bro"


def test_the_first_occurrence_of_any_stop_wins(tokenizer):
    token_ids = encode(tokenizer, "alpha beta gamma delta")
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["delta", "a gam", "ta"]))
    stream(detokenizer, token_ids, [len(token_ids)])  # all at once: several stops are present
    assert detokenizer.stop_string == "ta"
    assert detokenizer.output_text == "alpha be"


def test_multibyte_stop_string(tokenizer):
    token_ids = encode(tokenizer, MULTILINGUAL)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["本語の"]))
    deltas = stream(detokenizer, token_ids)
    assert detokenizer.output_text == "".join(deltas) == MULTILINGUAL.split("本語の")[0]


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer):
    text = "the fox jumps and the fox! runs"
    token_ids = encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["fox!"]))
    released = []
    for token_id in token_ids:
        released.append(detokenizer.update([token_id]))
        seen = "".join(released)
        # a streaming client never sees text that could be the start of the stop string
        assert not any(seen.endswith("fox!"[:length]) for length in range(1, 4)), seen
        assert seen == detokenizer.released_text
        if detokenizer.stop_string:
            break
    assert "the fox jumps" in "".join(released)  # the first "fox" was released once " jumps" came
    assert detokenizer.output_text == "".join(released) == "the fox jumps and the "


def test_flush_releases_a_held_back_tail(tokenizer):
    token_ids = encode(tokenizer, "say hello wor")
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world"]))
    streamed = "".join(detokenizer.update([token_id]) for token_id in token_ids)
    assert streamed == "say hello "
    assert detokenizer.flush() == "wor"
    assert detokenizer.stop_string is None
    assert detokenizer.released_text == detokenizer.output_text == "say hello wor"


CHAT = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(tokenizer, skip_special_tokens):
    token_ids = encode(tokenizer, CHAT) + encode(tokenizer, "<repo_name>") + encode(tokenizer, "ok")
    params = SamplingParams(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    text = "".join(stream(detokenizer, token_ids))
    assert text == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens:
        assert text == "user\nhi there\nassistant\nok"
    else:
        assert text == CHAT + "<repo_name>ok"


def test_spaces_between_special_tokens(tokenizer):
    token_ids = encode(tokenizer, "<|im_start|>user\nhi<|im_end|><|endoftext|>")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=True)
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    assert "".join(stream(detokenizer, token_ids)) == "<|im_start|> user\nhi <|im_end|> <|endoftext|>"
    # with the special tokens skipped there is nothing to space
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(spaces_between_special_tokens=True))
    assert "".join(stream(detokenizer, token_ids)) == "user\nhi"


def test_detokenize_false_does_no_text_work(tokenizer):
    detokenizer = IncrementalDetokenizer(None, [1, 2], SamplingParams(detokenize=False))
    assert detokenizer.update(encode(tokenizer, "hello")) == "" and detokenizer.flush() == ""
    assert detokenizer.output_text == "" and detokenizer.stop_string is None
    with pytest.raises(InvalidRequestError) as error:
        IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False, stop=["x"]))
    assert error.value.param == "stop"
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(None, [], SamplingParams())
