"""The built-in ``draft_model`` proposer's own rules: the vocabulary check (sizes, then the
token -> id maps, naming both models) and its registration beside ``ngram``."""

from __future__ import annotations

import pytest

from tokenloom.builtin_plugins.proposers.draft_model import check_same_vocabulary
from tokenloom.core.model_loader import ModelInfo
from tokenloom.errors import ConfigError
from tokenloom.plugins.manager import load_plugins


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def info(name: str, vocab_size: int) -> ModelInfo:
    return ModelInfo(
        path=f"/models/{name}",
        name=name,
        source="local",
        load_format="safetensors",
        architecture="LlamaForCausalLM",
        quantization=None,
        max_model_len=64,
        vocab_size=vocab_size,
    )


def test_same_vocabulary_passes():
    vocab = {"a": 0, "b": 1, "c": 2}
    check_same_vocabulary(info("target", 3), FakeTokenizer(vocab), info("draft", 3), FakeTokenizer(vocab))
    check_same_vocabulary(info("target", 3), None, info("draft", 3), None)  # no tokenizers: sizes only


def test_other_size_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"'draft' \(/models/draft\) and the target 'target' .*\(4 and 3 tokens\)"):
        check_same_vocabulary(info("target", 3), None, info("draft", 4), None)


def test_same_size_other_ids_is_refused_with_an_example():
    target = FakeTokenizer({"a": 0, "b": 1, "c": 2})
    draft = FakeTokenizer({"a": 0, "b": 2, "c": 1})
    with pytest.raises(ConfigError, match=r"2 tokens differ, e.g. 'b': id 2 in the draft, 1 in the target"):
        check_same_vocabulary(info("target", 3), target, info("draft", 3), draft)


def test_registered_beside_ngram():
    plugins = load_plugins(modules=["tokenloom.builtin_plugins.proposers"])
    assert {"ngram", "draft_model"} <= set(plugins.registry("proposer").names())
