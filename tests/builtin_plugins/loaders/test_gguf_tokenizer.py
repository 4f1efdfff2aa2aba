"""The GGUF tokenizer's cache: a miss builds and stores, a hit builds nothing and behaves exactly
like the tokenizer built from the file; a corrupt entry is rebuilt; the key follows the
tokenizer metadata (and only it); two processes starting at once are safe."""

from __future__ import annotations

import json
import logging
import multiprocessing

import pytest
from helpers.gguf_files import byte_level_vocab, sentencepiece_vocab, write_metadata_only_gguf

from tokenloom.builtin_plugins.loaders import gguf_tokenizer
from tokenloom.builtin_plugins.loaders.derived_cache import CACHE_DIR_ENV, DerivedCache
from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.builtin_plugins.loaders.gguf_tokenizer import (
    STRING_ARRAYS,
    TOKENIZER_CACHE_KIND,
    gguf_to_hf_tokenizer,
    load_gguf_tokenizer,
    serialized_backend,
    tokenizer_cache_key,
)
from tokenloom.core.config import ModelConfig

TEXTS = [
    "hello world",
    " hello  world ",
    "hello<|im_start|>world<|im_end|>",
    "<think>hello</think>",
    "abcd\n\n\tab",
    "日本 🤗",
    "<s>hello</s>",
    "  ",
    "",
    "<start_of_turn>ab<end_of_turn>",
    "12 12",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "Ünïcödé façade — “quotes” … ½",
    "def f(x):\n    return x  # done\t\ttabs",
    "x" * 300,
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <think> there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "日本 🤗"},
]


_build_backend = gguf_tokenizer.build_backend


def built_from_file(path: str):
    """The tokenizer built from the file, bypassing the cache (and the ``builds`` count)."""
    return gguf_tokenizer._wrap(*_build_backend(GGUFFile(path, string_arrays=STRING_ARRAYS)))


@pytest.fixture
def cache(tmp_path) -> DerivedCache:
    return DerivedCache(TOKENIZER_CACHE_KIND, root=tmp_path / "cache")


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The paths of the files whose tokenizer was built (not read from the cache), in order."""
    built: list[str] = []

    def counting(gguf):
        built.append(gguf.path)
        return _build_backend(gguf)

    monkeypatch.setattr(gguf_tokenizer, "build_backend", counting)
    return built


def _vocabulary_gguf(
    directory, vocabulary: str, name: str = "tok.gguf", chat_template: str | None = None, **extra
) -> str:
    vocab = byte_level_vocab() if vocabulary == "byte_level" else sentencepiece_vocab()
    architecture = "gemma3" if vocabulary == "gemma" else "llama"
    if architecture == "gemma3":
        extra[f"{architecture}.attention.key_length"] = 16
    if vocabulary != "byte_level":
        vocab["chat_template"] = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    if chat_template is not None:
        vocab["chat_template"] = chat_template
    return write_metadata_only_gguf(
        str(directory / name),
        architecture,
        tokenizer=vocab,
        extra={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra},
    )


def assert_same_behaviour(ours, reference) -> None:
    """The same backend, and the same ids, decodes, special tokens, vocabulary and chat rendering."""
    assert json.loads(ours._tokenizer.to_str()) == json.loads(reference._tokenizer.to_str())
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours(text, add_special_tokens=add_special_tokens).input_ids
            assert ids == reference(text, add_special_tokens=add_special_tokens).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert ours.get_vocab() == reference.get_vocab() and len(ours) == len(reference)
    assert ours.all_special_tokens == reference.all_special_tokens
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.added_tokens_decoder == reference.added_tokens_decoder
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
        reference.unk_token_id,
    )
    assert ours.chat_template == reference.chat_template
    for add_generation_prompt in (False, True):
        rendered = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert rendered == reference.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert (
            ours(rendered, add_special_tokens=False).input_ids
            == reference(rendered, add_special_tokens=False).input_ids
        )


@pytest.mark.parametrize("vocabulary", ["byte_level", "sentencepiece", "gemma"])
def test_a_miss_builds_and_stores_and_a_hit_builds_nothing_and_behaves_the_same(vocabulary, tmp_path, cache, builds):
    path = _vocabulary_gguf(tmp_path, vocabulary)
    from_file = built_from_file(path)
    built = load_gguf_tokenizer(path, cache=cache)
    assert builds == [path] and cache.path(tokenizer_cache_key(GGUFFile(path))).is_file()
    from_cache = load_gguf_tokenizer(path, cache=cache)
    assert builds == [path]  # the second came from the cache
    assert_same_behaviour(built, from_file)
    assert_same_behaviour(from_cache, from_file)


def test_the_real_smollm2_tokenizer_from_the_cache_equals_the_one_built_from_the_file(smollm2_gguf, cache, builds):
    from_file = built_from_file(smollm2_gguf)
    load_gguf_tokenizer(smollm2_gguf, cache=cache)
    from_cache = load_gguf_tokenizer(smollm2_gguf, cache=cache)
    assert builds == [smollm2_gguf]
    assert_same_behaviour(from_cache, from_file)
    assert from_cache.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nHi <think> there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_load_format_uses_the_cache_under_the_cache_dir_env_var(tmp_path, monkeypatch, builds):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env-cache"))
    path = _vocabulary_gguf(tmp_path, "byte_level")
    first = GGUFLoadFormat().load_tokenizer(path, ModelConfig())
    second = GGUFLoadFormat().load_tokenizer(path, ModelConfig())
    assert builds == [path]
    assert list((tmp_path / "env-cache" / TOKENIZER_CACHE_KIND).glob("*.entry"))
    assert_same_behaviour(second, first)


@pytest.mark.parametrize("damage", ["garbage", "sound file, payload not a tokenizer"])
def test_a_corrupt_entry_is_rebuilt_and_replaced(damage, tmp_path, cache, builds, caplog):
    path = _vocabulary_gguf(tmp_path, "sentencepiece")
    reference = load_gguf_tokenizer(path, cache=cache)
    key = tokenizer_cache_key(GGUFFile(path))
    if damage == "garbage":
        cache.path(key).write_bytes(b"\x00garbage" * 100)
    else:  # header and digest fine (a writer that stored the wrong thing): the library refuses it
        cache.write(key, b'{"version": "1.0", "model": 3}', cache.read(key).fields)
    with caplog.at_level(logging.WARNING):
        rebuilt = load_gguf_tokenizer(path, cache=cache)
    assert builds == [path, path]
    assert str(cache.path(key)) in caplog.text and "building it again" in caplog.text
    assert_same_behaviour(rebuilt, reference)
    load_gguf_tokenizer(path, cache=cache)
    assert builds == [path, path]  # the rebuild replaced the entry


def test_the_key_follows_the_tokenizer_metadata_and_only_it(tmp_path):
    def key(name: str, vocabulary: str = "byte_level", **extra) -> str:
        (tmp_path / name).mkdir()
        return tokenizer_cache_key(GGUFFile(_vocabulary_gguf(tmp_path / name, vocabulary, **extra)))

    base = key("base")
    # the same tokenizer in another file, with other model metadata and weights: the same entry
    assert key("copy") == base
    assert key("other-model", **{"general.name": "another model", "llama.context_length_extra": 7}) == base
    # any tokenizer metadata that differs: another entry
    assert key("eos", **{"tokenizer.ggml.eos_token_id": 0}) != base
    assert key("template", chat_template="{{ messages[0]['content'] }}") != base
    assert key("sentencepiece", "sentencepiece") != base
    assert key("gemma", "gemma") != key("llama-sp", "sentencepiece")  # the architecture picks the builder


def test_the_key_changes_with_the_builder(tmp_path, monkeypatch):
    gguf = GGUFFile(_vocabulary_gguf(tmp_path, "byte_level"))
    base = tokenizer_cache_key(gguf)
    monkeypatch.setattr(gguf_tokenizer, "TOKENIZER_CACHE_VERSION", gguf_tokenizer.TOKENIZER_CACHE_VERSION + 1)
    assert tokenizer_cache_key(gguf) != base
    monkeypatch.undo()
    monkeypatch.setattr(gguf_tokenizer, "_builder_digest", lambda: b"edited source")
    assert tokenizer_cache_key(gguf) != base


def test_a_tokenizer_metadata_change_in_the_same_file_is_not_served_stale(tmp_path, cache, builds):
    path = _vocabulary_gguf(tmp_path, "byte_level")
    assert load_gguf_tokenizer(path, cache=cache).eos_token == "<|im_end|>"
    _vocabulary_gguf(tmp_path, "byte_level", **{"tokenizer.ggml.eos_token_id": 0})  # rewritten in place
    assert load_gguf_tokenizer(path, cache=cache).eos_token == "<|endoftext|>"
    assert builds == [path, path]


def _load_in_a_process(path: str, cache_root: str, queue) -> None:
    tokenizer = load_gguf_tokenizer(path, cache=DerivedCache(TOKENIZER_CACHE_KIND, root=cache_root))
    queue.put(tokenizer("hello<|im_start|>world").input_ids)


def test_two_processes_building_the_same_entry_at_once_both_get_the_tokenizer(tmp_path):
    path = _vocabulary_gguf(tmp_path, "byte_level")
    expected = gguf_to_hf_tokenizer(GGUFFile(path, string_arrays=STRING_ARRAYS))("hello<|im_start|>world").input_ids
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(target=_load_in_a_process, args=(path, str(tmp_path / "cache"), queue)) for _ in range(2)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results == [expected, expected]
    directory = tmp_path / "cache" / TOKENIZER_CACHE_KIND
    assert [entry.name for entry in directory.iterdir()] == [f"{tokenizer_cache_key(GGUFFile(path))}.entry"]
    assert (
        DerivedCache(TOKENIZER_CACHE_KIND, root=tmp_path / "cache").read(tokenizer_cache_key(GGUFFile(path)))
        is not None
    )


def test_merges_are_stored_space_joined_unless_a_piece_holds_a_space():
    from tokenizers import Tokenizer, models

    def stored_merges(merges):
        vocab = {piece: index for index, piece in enumerate(["a", "b", "ab", "a b", "c", "a bc"])}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        stored = serialized_backend(backend)
        assert json.loads(Tokenizer.from_str(stored.decode()).to_str()) == json.loads(backend.to_str())
        return json.loads(stored)["model"]["merges"]

    assert stored_merges([("a", "b")]) == ["a b"]
    assert stored_merges([("a", "b"), ("a b", "c")]) == [["a", "b"], ["a b", "c"]]
