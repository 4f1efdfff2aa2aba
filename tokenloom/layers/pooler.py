"""The pooler of pooling models: one vector per sequence from the final hidden states of a
flat batch (``CLS``: the first token, ``MEAN``: the average, ``LAST``: the last token),
then per request: Matryoshka truncation, L2 normalization, softmax.

A model plugin that can pool keeps one as ``self.pooler``; the model runner calls it with
the hidden states of the sequences whose prompt completed this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.errors import ConfigError

POOLING_TYPES = ("CLS", "MEAN", "LAST")


class Pooler(nn.Module):
    """Pools sequences laid end to end in ``hidden_states``; holds no weights.

    :param pooling_type: ``CLS``, ``MEAN`` or ``LAST``.
    :param normalize: L2-normalize each vector (embedding models).
    :param softmax: softmax over each vector (classifier scores).
    """

    def __init__(self, pooling_type: str = "MEAN", *, normalize: bool = True, softmax: bool = False):
        super().__init__()
        pooling_type = pooling_type.upper()
        if pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, not {pooling_type!r}")
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.softmax = softmax

    @classmethod
    def from_config(cls, pooler_config: Any, *, default_pooling_type: str) -> Pooler:
        """A pooler from a ``PoolerConfig`` (any object with ``pooling_type``, ``normalize``,
        ``softmax``; None fields, or no config, take the defaults)."""

        def setting(name: str, default: Any) -> Any:
            value = getattr(pooler_config, name, None) if pooler_config is not None else None
            return default if value is None else value

        return cls(
            setting("pooling_type", default_pooling_type),
            normalize=setting("normalize", True),
            softmax=setting("softmax", False),
        )

    def pool(self, hidden_states: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """``hidden_states [sum(seq_lens), H]`` holding the sequences end to end ->
        ``[len(seq_lens), H]`` in float32."""
        if sum(seq_lens) != hidden_states.shape[0]:
            raise ValueError(f"{hidden_states.shape[0]} hidden-state rows for sequences of {sum(seq_lens)} tokens")
        lengths = torch.tensor(list(seq_lens), device=hidden_states.device)
        ends = torch.cumsum(lengths, 0)
        if self.pooling_type == "CLS":
            return hidden_states.index_select(0, ends - lengths).float()
        if self.pooling_type == "LAST":
            return hidden_states.index_select(0, ends - 1).float()
        sequence_ids = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden_states.device), lengths)
        sums = torch.zeros(len(seq_lens), hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
        sums.index_add_(0, sequence_ids, hidden_states.float())
        return sums / lengths.unsqueeze(1).to(torch.float32)

    def finish(
        self,
        pooled: torch.Tensor,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        softmax: bool | None = None,
    ) -> torch.Tensor:
        """Per-request post-processing of ``pooled [n, H]`` (the same options for all rows):
        keep the first ``dimensions`` values, then normalize / softmax (None: this pooler's
        setting)."""
        if dimensions is not None:
            pooled = pooled[:, :dimensions]
        if self.normalize if normalize is None else normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        if self.softmax if softmax is None else softmax:
            pooled = pooled.softmax(dim=-1)
        return pooled

    def forward(
        self, hidden_states: torch.Tensor, seq_lens: Sequence[int], params: Sequence[Any] | None = None
    ) -> list[torch.Tensor]:
        """One float32 CPU tensor per sequence; ``params[i]`` (a ``PoolingParams`` or None)
        carries sequence ``i``'s ``dimensions`` / ``normalize`` / ``softmax``."""
        pooled = self.pool(hidden_states, seq_lens)
        params = list(params) if params is not None else [None] * len(seq_lens)
        options = [_options_of(p) for p in params]
        # requests in a step usually ask for the same thing: one vectorised pass for each kind
        results: list[torch.Tensor | None] = [None] * len(options)
        for option in set(options):
            rows = [index for index, candidate in enumerate(options) if candidate == option]
            selected = pooled if len(rows) == len(options) else pooled[rows]
            dimensions, normalize, softmax = option
            finished = self.finish(selected, dimensions=dimensions, normalize=normalize, softmax=softmax).cpu()
            for position, index in enumerate(rows):
                results[index] = finished[position].clone()
        return results

    def extra_repr(self) -> str:
        return f"type={self.pooling_type}, normalize={self.normalize}, softmax={self.softmax}"


def _options_of(params: Any) -> tuple[int | None, bool | None, bool | None]:
    if params is None:
        return None, None, None
    return getattr(params, "dimensions", None), getattr(params, "normalize", None), getattr(params, "softmax", None)
