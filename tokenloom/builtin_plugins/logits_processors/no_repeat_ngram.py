"""``no_repeat_ngram``: no n-gram of the output (with the prompt before it) occurs twice,
Hugging Face's ``no_repeat_ngram_size``. A request asks for it with
``"logits_processors": [{"qualname": "no_repeat_ngram", "kwargs": {"ngram_size": 3}}]``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenloom.plugin_api import LogitsProcessor


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Bans every token that would complete an n-gram already present in the prompt and output."""

    def __init__(self, ngram_size: int = 3, include_prompt: bool = True):
        if not isinstance(ngram_size, int) or isinstance(ngram_size, bool) or ngram_size < 1:
            raise ValueError(f"ngram_size must be a positive integer, got {ngram_size!r}")
        self.ngram_size = ngram_size
        self.include_prompt = bool(include_prompt)
        # (n-1)-gram prefix -> the tokens that followed it; extended one position per step
        # instead of rescanning the whole sequence
        self._followers: dict[tuple[int, ...], set[int]] = {}
        self._num_indexed = 0

    def __call__(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], logits: torch.Tensor
    ) -> torch.Tensor:
        size = self.ngram_size
        tokens = list(prompt_token_ids if self.include_prompt else ()) + list(output_token_ids)
        # index every n-gram that ends at a position not seen yet
        for end in range(max(self._num_indexed, size), len(tokens) + 1):
            prefix = tuple(tokens[end - size : end - 1])
            self._followers.setdefault(prefix, set()).add(tokens[end - 1])
        self._num_indexed = max(self._num_indexed, len(tokens) + 1)
        if len(tokens) < size - 1:
            return logits
        banned = self._followers.get(tuple(tokens[len(tokens) - size + 1 :]) if size > 1 else ())
        if banned:
            logits[list(banned)] = float("-inf")
        return logits
