"""The worker's encoder cache: each image's embeddings (the vision encoder and projector's
output) kept by the image's hash, so an image a request repeats, or another request sends
again, is encoded once; and :func:`scheduled_embeddings`, which picks the embeddings of the
placeholder tokens a step computes. An image is always encoded whole and sliced here, so a
chunked prefill that stops inside an image's placeholders gets the right rows in each chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.core.multimodal.inputs import MultiModalItem

# embeddings kept, in feature tokens, at least (the step's token budget raises it)
MIN_ENCODER_CACHE_TOKENS = 8192


@dataclass
class EncoderCacheStats:
    """Counters since start-up: items looked up, found, and run through the encoder."""

    queries: int = 0
    hits: int = 0
    encoder_runs: int = 0


class EncoderCache:
    """Embeddings by item hash, least recently used dropped beyond ``max_tokens`` feature tokens
    (the item a step needs is never dropped by its own insertion)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._tokens = 0
        self.stats = EncoderCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_encode(self, item: MultiModalItem, encode: Callable[[MultiModalItem], torch.Tensor]) -> torch.Tensor:
        self.stats.queries += 1
        embeddings = self._entries.get(item.hash)
        if embeddings is not None:
            self.stats.hits += 1
            self._entries.move_to_end(item.hash)
            return embeddings
        embeddings = encode(item)
        self.stats.encoder_runs += 1
        if embeddings.shape[0] != item.length:
            raise RuntimeError(
                f"the model embedded a {item.modality} into {embeddings.shape[0]} rows, but its processor gave it "
                f"{item.length} placeholder tokens"
            )
        self._entries[item.hash] = embeddings
        self._tokens += item.length
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.shape[0]
        return embeddings


def scheduled_embeddings(
    rows: Sequence[tuple[Sequence[MultiModalItem], int, int]],
    cache: EncoderCache,
    encode: Callable[[MultiModalItem], torch.Tensor],
) -> tuple[list[int], torch.Tensor] | None:
    """For a step's rows, each ``(items, first_position, num_tokens)`` in batch order: the flat
    batch indices of the placeholder tokens computed this step and their embeddings, in the
    same order (None: the step computes no placeholder)."""
    indices: list[int] = []
    pieces: list[torch.Tensor] = []
    row_start = 0
    for items, first, num_tokens in rows:
        last = first + num_tokens
        for item in items:
            start, end = max(item.offset, first), min(item.end, last)
            if start >= end:
                continue
            embeddings = cache.get_or_encode(item, encode)
            pieces.append(embeddings[start - item.offset : end - item.offset])
            indices.extend(range(row_start + start - first, row_start + end - first))
        row_start += num_tokens
    if not pieces:
        return None
    return indices, torch.cat(pieces)


def merged_input_embeddings(
    model: Any,
    cache: EncoderCache,
    rows: Sequence[tuple[Sequence[MultiModalItem], int, int]],
    input_ids: torch.Tensor,
    attention_backend: Any,
) -> torch.Tensor | None:
    """The step's input embeddings with each scheduled placeholder token's row replaced by its
    item's embedding (the model's ``embed_input_ids`` and ``embed_multimodal``); None when the
    step computes no placeholder, and the model embeds ``input_ids`` itself."""
    if not any(items for items, _, _ in rows):
        return None
    scheduled = scheduled_embeddings(rows, cache, lambda item: model.embed_multimodal(item, attention_backend))
    if scheduled is None:
        return None
    indices, embeddings = scheduled
    inputs_embeds: torch.Tensor = model.embed_input_ids(input_ids)
    inputs_embeds[torch.tensor(indices, device=inputs_embeds.device)] = embeddings.to(inputs_embeds.dtype)
    return inputs_embeds
