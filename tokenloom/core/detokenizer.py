"""Incremental detokenization of one sequence and its stop strings: :class:`IncrementalDetokenizer`
turns each step's new token ids into a text delta that never splits a character and never shows
a client the beginning of a stop string.
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import InvalidRequestError

# Prompt tokens decoded ahead of the first output token, so tokenizers that drop a leading
# space at the start of a decode (SentencePiece/Metaspace) keep it on the first output word.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _TokenizerFacts:
    """What the detokenizer needs to know about a tokenizer, computed once per tokenizer
    (transformers rebuilds ``all_special_ids`` on every access)."""

    def __init__(self, tokenizer: Any):
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        # added tokens flagged special are skipped by ``tokenizer.decode`` even when they are
        # not among the named special tokens (e.g. SmolLM2's ``<repo_name>``)
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                special_ids.add(token_id)
        self.special_ids = frozenset(special_ids)
        self.special_tokens = frozenset(
            token for token in tokenizer.convert_ids_to_tokens(sorted(special_ids)) if token is not None
        )


_facts_cache: weakref.WeakKeyDictionary[Any, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer: Any) -> _TokenizerFacts:
    try:
        facts = _facts_cache.get(tokenizer)
    except TypeError:  # not weak-referenceable: compute every time
        return _TokenizerFacts(tokenizer)
    if facts is None:
        facts = _TokenizerFacts(tokenizer)
        _facts_cache[tokenizer] = facts
    return facts


class StopStringMatcher:
    """An Aho-Corasick automaton over a request's stop strings, fed the output text as it
    grows. Its state is the longest suffix of the text so far that begins some stop string, so
    both questions the detokenizer asks each step -- did a stop string just end, and how much
    of the tail must be held back -- cost O(new characters), not O(text x stop strings).
    """

    def __init__(self, stop_strings: list[str]):
        # state 0 is the empty prefix; state s stands for the prefix _prefix_len[s] characters long
        self._goto: list[dict[str, int]] = [{}]
        self._prefix_len = [0]
        self._fail = [0]
        # True where the state (or a suffix of it, via the failure links) is a whole stop string
        self._matches = [False]
        for stop in stop_strings:
            state = 0
            for char in stop:
                next_state = self._goto[state].get(char)
                if next_state is None:
                    next_state = len(self._goto)
                    self._goto[state][char] = next_state
                    self._goto.append({})
                    self._prefix_len.append(self._prefix_len[state] + 1)
                    self._fail.append(0)
                    self._matches.append(False)
                state = next_state
            self._matches[state] = True
        # breadth first, so a state's failure target is final before its children need it
        queue = list(self._goto[0].values())
        for state in queue:
            for char, child in self._goto[state].items():
                fallback = self._fail[state]
                while fallback and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                target = self._goto[fallback].get(char, 0)
                self._fail[child] = target if target != child else 0
                self._matches[child] = self._matches[child] or self._matches[self._fail[child]]
                queue.append(child)
        self._state = 0

    @property
    def partial_match_len(self) -> int:
        """Characters at the end of the text fed so far that some stop string starts with."""
        return self._prefix_len[self._state]

    def feed(self, text: str) -> bool:
        """Advance over ``text``; True when a stop string ends inside it."""
        goto, fail, matches = self._goto, self._fail, self._matches
        state = self._state
        matched = False
        for char in text:
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if matches[state]:
                matched = True
        self._state = state
        return matched


class IncrementalDetokenizer:
    """Detokenizes one sequence step by step and applies its stop strings.

    The engine calls :meth:`update` with each step's new token ids and streams the returned
    delta; when :attr:`stop_string` becomes non-None the request finished on that string.
    When the request finishes for any other reason it calls :meth:`flush` for the text still
    held back. :attr:`output_text` is all text decoded so far (truncated at a stop string);
    :attr:`released_text` is the part already returned as deltas.

    Text is decoded over a small window of recent tokens (``prefix_offset:``) and only what
    follows the already-emitted part of that window (``read_offset``) is new, so each step
    costs O(window), not O(length); a window whose text ends in U+FFFD is an incomplete
    UTF-8 character and waits for the next token.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], sampling_params: SamplingParams):
        self.sampling_params = sampling_params
        self.output_text = ""
        self.stop_string: str | None = None
        self._num_released_chars = 0
        self._enabled = sampling_params.detokenize
        self._stop_strings: list[str] = list(sampling_params.stop or [])
        self._max_stop_len = max((len(stop) for stop in self._stop_strings), default=0)
        self._stop_matcher = StopStringMatcher(self._stop_strings) if self._stop_strings else None
        if not self._enabled:
            if self._stop_strings:
                raise InvalidRequestError(
                    "stop strings need detokenize=True; use stop_token_ids to stop on tokens without text",
                    param="stop",
                )
            return
        if tokenizer is None:
            raise InvalidRequestError(
                "detokenize=True needs a tokenizer; the engine runs without one (skip_tokenizer_init), "
                "so set detokenize=False",
                param="detokenize",
            )
        self._tokenizer = tokenizer
        self._facts = _tokenizer_facts(tokenizer)
        self._tokens: list[str] = self._ids_to_tokens(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))
        # tokens[prefix_offset:read_offset] is text already accounted for, kept as context
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    @property
    def has_stop_strings(self) -> bool:
        return self._enabled and bool(self._stop_strings)

    @property
    def released_text(self) -> str:
        """The text already returned as deltas (what a streaming client has seen)."""
        return self.output_text[: self._num_released_chars]

    def update(self, new_token_ids: list[int]) -> str:
        """Add a step's new tokens; returns the text a client may see now (possibly "")."""
        if not self._enabled or self.stop_string is not None or not new_token_ids:
            return ""
        self._tokens.extend(self._ids_to_tokens(new_token_ids))
        self._decode_new_text(allow_incomplete=False)
        return self._release(final=self.stop_string is not None)

    def flush(self) -> str:
        """The request finished (eos, length, abort): decode what was held back and release it all."""
        if not self._enabled:
            return ""
        if self.stop_string is None and self._read_offset < len(self._tokens):
            self._decode_new_text(allow_incomplete=True)
        return self._release(final=True)

    def _ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        if self.sampling_params.skip_special_tokens:
            token_ids = [token_id for token_id in token_ids if token_id not in self._facts.special_ids]
        tokens = self._tokenizer.convert_ids_to_tokens(token_ids)
        # ids outside the vocabulary (a padded LM head) have no token and decode to nothing
        return [token if token is not None else "" for token in tokens]

    def _tokens_to_text(self, tokens: list[str]) -> str:
        special_tokens = self._facts.special_tokens
        if not self.sampling_params.spaces_between_special_tokens or not any(
            token in special_tokens for token in tokens
        ):
            return str(self._tokenizer.convert_tokens_to_string(tokens))
        # special tokens kept in the text stand apart, separated by spaces (transformers'
        # documented meaning of spaces_between_special_tokens)
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in special_tokens:
                if run:
                    pieces.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self._tokenizer.convert_tokens_to_string(run))
        return " ".join(pieces)

    def _decode_new_text(self, *, allow_incomplete: bool) -> None:
        prefix_text = self._tokens_to_text(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._tokens_to_text(self._tokens[self._prefix_offset :])
        if len(window_text) <= len(prefix_text):
            return
        if window_text.endswith(_REPLACEMENT_CHAR) and not allow_incomplete:
            return  # an incomplete UTF-8 character: wait for the token that completes it
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        new_text_start = len(self.output_text)
        new_text = window_text[len(prefix_text) :]
        self.output_text += new_text
        # the automaton says cheaply whether a stop string ended; only then is it located
        if self._stop_matcher is not None and self._stop_matcher.feed(new_text):
            self._find_stop_string(new_text_start)

    def _find_stop_string(self, new_text_start: int) -> None:
        # Earlier text held no stop string, so a match must end in the new text: start the
        # search max_stop_len - 1 characters before it.
        search_start = max(0, new_text_start - self._max_stop_len + 1)
        first_index, first_stop = -1, None
        for stop in self._stop_strings:
            index = self.output_text.find(stop, search_start)
            if index != -1 and (first_stop is None or index < first_index):
                first_index, first_stop = index, stop
        if first_stop is None:
            return
        self.stop_string = first_stop
        keep = first_index + len(first_stop) if self.sampling_params.include_stop_str_in_output else first_index
        self.output_text = self.output_text[:keep]

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the text that a stop string starts with."""
        return self._stop_matcher.partial_match_len if self._stop_matcher is not None else 0

    def _release(self, *, final: bool) -> str:
        # Held-back text always lies after what was released: a suffix that could begin a
        # stop string only grows from a shorter such suffix, which was held back before.
        hold = 0 if final or self._stop_matcher is None else self._held_back_len()
        end = max(self._num_released_chars, len(self.output_text) - hold)
        delta = self.output_text[self._num_released_chars : end]
        self._num_released_chars = end
        return delta
