"""One operator for a whole decoder layer in a decode step on the CPU.

A pre-norm layer of the Llama family (:class:`~tokenloom.layers.layernorm.RMSNorm`,
:class:`~tokenloom.layers.decoder.SelfAttention` with rotary embedding, :class:`GatedMLP` with
SwiGLU) whose four projections hold the file's codes packed for tokenloom's kernels (what the
``gguf`` quantization method keeps: ``layer.int4_weight``, or ``layer.native_segments``, runs of
rows each on its own kernel, int2, int3, int4, int5, int6 or int8, as a Q4_K_M file mixes Q4_K and Q6_K
projections) runs a decode step as
``decode_layer`` (tokenloom's CPU operators, every kernel level): the operators the Python path
calls, chained in C++, giving the same bits without a dozen module calls and two dozen torch
calls per layer; in bfloat16, or float32 (what a CPU without native bfloat16 runs). A step of
speculative decoding's verifications (a request's pending token and its drafts, which the native
attention backend's plan turns into one decode row each) is taken too. Anything
else (prefill rows in the step, other dtypes, biases, q/k norms, sliding windows, soft caps,
tensor parallelism, another attention backend) takes the layer's own Python path. A step whose
adapters change the layer's projections runs ``decode_layer_lora``: the same chain (one body in
kernels/csrc/cpu_decoder.cpp) with each projection's BGMV added after its matmul, the operator the
Python path's LoRA layers call.
An fp8 KV cache goes through the operator with the layer's scales, once they are set.

:class:`FusedDecodeStack` goes one further for a model (or pipeline stage) whose every layer is
such a layer and whose caches hold the activations' dtype, with no LoRA: a decode step runs all
its layers in one ``decode_layers`` call (the same chain, layer after layer, so the same bits),
with no Python between them. A step it declines runs the layers one by one as above.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import Int4Weight
from tokenloom.kernels.int8_matmul import Int8Weight
from tokenloom.kernels.kquant_matmul import KQuantWeight
from tokenloom.kernels.lowbit_matmul import LowbitWeight
from tokenloom.kernels.paged_attention import NativeCpuPagedAttention, is_fp8_kv_cache
from tokenloom.layers.activation import SiluAndMul
from tokenloom.layers.layernorm import RMSNorm
from tokenloom.layers.rotary import RotaryEmbedding

_UNCHECKED = object()
# the dtypes the operator runs a layer in (the norms', rotary tables', activations' and KV cache's)
_DTYPES = (torch.bfloat16, torch.float32)


class FusedDecodeLayer:
    """Built in the layer's constructor; the weights are checked on the first call (they are
    packed only after loading). ``__call__`` returns the layer's ``(output, residual)``, or None
    when this step or this layer is not one the operator takes."""

    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp):
        self.modules = (input_layernorm, self_attn, post_attention_layernorm, mlp)
        self.projections = (self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self._arguments: Any = _UNCHECKED  # the operator and its per-layer arguments, or None

    def __call__(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, attn_metadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        lora_arguments = self._lora_arguments(hidden_states)
        if lora_arguments is False:
            return None  # an adapter's delta the operator cannot add: the layer's Python path adds it
        if self._arguments is _UNCHECKED:
            self._arguments = self._check_layer(hidden_states)
        if (
            self._arguments is None
            or hidden_states.dtype != self._arguments[1].dtype
            or hidden_states.dim() != 2
            or attn_metadata.bidirectional
        ):
            return None
        backend = attn_metadata.backend
        decode = backend.whole_decode_plan(attn_metadata) if isinstance(backend, NativeCpuPagedAttention) else None
        if decode is None or positions.dtype != torch.long or not attn_metadata.kv_caches:
            return None
        (
            operator,
            input_norm,
            post_norm,
            eps,
            (weights, kinds, segments),
            cos_cache,
            sin_cache,
            layer_index,
            heads,
            kv_heads,
            scale,
        ) = self._arguments
        kv_cache = attn_metadata.kv_caches[layer_index]
        if kv_cache is None:
            return None
        k_scale = v_scale = 1.0
        if is_fp8_kv_cache(kv_cache):
            scales = attn_metadata.kv_scales[layer_index] if attn_metadata.kv_scales else None
            if scales is not None:
                if scales.pending:  # --calculate-kv-scales: the Python path sets them first
                    return None
                k_scale, v_scale = scales.k_scale, scales.v_scale
        elif kv_cache.dtype != hidden_states.dtype:
            return None
        if lora_arguments is not None:
            operator = lora_arguments[0]
        return operator(
            hidden_states,
            residual,
            positions,
            input_norm,
            post_norm,
            eps,
            weights,
            kinds,
            segments,
            cos_cache,
            sin_cache,
            kv_cache,
            attn_metadata.slot_mapping,
            decode.block_tables,
            decode.seq_lens,
            heads,
            kv_heads,
            scale,
            k_scale,
            v_scale,
            *(lora_arguments[1:] if lora_arguments is not None else ()),
        )

    def _lora_arguments(self, hidden_states: torch.Tensor) -> tuple | None | bool:
        """None when no adapter of this step changes the layer; the LoRA operator and its extra
        arguments (each token's slot, each projection's stacks or None, the stacks' rank) when
        adapters do; False when they do but the operator cannot add their deltas."""
        loras = [projection.lora for projection in self.projections]
        applying = [lora is not None and lora.applies() for lora in loras]
        if not any(applying):
            return None
        ops = cpu_native.ops_for(hidden_states)
        operator = getattr(ops, "decode_layer_lora", None) if ops is not None else None
        if operator is None:
            return False
        stacks: list[torch.Tensor | None] = []
        for lora, applies in zip(loras, applying):
            stacks.extend((lora.lora_a, lora.lora_b_t, lora.shard_table) if applies else (None, None, None))
        state = next(lora for lora, applies in zip(loras, applying) if applies).state
        if state.num_tokens != hidden_states.shape[0]:
            return False
        return operator, state.token_slots, stacks, state.max_rank

    def _check_layer(self, hidden_states: torch.Tensor) -> tuple | None:
        """The operator's per-layer arguments when the layer is one it computes exactly."""
        input_layernorm, self_attn, post_attention_layernorm, mlp = self.modules
        ops = cpu_native.ops_for(hidden_states)
        operator = getattr(ops, "decode_layer", None) if ops is not None else None
        norms = (input_layernorm, post_attention_layernorm)
        projections = (self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [packed_weights(projection) for projection in projections]
        attention, rotary = self_attn.attn, self_attn.rotary_emb
        if (
            operator is None
            or input_layernorm.weight.dtype not in _DTYPES
            or any(
                type(norm) is not RMSNorm
                or norm.weight.dtype != input_layernorm.weight.dtype
                or norm.eps != input_layernorm.eps
                for norm in norms
            )
            or any(weights is None for weights in packed)
            or any(projection.bias is not None or projection.tp_size != 1 for projection in projections)
            or getattr(self_attn, "q_norm", None) is not None
            or type(rotary) is not RotaryEmbedding
            or rotary.cos_cache.dtype != input_layernorm.weight.dtype
            or attention.sliding_window
            or attention.logits_soft_cap
            or type(mlp.act_fn) is not SiluAndMul
        ):
            return None
        runs = [run for weights in packed for run in weights]
        return (
            operator,
            input_layernorm.weight,
            post_attention_layernorm.weight,
            input_layernorm.eps,
            ([tensor for tensor, _ in runs], [kind for _, kind in runs], [len(weights) for weights in packed]),
            rotary.cos_cache,
            rotary.sin_cache,
            attention.layer_index,
            self_attn.num_heads,
            self_attn.num_kv_heads,
            attention.scale,
        )


class FusedDecodeStack:
    """All of a model's (or stage's) decoder layers in one ``decode_layers`` call; built by
    :meth:`of` when every layer offers its :class:`FusedDecodeLayer` (``stacked_decode``), checked
    on the first call. ``__call__`` returns the last layer's ``(output, residual)``, or None when
    this step or some layer is not one the operator takes (the caller then runs the layers)."""

    def __init__(self, layers: list[FusedDecodeLayer]):
        self.layers = tuple(layers)
        self._arguments: Any = _UNCHECKED

    @classmethod
    def of(cls, layers) -> FusedDecodeStack | None:
        """The stack of these layers, or None when one of them does not offer its fused decode
        (a layer class whose ``forward`` does more than choose between it and the Python path)."""
        fused = []
        for layer in layers:
            stacked_decode = getattr(layer, "stacked_decode", None)
            layer_fused = stacked_decode() if stacked_decode is not None else None
            if not isinstance(layer_fused, FusedDecodeLayer):
                return None
            fused.append(layer_fused)
        return cls(fused) if fused else None

    def __call__(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, attn_metadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._arguments is _UNCHECKED:
            self._arguments = self._check_stack(hidden_states)
        arguments = self._arguments
        if (
            arguments is None
            or hidden_states.dtype != arguments[1]
            or hidden_states.dim() != 2
            or positions.dim() != 1
            or positions.dtype != torch.long
            or attn_metadata.bidirectional
        ):
            return None
        backend = attn_metadata.backend
        decode = backend.whole_decode_plan(attn_metadata) if isinstance(backend, NativeCpuPagedAttention) else None
        caches = attn_metadata.kv_caches
        if decode is None or not caches:
            return None
        operator, dtype, layer_tables, indices, shape = arguments
        kv_caches = [caches[index] for index in indices]
        for cache in kv_caches:
            if cache is None or cache.dtype != dtype:  # an fp8 cache: its layer's scales
                return None
        step = (attn_metadata.slot_mapping, decode.block_tables, decode.seq_lens)
        return operator(hidden_states, residual, positions, *layer_tables, kv_caches, *step, *shape)

    def _check_stack(self, hidden_states: torch.Tensor) -> tuple | None:
        """``decode_layers`` and its arguments, when every layer is one ``decode_layer`` computes,
        none has LoRA layers, and all share the norms' eps, the heads and the scale."""
        ops = cpu_native.ops_for(hidden_states)
        operator = getattr(ops, "decode_layers", None) if ops is not None else None
        if operator is None:
            return None
        per_layer = []
        for layer in self.layers:
            if layer._arguments is _UNCHECKED:
                layer._arguments = layer._check_layer(hidden_states)
            if layer._arguments is None or any(projection.lora is not None for projection in layer.projections):
                return None
            per_layer.append(layer._arguments)
        shared = [(arguments[3], *arguments[8:]) for arguments in per_layer]
        if any(entry != shared[0] for entry in shared):
            return None
        eps, heads, kv_heads, scale = shared[0]
        # (the operator's arguments in its order: the layers' norms, eps, packed weights and
        # rotary tables; then the step's KV caches and tensors; then the heads and the scale)
        layer_tables = (
            [arguments[1] for arguments in per_layer],
            [arguments[2] for arguments in per_layer],
            eps,
            [tensor for arguments in per_layer for tensor in arguments[4][0]],
            [kind for arguments in per_layer for kind in arguments[4][1]],
            [count for arguments in per_layer for count in arguments[4][2]],
            [arguments[5] for arguments in per_layer],
            [arguments[6] for arguments in per_layer],
        )
        indices = [arguments[7] for arguments in per_layer]
        return operator, per_layer[0][1].dtype, layer_tables, indices, (heads, kv_heads, scale)


def packed_weights(projection) -> list[tuple[torch.Tensor, int]] | None:
    """A projection's packed weights in row order, each with its kernel's kind as the operator
    reads it (``100 * bits`` plus a 5-bit layout's superblock groups); None when a run of its rows
    is on no kernel the operator chains (a dense weight, torch's int4 kernel)."""
    int4_weight = getattr(projection, "int4_weight", None)
    segments = [int4_weight] if int4_weight is not None else getattr(projection, "native_segments", None)
    if not segments:
        return None
    packed = []
    for weight in segments:
        if isinstance(weight, Int4Weight) and weight.kernel is not None:
            packed.append((weight.packed, 400))
        elif isinstance(weight, Int8Weight):
            packed.append((weight.packed, 800))
        elif isinstance(weight, KQuantWeight):
            packed.append((weight.packed, 100 * weight.bits + (weight.superblock_groups if weight.bits == 5 else 0)))
        elif isinstance(weight, LowbitWeight):
            packed.append((weight.packed, 100 * weight.bits))
        else:
            return None
    return packed
