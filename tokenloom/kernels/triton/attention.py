"""The Triton paged-attention backend (``--attention-backend triton``, the CUDA platform's
default): the step's keys and values written into the paged cache by one kernel, prefills
(varlen, causal, over a cached prefix, sliding window, soft-capping, GQA) by a flash-attention
style kernel that reads every key through the block table, and decodes by a split-K kernel
(the context cut into partitions attended in parallel, then one reduction).

The torch reference it is tested against is
:func:`tokenloom.kernels.paged_attention.reference_paged_attention`. Bidirectional (encoder)
batches, which keep no cache, and steps whose prompts hold spans attending both ways
(``AttentionMetadata.bidirectional_spans``: Gemma 3's images) are handed to
:class:`TorchPagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.errors import ConfigError
from tokenloom.kernels import triton as triton_kernels
from tokenloom.kernels.paged_attention import TorchPagedAttention


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


@dataclass
class _StepPlan:
    """Which sequences of a step go to which kernel, as device index tensors (made once per
    step: every layer of the step shares the metadata object)."""

    decode_seq_indices: torch.Tensor | None
    prefill_seq_indices: torch.Tensor | None
    # blocks of BLOCK_M query rows in the longest prefill
    prefill_row_blocks: int
    # the longest decode context and, per sliding window, the split count it needs
    longest_decode: int
    num_splits: dict[int | None, int]


class TritonPagedAttention:
    """Paged attention by Triton kernels.

    :param partition_size: keys per split-K partition of a decode (a multiple of
        ``decode_block_n``); smaller means more programs per long context.
    :param prefill_block_m: query rows per prefill program (at least 16: ``tl.dot``'s minimum).
    :param prefill_block_n: keys per prefill loop step (at least 16).
    :param decode_block_n: keys per decode loop step.
    """

    def __init__(
        self,
        partition_size: int = 512,
        prefill_block_m: int = 64,
        prefill_block_n: int = 64,
        decode_block_n: int = 64,
    ) -> None:
        if prefill_block_m < 16 or prefill_block_n < 16:
            raise ConfigError("Triton prefill blocks must be at least 16 rows and 16 keys (tl.dot's minimum)")
        if partition_size % decode_block_n:
            raise ConfigError(f"partition size {partition_size} must be a multiple of {decode_block_n}")
        if not torch.cuda.is_available():
            triton_kernels.check_can_run("cpu")
        self._kernels = triton_kernels.import_kernels("_attention_kernels")
        self.partition_size = partition_size
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n
        self.decode_block_n = decode_block_n
        self._planned_metadata = None
        self._plan: _StepPlan | None = None
        self._bidirectional_backend: TorchPagedAttention | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key/value [T, Hkv, D]`` -> ``[T, Hq, D]``; writes K/V into
        ``kv_cache`` at ``attn_metadata.slot_mapping`` first."""
        if attn_metadata.bidirectional or getattr(attn_metadata, "bidirectional_spans", None) is not None:
            # encoder batches, and steps with an image attending both ways (Gemma 3), which the
            # prefill kernel's causal mask cannot express: the torch backend (same cache layout)
            if self._bidirectional_backend is None:
                self._bidirectional_backend = TorchPagedAttention()
            return self._bidirectional_backend.forward(
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                scale=scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        triton_kernels.check_can_run(query.device)
        self.write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.shape[0] == 0:
            return output
        plan = self._step_plan(attn_metadata)
        window = sliding_window if sliding_window is not None and sliding_window > 0 else None
        if plan.prefill_seq_indices is not None:
            self._prefill(output, query, kv_cache, attn_metadata, plan, scale, window, logits_soft_cap)
        if plan.decode_seq_indices is not None:
            self._decode(output, query, kv_cache, attn_metadata, plan, scale, window, logits_soft_cap)
        return output

    __call__ = forward

    # -- the kernels' launches ----------------------------------------------------------

    def write_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        """This step's ``key``/``value`` ``[T, Hkv, D]`` to their slots of ``kv_cache``
        ``[2, blocks, block_size, Hkv, D]`` (the reference: :func:`paged_attention.write_kv_cache`)."""
        if kv_cache is None:
            raise ConfigError("no KV cache for this attention layer: the runner must allocate one per layer")
        if not kv_cache.is_contiguous():
            raise ConfigError("the KV cache tensor must be contiguous: one [2, blocks, block_size, heads, dim] tensor")
        num_tokens, num_kv_heads, head_size = key.shape
        if num_tokens == 0:
            return
        key, value = _unit_last_stride(key), _unit_last_stride(value)
        self._kernels.write_kv_kernel[(num_tokens, num_kv_heads)](
            key,
            value,
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            HEAD_SIZE=head_size,
            BLOCK_D=_next_power_of_two(head_size),
        )

    def _prefill(self, output, query, kv_cache, attn_metadata, plan, scale, window, soft_cap) -> None:
        query = _unit_last_stride(query)
        num_q_heads, head_size = query.shape[1], query.shape[2]
        block_tables = attn_metadata.block_tables
        grid = (plan.prefill_seq_indices.numel(), num_q_heads, plan.prefill_row_blocks)
        self._kernels.prefill_kernel[grid](
            output,
            query,
            kv_cache[0],
            kv_cache[1],
            block_tables,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            plan.prefill_seq_indices,
            float(scale),
            float(soft_cap or 0.0),
            int(window or 0),
            num_q_heads // kv_cache.shape[3],
            query.stride(0),
            query.stride(1),
            output.stride(0),
            output.stride(1),
            block_tables.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            HEAD_SIZE=head_size,
            KV_BLOCK_SIZE=attn_metadata.block_size,
            BLOCK_M=self.prefill_block_m,
            BLOCK_N=self.prefill_block_n,
            BLOCK_D=max(16, _next_power_of_two(head_size)),
            USE_SOFT_CAP=soft_cap is not None,
            USE_WINDOW=window is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        )

    def _decode(self, output, query, kv_cache, attn_metadata, plan, scale, window, soft_cap) -> None:
        query = _unit_last_stride(query)
        num_q_heads, head_size = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        group_size = num_q_heads // num_kv_heads
        num_rows = plan.decode_seq_indices.numel()
        num_splits = plan.num_splits.get(window)
        if num_splits is None:
            longest = plan.longest_decode if window is None else min(plan.longest_decode, window)
            num_splits = plan.num_splits[window] = max(1, -(-longest // self.partition_size))
        block_d = _next_power_of_two(head_size)
        device = query.device
        partial_output = torch.empty((num_rows, num_q_heads, num_splits, block_d), dtype=torch.float32, device=device)
        partial_max = torch.empty((num_rows, num_q_heads, num_splits), dtype=torch.float32, device=device)
        partial_sum = torch.empty_like(partial_max)
        block_tables = attn_metadata.block_tables
        self._kernels.decode_split_kernel[(num_rows, num_kv_heads, num_splits)](
            partial_output,
            partial_max,
            partial_sum,
            query,
            kv_cache[0],
            kv_cache[1],
            block_tables,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            plan.decode_seq_indices,
            float(scale),
            float(soft_cap or 0.0),
            int(window or 0),
            group_size,
            self.partition_size,
            query.stride(0),
            query.stride(1),
            block_tables.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            partial_max.stride(0),
            partial_max.stride(1),
            partial_max.stride(2),
            HEAD_SIZE=head_size,
            KV_BLOCK_SIZE=attn_metadata.block_size,
            BLOCK_G=_next_power_of_two(group_size),
            BLOCK_N=self.decode_block_n,
            BLOCK_D=block_d,
            USE_SOFT_CAP=soft_cap is not None,
            USE_WINDOW=window is not None,
        )
        self._kernels.decode_reduce_kernel[(num_rows, num_q_heads)](
            output,
            partial_output,
            partial_max,
            partial_sum,
            attn_metadata.query_start_loc,
            plan.decode_seq_indices,
            num_splits,
            output.stride(0),
            output.stride(1),
            partial_max.stride(0),
            partial_max.stride(1),
            HEAD_SIZE=head_size,
            BLOCK_S=_next_power_of_two(num_splits),
            BLOCK_D=block_d,
        )

    def _step_plan(self, attn_metadata) -> _StepPlan:
        if self._planned_metadata is not attn_metadata:
            self._planned_metadata = attn_metadata
            self._plan = self._make_plan(attn_metadata)
        return self._plan

    def _make_plan(self, attn_metadata) -> _StepPlan:
        device = attn_metadata.seq_lens.device
        query_lens, seq_lens = attn_metadata.query_lens_cpu, attn_metadata.seq_lens_cpu
        decodes = [index for index, query_len in enumerate(query_lens) if query_len == 1]
        prefills = [index for index, query_len in enumerate(query_lens) if query_len > 1]

        def indices(seq_indices: list[int]) -> torch.Tensor | None:
            return torch.tensor(seq_indices, dtype=torch.int64, device=device) if seq_indices else None

        longest_prefill = max((query_lens[index] for index in prefills), default=0)
        return _StepPlan(
            decode_seq_indices=indices(decodes),
            prefill_seq_indices=indices(prefills),
            prefill_row_blocks=-(-longest_prefill // self.prefill_block_m),
            longest_decode=max((seq_lens[index] for index in decodes), default=0),
            num_splits={},
        )


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dimension densely; other strides may be anything."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
