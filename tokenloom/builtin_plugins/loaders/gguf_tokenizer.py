"""GGUF tokenizer metadata -> a transformers ``PreTrainedTokenizerFast``, built directly with the
``tokenizers`` library.

It reproduces what ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds (same model,
normalizer, pre-tokenizer, decoder, added tokens and BOS/EOS handling; the tests compare
token ids and decodes) in a fraction of the time: byte-level BPE (``tokenizer.ggml.model ==
"gpt2"``: SmolLM2, Qwen2, Llama 3) and sentencepiece-style BPE (``"llama"``; Gemma's variant).

:func:`load_gguf_tokenizer` keeps what it builds (the backend's ``tokenizer.json`` and the
wrapper's arguments) in a :class:`DerivedCache`, keyed by a digest of the file's tokenizer
metadata bytes and of this builder: a later start deserializes it instead of rebuilding (for
Gemma's 262k vocabulary, whose merges are derived here, about half the CPU time; for SmolLM2's,
whose merges the file holds, a little less).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from tokenloom.builtin_plugins.loaders.derived_cache import DerivedCache
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.errors import ModelLoadError
from tokenloom.plugin_api import bytes_to_unicode

logger = logging.getLogger(__name__)

# token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4

STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
SPIECE_UNDERLINE = "\u2581"

# tokenizer.ggml.pre -> the split regex the merges were learned with (llama.cpp's pre-tokenizer names)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


# the cache's sub-directory, and the version of what is cached there: bump it when the builder
# changes what it builds (the key also covers this module's source and the tokenizers version,
# so an entry from other code is never read even when this is not bumped)
TOKENIZER_CACHE_KIND = "gguf-tokenizers"
TOKENIZER_CACHE_VERSION = 1
# metadata the tokenizer is built from besides the ``tokenizer.*`` keys
_KEYED_METADATA = ("general.architecture",)


def load_gguf_tokenizer(path: str, *, cache: DerivedCache | None = None):
    """The ``PreTrainedTokenizerFast`` of the GGUF file at ``path``: from ``cache`` (default:
    the user's tokenloom cache) when it holds a sound entry for this file's tokenizer metadata,
    else built from the file and stored there."""
    cache = cache if cache is not None else DerivedCache(TOKENIZER_CACHE_KIND)
    started = time.perf_counter()
    gguf = GGUFFile(path)  # string arrays skipped: the key hashes their bytes, not their strings
    key = tokenizer_cache_key(gguf)
    entry = cache.read(key)
    if entry is not None:
        try:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(entry.payload.decode("utf-8"))
            init_kwargs = entry.fields["init_kwargs"]
        except Exception as exc:  # noqa: BLE001 - a sound file the library cannot read: rebuild it
            logger.warning(
                "cached tokenizer %s does not load (%s: %s); building it again",
                cache.path(key),
                type(exc).__name__,
                exc,
            )
        else:
            logger.debug(
                "tokenizer of %s from the cache (%s) in %.2fs", path, cache.path(key), time.perf_counter() - started
            )
            return _wrap(backend, init_kwargs)
    backend, init_kwargs = build_backend(GGUFFile(path, string_arrays=STRING_ARRAYS))
    # serialized before the wrapper adopts it, so a cached backend is wrapped from the same state
    written = cache.write(key, serialized_backend(backend), {"init_kwargs": init_kwargs, "source": str(path)})
    if written is not None:
        logger.info("built the tokenizer of %s in %.2fs; cached as %s", path, time.perf_counter() - started, written)
    return _wrap(backend, init_kwargs)


def serialized_backend(backend) -> bytes:
    """The backend's ``tokenizer.json``, its BPE merges written ``"left right"`` (the form most
    tokenizer.json files have, which ``tokenizers`` parses a third faster than pairs: for
    SmolLM2 that is what makes reading the cache cheaper than building) unless a piece holds a
    space, which only the pair form can say."""
    document = json.loads(backend.to_str())
    merges = document.get("model", {}).get("merges")
    if merges and all(
        isinstance(merge, list) and len(merge) == 2 and " " not in merge[0] and " " not in merge[1] for merge in merges
    ):
        document["model"]["merges"] = [f"{left} {right}" for left, right in merges]
    return json.dumps(document, ensure_ascii=False).encode("utf-8")


def tokenizer_cache_key(gguf: GGUFFile) -> str:
    """A digest of the file's tokenizer metadata as stored (every ``tokenizer.*`` entry and the
    architecture), this module's source and the ``tokenizers`` version."""
    import tokenizers

    digest = hashlib.sha256(
        f"{TOKENIZER_CACHE_KIND}/{TOKENIZER_CACHE_VERSION}/tokenizers {tokenizers.__version__}/".encode()
    )
    digest.update(_builder_digest())
    keys = sorted(key for key in gguf.metadata_spans if key.startswith("tokenizer.") or key in _KEYED_METADATA)
    for key in keys:
        digest.update(gguf.raw_metadata(key))  # the entry's bytes begin with its key's name
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _builder_digest() -> bytes:
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).digest()
    except OSError:  # no source next to the module (a frozen build): the version alone keys it
        return b""


def gguf_to_hf_tokenizer(gguf: GGUFFile):
    """A ``PreTrainedTokenizerFast`` for the vocabulary in ``gguf`` (opened with ``STRING_ARRAYS``),
    built without the cache."""
    return _wrap(*build_backend(gguf))


def build_backend(gguf: GGUFFile) -> tuple[Any, dict[str, Any]]:
    """The ``tokenizers.Tokenizer`` for the vocabulary in ``gguf`` (opened with ``STRING_ARRAYS``)
    and the JSON-able arguments its ``PreTrainedTokenizerFast`` wrapper takes."""
    tokens = gguf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelLoadError(f"GGUF file {gguf.path} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    tokenizer_model = gguf.get("tokenizer.ggml.model")
    if tokenizer_model == "gpt2":
        backend = _byte_level_bpe(gguf, tokens)
        add_bos_default = False
    elif tokenizer_model == "llama":
        backend = (
            _gemma_bpe(gguf, tokens) if gguf.architecture.startswith("gemma") else _sentencepiece_bpe(gguf, tokens)
        )
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise
        add_bos_default = True
    else:
        raise ModelLoadError(
            f"GGUF file {gguf.path} has tokenizer type {tokenizer_model!r}; tokenloom builds tokenizers of "
            "type 'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE). Pass --tokenizer with a "
            "Hugging Face tokenizer directory instead"
        )
    _add_special_tokens(backend, gguf, tokens, byte_level=tokenizer_model == "gpt2")

    named_tokens = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = gguf.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            named_tokens[name] = backend.id_to_token(int(token_id))
    kwargs: dict[str, Any] = dict(named_tokens)
    kwargs["add_bos_token"] = bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default))
    kwargs["add_eos_token"] = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    chat_template = gguf.get("tokenizer.chat_template")
    if isinstance(chat_template, str):
        kwargs["chat_template"] = chat_template
    kwargs["clean_up_tokenization_spaces"] = False
    return backend, kwargs


def _wrap(backend, init_kwargs: dict[str, Any]):
    from transformers import PreTrainedTokenizerFast

    # ``tokenizer_object=`` would deep-copy the backend (seconds for a 262k vocabulary); a backend
    # already in ``_tokenizer`` is adopted as is, the way transformers' own tokenizer classes do it
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    tokenizer.__init__(**init_kwargs)
    return tokenizer


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        # a token written outside the byte alphabet (an added token such as "<think>") is respelled
        key = token if alphabet.issuperset(token) else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[key] = index
    merges = [tuple(merge.split(" ")) for merge in gguf.get("tokenizer.ggml.merges") or []]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(gguf.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_vocab(vocab: dict[str, int], score_by_token: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every split of a token into two vocabulary pieces, the
    best-scored token first, and for one token the longer left piece first."""
    merges = []
    append = merges.append
    for token, _ in sorted(score_by_token.items(), key=lambda item: item[1], reverse=True):
        for split in range(len(token) - 1, 0, -1):
            left = token[:split]
            if left in vocab:
                right = token[split:]
                if right in vocab:
                    append((left, right))
    return merges


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    file_merges = gguf.get("tokenizer.ggml.merges")
    if isinstance(file_merges, list):
        merges = [tuple(merge.split(" ")) for merge in file_merges]
    else:
        scores = gguf.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(
                f"GGUF file {gguf.path} has neither merges nor scores for its sentencepiece vocabulary"
            )
        merges = _merges_from_vocab(vocab, dict(zip(tokens, scores.tolist())))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_UNDERLINE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE_UNDERLINE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return backend


def _gemma_bpe(gguf: GGUFFile, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    # a token of several spaces is stored with real spaces but looked up as "▁▁..."
    tokens = [SPIECE_UNDERLINE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    # Gemma files carry no merges, and their scores do not follow the merge order: the file order does
    positions = {token: -index for index, token in enumerate(tokens)}
    unknown_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unknown = tokens[unknown_id] if unknown_id is not None else "<unk>"
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_vocab(vocab, positions),
            fuse_unk=True,
            unk_token=unknown,
            byte_fallback=True,
            dropout=None,
        )
    )
    backend.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _add_special_tokens(backend, gguf: GGUFFile, tokens: list[str], *, byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so the
    text ``<|im_start|>`` is one token rather than pieces."""
    from tokenizers import AddedToken

    token_types = gguf.get("tokenizer.ggml.token_type")
    if token_types is None:
        return
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control, user_defined = [], []
    for token, token_type in zip(tokens, token_types.tolist()):
        if token_type == CONTROL_TOKEN and (alphabet is None or alphabet.issuperset(token)):
            # in a byte-level vocabulary a "control" token outside the byte alphabet is mislabelled
            control.append(AddedToken(token, normalized=False, special=True))
        elif token_type == USER_DEFINED_TOKEN and backend.token_to_id(token) is not None:
            user_defined.append(AddedToken(token, normalized=False, special=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
