"""A mixture-of-experts MLP: :class:`FusedMoE` (a router linear, top-k routing, every routed
expert's gated MLP as one stacked weight, :class:`FusedExperts`, and optionally a shared expert
every token passes through).

Routing (:func:`route`): per token the router's scores (softmax or sigmoid over the experts, in
float32), the ``top_k`` best, renormalised to sum to one or not, as the config says (Mixtral
always, Qwen3-MoE ``norm_topk_prob``). The experts' ``gate``/``up`` rows are stacked as ``w13
[E, 2 I, H]`` and ``down`` as ``w2 [E, H, I]``: on the CPU the operator ``moe_experts``
(csrc/cpu_moe.cpp, every kernel level) runs every expert a batch routes to in one parallel loop
over the (token, expert) rows sorted by expert; :func:`fused_experts_reference` is the torch
loop over experts the tests hold it to, and what runs with the kernels off.

A GGUF checkpoint's expert blocks stay in their own codes, each projection in its own kind, when
the quantization method keeps them (:meth:`QuantizationMethod.pack_expert_rows`: the ``gguf``
method in mode ``auto``, the kernels built, a bfloat16 model or a float32 one the platform
chose): 4-bit ones (Q4_0, Q4_1, Q4_K) packed as :mod:`tokenloom.kernels.int4_matmul` packs a
linear layer, 6-bit (Q6_K) and 5-bit ones (Q5_0, Q5_1, Q5_K) as :mod:`tokenloom.kernels.kquant_matmul`
does, so a Q4_K_M file's Q4_K gate and up and its Q6_K down all run natively with no dense copy.
A stacked tensor is packed a few experts at a time straight into ``w13_packed``/``w2_packed``
``[E, rows / 16, bytes]``; a stacked ``down`` tensor in one call whose output is ``w2_packed``
itself, with no copy. If any expert weight is of a type the kernels do not take (or gate and
up differ in kind), every expert of the layer is dense in the model dtype.

Checkpoint tensors reach :meth:`FusedExperts.load_checkpoint_weight` with a shard id
``(projection, expert)``: ``projection`` one of ``"gate"``, ``"up"``, ``"down"`` and ``expert``
an index, or None for a tensor stacking every expert (GGUF's ``ffn_*_exps``). A model maps its
checkpoint names onto them with :func:`expert_stacked_params`.

A shared expert (Qwen2-MoE, ``shared_expert_intermediate_size``) is a dense gated MLP
(``shared_expert``) added to the routed experts' sum, scaled per token by
``sigmoid(shared_expert_gate(x))`` when the model has that one-output gate.

Under tensor parallelism each rank holds every expert's slice of the intermediate features
(``I / tp`` gate and up rows, the same ``down`` columns), and the routed experts' output is
summed over the ranks with one all-reduce, as a row-parallel linear layer's is; the shared
expert splits its intermediate features the same way (a tensor-parallel gated MLP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.cpu_native import ops_for
from tokenloom.kernels.int4_matmul import Int4Weight
from tokenloom.kernels.kquant_matmul import KQuantWeight
from tokenloom.layers.activation import get_act_and_mul
from tokenloom.layers.decoder import GatedMLP
from tokenloom.layers.linear import divide, tensor_parallel_all_reduce, tp_place
from tokenloom.layers.quantization import QuantizationConfig, QuantizationMethod, materialize

SCORING_FUNCTIONS = ("softmax", "sigmoid")
PROJECTIONS = ("gate", "up", "down")
# a packed projection's layout for the moe_experts operator: (bits 4, 5 or 6, superblock groups of 32)
PackedKind = tuple[int, int]
# experts packed at a time: bounds the packers' temporaries (a few hundred MB for OLMoE's experts)
_EXPERTS_PER_PACK = 8
# Hugging Face ``hidden_act`` -> the activation name of the CPU operators' act_and_mul
_KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def route(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] float32, expert ids [T, top_k] int64)`` of each token's chosen experts."""
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ConfigError(f"unknown expert scoring function {scoring!r}; known: {', '.join(SCORING_FUNCTIONS)}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts_reference(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: nn.Module
) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(act(gate_up_e(x[t])))`` over each token's experts ``e = ids[t, j]``:
    a torch loop over the experts the batch routes to (dense ``w13 [E, 2I, H]``, ``w2 [E, H, I]``)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        hidden = act(F.linear(x[tokens], w13[expert]))
        rows = F.linear(hidden, w2[expert]).float() * weights[tokens, slots].unsqueeze(-1)
        out.index_add_(0, tokens, rows)
    return out.to(x.dtype)


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    ops,
    kinds: tuple[PackedKind | None, PackedKind | None] = (None, None),
) -> torch.Tensor:
    """What :func:`fused_experts_reference` computes, by the CPU operator ``moe_experts``: the
    ``(token, expert)`` pairs sorted by expert here, the rows gathered, every expert run and each
    token's rows summed with its routing weights in one call. ``w13``/``w2`` dense, or packed with
    their ``kinds`` (bits, superblock groups; see csrc/cpu_moe.cpp)."""
    flat_ids = ids.reshape(-1)
    sorted_slots = torch.argsort(flat_ids, stable=True)
    offsets = torch.zeros(w13.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat_ids, minlength=w13.shape[0]), 0, out=offsets[1:])
    (w13_bits, w13_groups), (w2_bits, w2_groups) = (kind or (4, 8) for kind in kinds)
    rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()  # the dtypes the operator reads
    out = ops.moe_experts(
        rows.contiguous(),
        weights.float().contiguous(),
        sorted_slots,
        offsets,
        w13,
        w2,
        activation,
        w13_bits,
        w2_bits,
        w13_groups,
        w2_groups,
    )
    return out.to(x.dtype)


def expert_stacked_params(
    module: str, num_experts: int, names: dict[str, str] | None = None
) -> tuple[tuple[str, str, Any], ...]:
    """The stacked-parameter rows (see :mod:`tokenloom.layers.weight_loading`) that bring a
    checkpoint's expert tensors to ``<module>.experts``: per expert ``experts.{e}.<name>`` (the
    Hugging Face layout), and ``experts.<projection>_exps`` stacking every expert (GGUF). ``names``
    maps each projection to its checkpoint name (default ``gate_proj``, ``up_proj``, ``down_proj``;
    Mixtral ``w1``, ``w3``, ``w2``). Put them before the dense ``gate_proj``/``up_proj`` rows."""
    names = names or {projection: f"{projection}_proj" for projection in PROJECTIONS}
    rows: list[tuple[str, str, Any]] = [
        (f"{module}.experts", f"{module}.experts.{projection}_exps", (projection, None)) for projection in PROJECTIONS
    ]
    for expert in range(num_experts):
        rows.extend(
            (f"{module}.experts", f"{module}.experts.{expert}.{names[projection]}", (projection, expert))
            for projection in PROJECTIONS
        )
    return tuple(rows)


def _as_stack(weight: Any) -> Any:
    """One expert's ``[N, K]`` checkpoint weight as a stack ``[1, N, K]`` (a packed GGUF weight
    stays packed)."""
    if not hasattr(weight, "narrow_rows"):
        return torch.as_tensor(weight).unsqueeze(0)
    stack = type(weight)(weight.data, weight.ggml_type, (1, *weight.shape))
    stack.name, stack.path = weight.name, weight.path
    return stack


def _packed_like(weight: Any, data: torch.Tensor, shape: tuple[int, ...]) -> Any:
    packed = type(weight)(data, weight.ggml_type, shape)
    packed.name, packed.path = weight.name, weight.path
    return packed


def _expert_rows(stack: Any, first: int, count: int) -> Any:
    """Experts ``first .. first+count`` of a stack ``[E, N, K]`` as rows ``[count N, K]`` (a view
    of a packed GGUF weight's bytes, still packed)."""
    experts, rows, columns = stack.shape
    if not hasattr(stack, "narrow_rows"):
        return torch.as_tensor(stack)[first : first + count].reshape(count * rows, columns)
    data = stack.data.view(experts, rows, -1)[first : first + count].reshape(count * rows, -1)
    return _packed_like(stack, data, (count * rows, columns))


def _narrow_stack(stack: Any, dim: int, start: int, size: int) -> Any:
    """Every expert's rows (``dim`` 0) or columns (1) ``start:start+size`` of a stack ``[E, N, K]``,
    a packed one in its packed form (a tensor-parallel rank's share)."""
    if not hasattr(stack, "narrow_rows"):
        return torch.as_tensor(stack).narrow(dim + 1, start, size)
    experts, rows, columns = stack.shape
    if dim == 0:
        data = stack.data.view(experts, rows, -1)[:, start : start + size].reshape(experts * size, -1)
        return _packed_like(stack, data, (experts, size, columns))
    flat = _packed_like(stack, stack.data.reshape(experts * rows, -1), (experts * rows, columns))
    return _packed_like(stack, flat.narrow_columns(start, size).data, (experts, rows, size))


def _packed_kind(weight: Int4Weight | KQuantWeight) -> PackedKind:
    """The moe_experts operator's (bits, superblock groups) for a packed weight."""
    return (weight.bits, weight.superblock_groups) if isinstance(weight, KQuantWeight) else (4, 8)


class FusedExperts(nn.Module):
    """Every routed expert's gated MLP, stacked: ``w13_weight [E, 2 I/tp, H]``, ``w2_weight [E, H, I/tp]``
    (or, for experts kept in their codes, ``w13_packed``/``w2_packed``; see the module docstring)."""

    #: the weight loader leaves the check for missing tensors to this module (a shard per expert)
    checks_own_weights = True

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        quant_method: QuantizationConfig | QuantizationMethod | None = None,
        params_dtype: torch.dtype | None = None,
        tp_group: Any = None,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp_place(tp_group, 0, 1)
        # a model's quantization config gives the experts their method by module name
        # (bind_quantization, called by the loader once the model is built), as it does a linear layer's
        self.quant_config = quant_method if isinstance(quant_method, QuantizationConfig) else None
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = divide(intermediate_size, self.tp_size, "expert intermediate size")
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_method if isinstance(quant_method, QuantizationMethod) else None
        self.act_fn = get_act_and_mul(hidden_act)
        self.kernel_activation = _KERNEL_ACTIVATIONS.get(hidden_act)
        size = self.intermediate_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * size, hidden_size, dtype=self.params_dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, size, dtype=self.params_dtype), requires_grad=False
        )
        # packed experts (see the module docstring): [E, rows / 16, bytes] uint8 and their kind
        self.w13_packed: torch.Tensor | None = None
        self.w2_packed: torch.Tensor | None = None
        self.w13_kind: PackedKind | None = None
        self.w2_kind: PackedKind | None = None
        self._loaded: set[tuple[str, int]] = set()
        # the checkpoint weights behind the packed experts (projection, first expert, their rows),
        # dequantized instead if some expert weight could not be packed alike; dropped once loaded
        self._packed_sources: list[tuple[str, int, Any]] = []
        self._any_dense = False

    # -- loading ---------------------------------------------------------------------

    def bind_quantization(self, prefix: str, shard_prefixes: tuple[str, ...]) -> None:
        """The method the model's quantization config gives the experts at ``prefix`` (None: dense)."""
        assert self.quant_config is not None, "bound only by the config the experts were built with"
        self.quant_method = self.quant_config.get_method(self, prefix, shard_prefixes)

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        if param_name != "weight" or not isinstance(shard_id, tuple) or shard_id[0] not in PROJECTIONS:
            raise ModelLoadError(
                f"{type(self).__name__} loads expert weights by (projection, expert), not {shard_id!r}"
            )
        projection, expert = shard_id
        full = (self.intermediate_size * self.tp_size, self.hidden_size)
        expected = full if projection != "down" else full[::-1]
        if expert is None:
            if tuple(loaded_weight.shape[:1]) != (self.num_experts,):
                raise ModelLoadError(
                    f"a stacked {projection} tensor of shape {tuple(loaded_weight.shape)} does not hold "
                    f"{self.num_experts} experts"
                )
            if tuple(loaded_weight.shape[1:]) != expected:
                raise ModelLoadError(
                    f"the stacked {projection} tensor holds experts of shape {tuple(loaded_weight.shape[1:])}, "
                    f"the model expects {expected}"
                )
            first, stack = 0, loaded_weight
        else:
            if not 0 <= expert < self.num_experts:
                raise ModelLoadError(f"expert {expert} is outside the model's {self.num_experts} experts")
            if tuple(loaded_weight.shape) != expected:
                raise ModelLoadError(
                    f"expert {expert}'s {projection} weight has shape {tuple(loaded_weight.shape)}, "
                    f"the model expects {expected}"
                )
            first, stack = expert, _as_stack(loaded_weight)
        if self.tp_size > 1:  # this rank's intermediate features: rows of gate/up, columns of down
            size = self.intermediate_size
            stack = _narrow_stack(stack, 1 if projection == "down" else 0, self.tp_rank * size, size)
        count = stack.shape[0]
        if not self._pack_whole_down_stack(projection, first, count, stack):
            for start in range(0, count, _EXPERTS_PER_PACK):
                chunk = min(_EXPERTS_PER_PACK, count - start)
                self._load_rows(projection, first + start, chunk, _expert_rows(stack, start, chunk))
        self._loaded.update((projection, index) for index in range(first, first + count))
        # a memory-mapped checkpoint tensor (a GGUF file's) is packed or copied now: its file pages
        # leave the process (read back from the file, unchanged, should a dense fallback need them)
        release = getattr(loaded_weight, "release", None)
        if release is not None:
            release()

    def _pack_whole_down_stack(self, projection: str, first: int, count: int, stack: Any) -> bool:
        """Every expert's ``down`` weight (a GGUF file's stacked ``ffn_down_exps``) packed in one
        call whose output becomes ``w2_packed`` as it is, with no copy into a stack: packed in
        chunks, the copies' first touch of the stack was about as long as the packing (the
        method bounds its own packers' temporaries). Each expert's rows are a multiple of 32, so
        its 16-row blocks pair within it and the bytes are the per-chunk packing's. False (a
        method that does not pack these rows): load it in chunks."""
        if (
            projection != "down"
            or (first, count) != (0, self.num_experts)
            or self.w2_packed is not None
            or not hasattr(stack, "narrow_rows")  # a file's packed blocks (a dense tensor is copied in chunks)
            or self.quant_method is None
            or self.kernel_activation is None
            or self.hidden_size % 32 != 0
        ):
            return False
        rows = _expert_rows(stack, 0, count)
        packed = self.quant_method.pack_expert_rows(rows, self.params_dtype)
        if packed is None:
            return False
        self.w2_packed = packed.packed.view(count, self.hidden_size // 16, -1)
        self.w2_kind = _packed_kind(packed)
        self._packed_sources.append((projection, first, rows))
        return True

    def _load_rows(self, projection: str, first: int, count: int, rows: Any) -> None:
        """Experts ``first .. first+count``'s ``projection`` weights, ``rows [count N, K]``: packed
        into the stacked kernel weight when the quantization method keeps them in their codes
        (and the operator can take them), else dense."""
        packed = None
        per_expert = rows.shape[0] // count
        if self.quant_method is not None and self.kernel_activation is not None and per_expert % 32 == 0:
            packed = self.quant_method.pack_expert_rows(rows, self.params_dtype)
        if packed is not None and self._store_packed(projection, first, count, packed):
            self._packed_sources.append((projection, first, rows))
            return
        self._any_dense = True
        self._copy_dense(projection, first, materialize(rows, self.params_dtype).view(count, per_expert, -1))

    def _store_packed(self, projection: str, first: int, count: int, packed: Int4Weight | KQuantWeight) -> bool:
        """``packed`` (experts ``first .. first+count``, blocks of 16 rows) written into the
        projection's stacked weight (gate then up in ``w13_packed``); False when its kind or
        bytes differ from what that stack already holds."""
        kind, blocks = _packed_kind(packed), packed.packed.view(count, -1, packed.packed.shape[-1])
        name = "w2" if projection == "down" else "w13"
        stacked = getattr(self, f"{name}_packed")
        if stacked is None:
            rows = self.hidden_size if projection == "down" else 2 * self.intermediate_size
            stacked = torch.empty(self.num_experts, rows // 16, blocks.shape[-1], dtype=torch.uint8)
            setattr(self, f"{name}_packed", stacked)
            setattr(self, f"{name}_kind", kind)
        elif getattr(self, f"{name}_kind") != kind or stacked.shape[-1] != blocks.shape[-1]:
            return False
        offset = self.intermediate_size // 16 if projection == "up" else 0
        stacked[first : first + count, offset : offset + blocks.shape[1]].copy_(blocks)
        return True

    def _copy_dense(self, projection: str, first: int, dense: torch.Tensor) -> None:
        experts = slice(first, first + dense.shape[0])
        if projection == "down":
            self.w2_weight.data[experts].copy_(dense)
        else:
            offset = 0 if projection == "gate" else self.intermediate_size
            self.w13_weight.data[experts, offset : offset + self.intermediate_size].copy_(dense)

    def process_weights_after_loading(self) -> None:
        missing = [
            f"expert {expert} {projection}"
            for expert in range(self.num_experts)
            for projection in PROJECTIONS
            if (projection, expert) not in self._loaded
        ]
        if missing:
            raise ModelLoadError(
                f"the checkpoint lacks {len(missing)} expert weight(s) the model needs: {', '.join(missing[:10])}"
            )
        sources, self._packed_sources = self._packed_sources, []
        if not sources:
            return
        if not self._any_dense:  # every expert packed: no dense copy (the shape and dtype stay)
            for name in ("w13_weight", "w2_weight"):
                shape = getattr(self, name).shape
                setattr(self, name, nn.Parameter(torch.empty(shape, dtype=self.params_dtype, device="meta"), False))
            return
        # some expert weights the kernels do not take (another type, a shape, gate and up of two
        # kinds): every expert dense, for one path
        self.w13_packed = self.w2_packed = self.w13_kind = self.w2_kind = None
        for projection, first, rows in sources:
            dense = materialize(rows, self.params_dtype)
            self._copy_dense(projection, first, dense.view(-1, *self._dense_shape(projection)))

    def _dense_shape(self, projection: str) -> tuple[int, int]:
        size = (self.intermediate_size, self.hidden_size)
        return size[::-1] if projection == "down" else size

    # -- forward -----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's routed experts summed with its routing weights (this rank's share under
        tensor parallelism), in ``x``'s dtype."""
        activation = self.kernel_activation
        ops = ops_for(x) if activation is not None else None
        if self.w13_packed is not None and self.w2_packed is not None and activation is not None:
            kinds = (self.w13_kind, self.w2_kind)
            return fused_experts(x, weights, ids, self.w13_packed, self.w2_packed, activation, ops, kinds)
        if ops is not None and activation is not None and self.w13_weight.dtype in (torch.float32, torch.bfloat16):
            return fused_experts(x, weights, ids, self.w13_weight, self.w2_weight, activation, ops)
        return fused_experts_reference(x, weights, ids, self.w13_weight, self.w2_weight, self.act_fn)

    def extra_repr(self) -> str:
        if self.w13_kind is not None and self.w2_kind is not None:
            kind = f"int{self.w13_kind[0]}+int{self.w2_kind[0]}"
        else:
            kind = str(self.w13_weight.dtype).removeprefix("torch.")
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"weights={kind}, tp={self.tp_rank}/{self.tp_size}"
        )


class RouterLinear(nn.Module):
    """``x @ weight.T`` with a plain dense ``weight [out, H]`` (the router, ``out`` experts):
    replicated on every tensor-parallel rank, never quantized, and never packed for oneDNN, whose
    matmul took ~12 ms for one row of OLMoE's [64, 2048] router on the loaded 2-core machine (0.03 ms
    with torch's own). A checkpoint tensor of the same number of values loads in this shape (a
    llama.cpp file may hold a one-row weight as a vector)."""

    def __init__(self, hidden_size: int, out_features: int, *, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, hidden_size, dtype=params_dtype or torch.get_default_dtype()),
            requires_grad=False,
        )

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        tensor = materialize(loaded_weight, self.weight.dtype)
        if param_name != "weight" or tensor.numel() != self.weight.numel() or tensor.dim() > 2:
            vector = f" or ({self.weight.shape[1]},)" if self.weight.shape[0] == 1 else ""
            raise ModelLoadError(
                f"{type(self).__name__} expects 'weight' of shape {tuple(self.weight.shape)}{vector}, got "
                f"{param_name!r} of shape {tuple(tensor.shape)}"
            )
        self.weight.data.copy_(tensor.reshape(self.weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedExpertGate(RouterLinear):
    """``sigmoid(x @ weight.T)``: one scale per token for the shared expert's output, ``weight
    [1, H]`` (a Hugging Face checkpoint's shape; llama.cpp's ``ffn_gate_inp_shexp`` may hold it as
    a vector of ``H``)."""

    def __init__(self, hidden_size: int, *, params_dtype: torch.dtype | None = None):
        super().__init__(hidden_size, 1, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class FusedMoE(nn.Module):
    """A router (``gate``, a :class:`RouterLinear`) over ``experts``, and with
    ``shared_expert_intermediate_size`` a ``shared_expert`` (gated by ``shared_expert_gate``
    when ``shared_expert_gate``); see the module docstring."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        renormalize: bool,
        scoring: str = "softmax",
        shared_expert_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        quant_method: QuantizationConfig | QuantizationMethod | None = None,
        params_dtype: torch.dtype | None = None,
        tp_group: Any = None,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ConfigError(
                f"experts per token ({top_k}) must be between 1 and the number of experts ({num_experts})"
            )
        if scoring not in SCORING_FUNCTIONS:
            raise ConfigError(f"unknown expert scoring function {scoring!r}; known: {', '.join(SCORING_FUNCTIONS)}")
        self.top_k, self.renormalize, self.scoring = top_k, renormalize, scoring
        self.tp_group = tp_group
        self.tp_size = tp_place(tp_group, 0, 1)[1]
        self.gate = RouterLinear(hidden_size, num_experts, params_dtype=params_dtype)
        self.experts = FusedExperts(
            num_experts,
            hidden_size,
            intermediate_size,
            hidden_act,
            quant_method=quant_method,
            params_dtype=params_dtype,
            tp_group=tp_group,
        )
        if shared_expert_gate and not shared_expert_intermediate_size:
            raise ConfigError("a shared expert gate needs a shared expert (shared_expert_intermediate_size > 0)")
        self.shared_expert = (
            GatedMLP(
                hidden_size,
                shared_expert_intermediate_size,
                hidden_act,
                quant_method=quant_method,
                params_dtype=params_dtype,
                tp_group=tp_group,
            )
            if shared_expert_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            SharedExpertGate(hidden_size, params_dtype=params_dtype) if shared_expert_gate else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(hidden_states), self.top_k, renormalize=self.renormalize, scoring=self.scoring)
        out = tensor_parallel_all_reduce(self.experts(hidden_states, weights, ids), self.tp_group, self.tp_size)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(hidden_states)  # summed over the ranks by its down projection
        if self.shared_expert_gate is not None:
            shared = self.shared_expert_gate(hidden_states) * shared
        return out + shared

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}, scoring={self.scoring!r}"
