"""The token embedding and the LM head, split over the vocabulary for tensor parallelism.

Both keep dense weights in the model dtype (a packed checkpoint tensor is dequantized at
load): the LM head's matmul is the largest of a small model, and a dense GEMM is the
fastest form on the CPU. A tied LM head shares the embedding's parameter, which the lookup
needs dense; the head multiplies a oneDNN-packed copy of it where oneDNN runs its dtype
natively (:mod:`tokenloom.kernels.onednn_linear`). A float32 head the platform chose (no native
bfloat16) also keeps a float16 copy for decode steps of a few rows, which read the whole weight
for a few rows of output (half the bytes; figures in docs/design.md); hidden states beyond
float16's range take the wide path.
A bfloat16 head (or a float32 one the platform chose) whose checkpoint tensor is int8 groups
(GGUF Q8_0, SmolLM2's tied embedding) keeps them instead of the packed or float16 copy where
tokenloom's int8 kernel is built (:mod:`tokenloom.kernels.int8_matmul`, GGML's Q8 x Q8
arithmetic, every CPU kernel level), for every batch: half the bytes of a 16-bit copy and the
file's exact weight values.

Under tensor parallelism (``tp_group``, the model's ``ctx.parallel.tp``) each rank holds
``ceil(vocab / tp)`` rows (the last rank's tail zero): the embedding looks up the ids in its
range, zeroes the others and sums over ranks; the head computes its shard's logits and gathers
every rank's, whose concatenation is the vocabulary in order with the padding at the end. A
packed checkpoint tensor is cut to this rank's rows before it is dequantized.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.int8_matmul import Int8Weight, int8_linear, pack_int8
from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear
from tokenloom.layers.linear import tensor_parallel_all_reduce, tp_place
from tokenloom.layers.quantization import materialize


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the token ids rank ``tp_rank`` holds (the last rank may hold fewer)."""
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor-parallel rank {tp_rank} is outside 0..{tp_size - 1}")
    per_rank = math.ceil(vocab_size / tp_size)
    start = min(tp_rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """``token id -> embedding row``; each rank holds a contiguous range of the vocabulary."""

    #: the LoRA path beside the lookup (a :class:`tokenloom.lora.layers.EmbeddingLoRA`; for the
    #: LM head a :class:`~tokenloom.lora.layers.LogitsLoRA`), set by the LoRA manager
    lora: Any = None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank, self.tp_size = tp_place(tp_group, tp_rank, tp_size)
        self.tp_group = tp_group
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.tp_rank, self.tp_size)
        rows = math.ceil(num_embeddings / self.tp_size)  # equal shapes on every rank; tail rows stay zero
        # uninitialised but the tail: zero-filling a large vocabulary costs more than loading it
        weight = torch.empty(rows, embedding_dim, dtype=params_dtype or torch.get_default_dtype())
        weight[self.vocab_end - self.vocab_start :].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.int8_groups: tuple[torch.Tensor, torch.Tensor] | None = None  # see load_checkpoint_weight
        self.keeps_int8_groups = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            embeddings = F.embedding(input_ids, self.weight)
            return embeddings if self.lora is None else self.lora.add_delta(input_ids, embeddings)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        embeddings = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1)
        return tensor_parallel_all_reduce(embeddings, self.tp_group, self.tp_size)

    def _rows_for_rank(self, loaded_weight: Any) -> Any:
        """This rank's vocabulary rows of a checkpoint tensor: a packed one that can be cut
        (GGUF's ``narrow_rows``) is cut in its packed form, so only this rank's rows are ever
        dequantized."""
        if hasattr(loaded_weight, "narrow_rows"):
            shape = tuple(loaded_weight.shape)
        else:
            loaded_weight = materialize(loaded_weight)
            shape = tuple(loaded_weight.shape)
        if len(shape) != 2 or shape[1] != self.embedding_dim or shape[0] < self.vocab_end:
            raise ModelLoadError(
                f"embedding of shape {shape} does not fit vocab {self.num_embeddings} x {self.embedding_dim}"
            )
        local_rows = self.vocab_end - self.vocab_start
        if shape[0] == local_rows:
            return loaded_weight
        if hasattr(loaded_weight, "narrow_rows"):
            return loaded_weight.narrow_rows(self.vocab_start, local_rows)
        return loaded_weight[self.vocab_start : self.vocab_end]

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        if param_name != "weight" or shard_id is not None:
            raise ModelLoadError(f"{type(self).__name__} loads one 'weight' tensor, not {param_name!r}/{shard_id!r}")
        rows = self._rows_for_rank(loaded_weight)
        tensor = materialize(rows, self.weight.dtype)
        self.weight.data[: tensor.shape[0]].copy_(tensor)
        # an LM head (or the embedding tied to one) keeps a checkpoint tensor of int8 groups
        # (GGUF Q8_0) as such, for ParallelLMHead.process_weights_after_loading to pack
        int8_groups = getattr(rows, "int8_groups", None)
        if self.keeps_int8_groups and callable(int8_groups):
            self.int8_groups = int8_groups()

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, rows={self.vocab_start}:{self.vocab_end}"


# batches up to this many rows use the head's narrower copy (see the module docstring)
SMALL_BATCH_ROWS = 4
# the largest finite float16
_FLOAT16_MAX = 65504.0


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden -> logits`` over the vocabulary; ``tie_to(embedding)`` shares its weight.

    :param small_batch_dtype: keep a copy of the weight in this dtype (made by
        :meth:`process_weights_after_loading`) for batches of up to ``SMALL_BATCH_ROWS`` rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        bias: bool = False,
        small_batch_dtype: torch.dtype | None = None,
        **kwargs,
    ):
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.small_batch_dtype = small_batch_dtype
        self.small_batch_weight: torch.Tensor | None = None
        self.packed_weight: torch.Tensor | None = None
        self.int8_weight: Int8Weight | None = None
        self._tied_to: VocabParallelEmbedding | None = None
        self.keeps_int8_groups = True
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.weight.shape[0], dtype=self.weight.dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ConfigError(
                f"cannot tie an LM head of shape {tuple(self.weight.shape)} to an embedding of shape "
                f"{tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight
        self._tied_to = embedding
        embedding.keeps_int8_groups = True

    def forward(self, input_ids):
        raise TypeError("ParallelLMHead computes logits: call compute_logits(hidden_states)")

    def process_weights_after_loading(self) -> None:
        source = self._tied_to if self._tied_to is not None else self
        # bfloat16, or float32 the platform chose (it asked for a small-batch copy: the dtype was
        # not the user's, so it need not stay exact)
        inexact = self.weight.dtype == torch.bfloat16 or (
            self.weight.dtype == torch.float32 and self.small_batch_dtype is not None
        )
        if source.int8_groups is not None and inexact and self.bias is None:
            codes, scales = source.int8_groups
            padding = self.weight.shape[0] - codes.shape[0]
            if 0 < padding < self.weight.shape[0]:
                # the last rank of a split vocabulary: zero rows up to the shard's padded size
                codes = F.pad(codes, (0, 0, 0, padding))
                scales = F.pad(scales, (0, 0, 0, padding))
            self.int8_weight = pack_int8(codes, scales) if codes.shape[0] == self.weight.shape[0] else None
        source.int8_groups = None  # packed (or not needed): not kept twice
        if (
            self.int8_weight is None
            and self.small_batch_dtype is not None
            and self.small_batch_dtype != self.weight.dtype
        ):
            self.small_batch_weight = self.weight.detach().to(self.small_batch_dtype)
        if self.int8_weight is None and packable(self.weight):
            self.packed_weight = pack_weight(self.weight)

    def _use_small_batch_copy(self, hidden_states: torch.Tensor) -> bool:
        return (
            self.small_batch_weight is not None
            and hidden_states.shape[0] <= SMALL_BATCH_ROWS
            and bool(hidden_states.abs().max() < _FLOAT16_MAX)
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits."""
        if self.int8_weight is not None:
            logits = int8_linear(hidden_states, self.int8_weight)
        elif self._use_small_batch_copy(hidden_states):
            logits = F.linear(hidden_states.to(self.small_batch_weight.dtype), self.small_batch_weight).float()
            if self.bias is not None:
                logits = logits + self.bias
        elif self.packed_weight is not None and hidden_states.dtype == self.packed_weight.dtype:
            logits = packed_linear(hidden_states, self.packed_weight, self.bias)
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError(
                    f"an LM head split over {self.tp_size} tensor-parallel ranks was built without a communicator"
                )
            # every rank's padded shard in rank order: token id i lands in column i, the padding after the vocabulary
            logits = self.tp_group.all_gather(logits.float().contiguous(), dim=-1)
        return self._lora_logits(hidden_states, logits[:, : self.num_embeddings].float())

    def _lora_logits(self, hidden_states: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.lora is None else self.lora.add_delta(hidden_states, logits)

    def load_checkpoint_weight(self, param_name, loaded_weight, shard_id=None):
        if param_name == "bias" and self.bias is not None:
            tensor = materialize(loaded_weight, self.bias.dtype)[self.vocab_start : self.vocab_end]
            self.bias.data[: tensor.shape[0]].copy_(tensor)
            return
        super().load_checkpoint_weight(param_name, loaded_weight, shard_id)
