"""The token embedding and the LM head, split over the vocabulary for tensor parallelism.

Both keep dense weights in the model dtype (a packed checkpoint tensor is dequantized at
load): the LM head's matmul is the largest of a small model, and a dense GEMM is the
fastest form on the CPU. A tied LM head shares the embedding's parameter, which the lookup
needs dense; the head multiplies a oneDNN-packed copy of it where oneDNN runs its dtype
natively (:mod:`tokenloom.kernels.onednn_linear`). A float32 head the platform chose (no native
bfloat16) also keeps a float16 copy for decode steps of a few rows, which read the whole weight
for a few rows of output (half the bytes; figures in docs/design.md); hidden states beyond
float16's range take the wide path.
A checkpoint tensor of quantized blocks (a GGUF ``GGUFWeight``: it offers ``dequantize_rows``)
is kept as such, and no dense table is made of it where nothing needs one: the embedding
dequantizes the rows it looks up (the same values as the dense table's), and a bfloat16 head
(or a float32 one the platform chose) multiplies the file's codes where one of tokenloom's
kernels takes the type (``kernel_weight()`` of the blocks: Q8_0 with
:mod:`tokenloom.kernels.int8_matmul`, Q5_0/Q5_1/Q5_K/Q6_K with
:mod:`tokenloom.kernels.kquant_matmul`, Q2_K/Q3_K with :mod:`tokenloom.kernels.lowbit_matmul`; GGML's Q x Q8 arithmetic, every CPU kernel level), for
every batch, float32 logits straight out: about the file's bytes per token instead of a 16-bit
copy's, and its exact weight values. A tied pair then holds the head's packed codes and no dense
weight: the lookup reads its rows back out of them where the type has a way back (Q6_K and Q8_0,
``GGUFWeight.rows_in``), else out of the file's blocks beside them. Once packed, the file's pages
of the tensor are dropped from memory (its ``release``) unless the lookup still reads them. A head
no kernel takes makes the dense weight from the blocks after all (shared with a tied embedding,
which then looks up in it).

A head the checkpoint stores quantized as a linear layer (a GPTQ checkpoint's ``lm_head:
true``; see :attr:`~tokenloom.layers.quantization.QuantizationConfig.quantizes_lm_head`) is a
:class:`QuantizedLMHead` instead: a column-parallel linear layer over the vocabulary whose method
the config chooses, multiplying the checkpoint's codes with no dense copy, beside a dense
embedding.

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
from tokenloom.kernels.int8_matmul import Int8Weight, int8_linear
from tokenloom.kernels.kquant_matmul import KQuantWeight, kquant_linear
from tokenloom.kernels.lowbit_matmul import LowbitWeight, lowbit_linear
from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear
from tokenloom.layers.linear import ColumnParallelLinear, tensor_parallel_all_reduce, tp_place
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
        # this rank's rows of a checkpoint tensor of quantized blocks, kept in place of the dense
        # weight (see the module docstring); None once the dense weight is made
        self.row_blocks: Any = None
        self.tied_to_head = False  # set by ParallelLMHead.tie_to: the head decides on the dense weight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.row_blocks is not None:
            return self.row_blocks.dequantize_rows(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            embeddings = self._lookup(input_ids)
            return embeddings if self.lora is None else self.lora.add_delta(input_ids, embeddings)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        embeddings = self._lookup(local_ids) * in_range.unsqueeze(-1)
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
        if callable(getattr(rows, "dequantize_rows", None)):
            # kept as blocks: the dense weight is made, if at all, in process_weights_after_loading
            self.row_blocks = rows
            return
        self.row_blocks = None
        tensor = materialize(rows, self.weight.dtype)
        self.weight.data[: tensor.shape[0]].copy_(tensor)

    def process_weights_after_loading(self) -> None:
        """An embedding that holds blocks looks its rows up in them and drops the dense weight
        (one tied to a head leaves that to ParallelLMHead.process_weights_after_loading)."""
        if self.row_blocks is not None and not self.tied_to_head:
            self._drop_dense_weight()

    def _drop_dense_weight(self) -> None:
        self.weight = nn.Parameter(
            torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"), requires_grad=False
        )

    def _make_dense_weight(self) -> None:
        """The dense weight from the kept blocks, which are then dropped."""
        tensor = self.row_blocks.dequantize(self.weight.dtype)
        self.weight.data[: tensor.shape[0]].copy_(tensor)
        self.row_blocks = None

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
        # the checkpoint's codes packed for a kernel that gives float32 logits (module docstring)
        self.kernel_weight: Int8Weight | KQuantWeight | LowbitWeight | None = None
        self._tied_to: VocabParallelEmbedding | None = None
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
        embedding.tied_to_head = True

    def forward(self, input_ids):
        raise TypeError("ParallelLMHead computes logits: call compute_logits(hidden_states)")

    def process_weights_after_loading(self) -> None:
        source = self._tied_to if self._tied_to is not None else self
        # bfloat16, or float32 the platform chose (it asked for a small-batch copy: the dtype was
        # not the user's, so it need not stay exact)
        inexact = self.weight.dtype == torch.bfloat16 or (
            self.weight.dtype == torch.float32 and self.small_batch_dtype is not None
        )
        if source.row_blocks is not None and inexact and self.bias is None:
            self.kernel_weight = source.row_blocks.padded_rows(self.weight.shape[0]).kernel_weight()
        if self.kernel_weight is not None:  # no dense weight: a tied embedding looks up in the codes or blocks
            source._drop_dense_weight()
            self.weight = source.weight
            blocks = source.row_blocks
            if source is self:
                self.row_blocks = None
            else:  # the tied embedding looks up in the head's codes where the type has a way back
                lookup = blocks.rows_in(self.kernel_weight)
                if lookup is None:
                    return
                source.row_blocks = lookup
            release = getattr(blocks, "release", None)
            if release is not None:  # the file's pages the packing read leave this process's memory
                release()
            return
        if source.row_blocks is not None:
            source._make_dense_weight()
        if self.small_batch_dtype is not None and self.small_batch_dtype != self.weight.dtype:
            self.small_batch_weight = self.weight.detach().to(self.small_batch_dtype)
        if packable(self.weight):
            self.packed_weight = pack_weight(self.weight)

    def _use_small_batch_copy(self, hidden_states: torch.Tensor) -> bool:
        return (
            self.small_batch_weight is not None
            and hidden_states.shape[0] <= SMALL_BATCH_ROWS
            and bool(hidden_states.abs().max() < _FLOAT16_MAX)
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits."""
        if isinstance(self.kernel_weight, Int8Weight):
            logits = int8_linear(hidden_states, self.kernel_weight)
        elif isinstance(self.kernel_weight, LowbitWeight):
            logits = lowbit_linear(hidden_states, self.kernel_weight, dtype=torch.float32)
        elif self.kernel_weight is not None:
            logits = kquant_linear(hidden_states, self.kernel_weight, dtype=torch.float32)
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


class QuantizedLMHead(ColumnParallelLinear):
    """``hidden -> logits`` through a quantized linear layer of ``vocab_size`` output rows, each
    rank's an equal share of the vocabulary (a vocabulary the tensor-parallel size does not
    divide is refused when the layer is built)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits."""
        # float32 in, float32 logits out: the kernels quantize the activations themselves, so a
        # bfloat16 model's logits are not rounded to bfloat16 on the way out
        logits = self(hidden_states.float())
        if self.tp_size > 1:
            logits = self.tp_group.all_gather(logits.contiguous(), dim=-1)
        return logits
