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

A GGUF checkpoint's 4-bit expert blocks (Q4_0, Q4_1, Q4_K) are kept as 4-bit, each expert
packed as :mod:`tokenloom.kernels.int4_matmul` packs a linear layer, when that layer's kernel
would take them (the ``gguf`` method in mode ``auto``, the kernels built, a bfloat16 model or a
float32 one the platform chose); every other expert weight is dense in the model dtype.

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
from tokenloom.kernels.int4_matmul import NATIVE_GROUP_SIZE, can_pack, dequantize_int4, pack_int4
from tokenloom.layers.activation import get_act_and_mul
from tokenloom.layers.decoder import GatedMLP
from tokenloom.layers.linear import ReplicatedLinear, divide, tensor_parallel_all_reduce, tp_place
from tokenloom.layers.quantization import QuantizationConfig, QuantizationMethod, materialize

SCORING_FUNCTIONS = ("softmax", "sigmoid")
PROJECTIONS = ("gate", "up", "down")
# one weight's 4-bit (codes, scales, zeros), see tokenloom.kernels.int4_matmul
Int4Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
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
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str, ops
) -> torch.Tensor:
    """What :func:`fused_experts_reference` computes, by the CPU operator ``moe_experts``: the
    ``(token, expert)`` rows sorted by expert, every expert in one call, each token's rows summed
    with its routing weights. ``w13``/``w2`` dense or packed 4-bit (see csrc/cpu_moe.cpp)."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    offsets = torch.zeros(w13.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(flat_ids, minlength=w13.shape[0]), 0, out=offsets[1:])
    rows = x.float().index_select(0, order // top_k)
    sorted_out = ops.moe_experts(rows, offsets, w13, w2, activation)
    out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    return torch.bmm(weights.unsqueeze(1), out.view(num_tokens, top_k, -1)).squeeze(1).to(x.dtype)


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


def _expert_slice(weight: Any, expert: int) -> Any:
    """Expert ``expert``'s ``[N, K]`` of a stacked ``[E, N, K]`` checkpoint tensor (a packed GGUF
    tensor stays packed)."""
    if isinstance(weight, torch.Tensor) or not hasattr(weight, "narrow_rows"):
        return torch.as_tensor(weight)[expert]
    experts, rows = weight.shape[0], weight.shape[1]
    packed = type(weight)(weight.data.view(experts, rows, -1)[expert], weight.ggml_type, weight.shape[1:])
    packed.name, packed.path = weight.name, weight.path
    return packed


def _narrow(weight: Any, dim: int, start: int, size: int) -> Any:
    """Rows (``dim`` 0) or columns (1) ``start:start+size`` of a checkpoint weight, a packed one in
    its packed form."""
    if hasattr(weight, "narrow_rows"):
        return weight.narrow_rows(start, size) if dim == 0 else weight.narrow_columns(start, size)
    return torch.as_tensor(weight).narrow(dim, start, size)


class FusedExperts(nn.Module):
    """Every routed expert's gated MLP, stacked: ``w13_weight [E, 2 I/tp, H]``, ``w2_weight [E, H, I/tp]``
    (or, for 4-bit experts, ``w13_packed``/``w2_packed``; see the module docstring)."""

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
        self.w13_packed: torch.Tensor | None = None
        self.w2_packed: torch.Tensor | None = None
        self._loaded: set[tuple[str, int]] = set()
        # 4-bit checkpoint weights the quantization method keeps 4-bit, packed once all are loaded
        self._int4_groups: dict[tuple[str, int], Int4Groups] = {}

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
        experts = range(self.num_experts) if expert is None else [expert]
        if expert is None and tuple(loaded_weight.shape[:1]) != (self.num_experts,):
            raise ModelLoadError(
                f"a stacked {projection} tensor of shape {tuple(loaded_weight.shape)} does not hold "
                f"{self.num_experts} experts"
            )
        for index in experts:
            if not 0 <= index < self.num_experts:
                raise ModelLoadError(f"expert {index} is outside the model's {self.num_experts} experts")
            one = _expert_slice(loaded_weight, index) if expert is None else loaded_weight
            self._load_one(projection, index, one)
            self._loaded.add((projection, index))

    def _load_one(self, projection: str, expert: int, weight: Any) -> None:
        size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        full = (self.intermediate_size * self.tp_size, self.hidden_size)
        expected = full if projection != "down" else full[::-1]
        if tuple(weight.shape) != expected:
            raise ModelLoadError(
                f"expert {expert}'s {projection} weight has shape {tuple(weight.shape)}, the model expects {expected}"
            )
        if self.tp_size > 1:  # this rank's intermediate features: rows of gate/up, columns of down
            if projection == "down":
                weight = _narrow(weight, 1, start, size)
            else:
                weight = _narrow(weight, 0, start, size)
        groups = self.quant_method.int4_groups(weight, self.params_dtype) if self.quant_method is not None else None
        if groups is not None:
            self._int4_groups[(projection, expert)] = groups
        else:
            self._copy_dense(projection, expert, materialize(weight, self.params_dtype))

    def _copy_dense(self, projection: str, expert: int, dense: torch.Tensor) -> None:
        if projection == "down":
            self.w2_weight.data[expert].copy_(dense)
        else:
            offset = 0 if projection == "gate" else self.intermediate_size
            self.w13_weight.data[expert, offset : offset + self.intermediate_size].copy_(dense)

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
        groups, self._int4_groups = self._int4_groups, {}
        if not groups:
            return
        whole = len(groups) == 3 * self.num_experts and self.kernel_activation is not None
        packed = self._pack_int4(groups) if whole else None
        if packed is not None:
            self.w13_packed, self.w2_packed = packed
            for name in ("w13_weight", "w2_weight"):  # no dense copy: the shape and dtype stay
                shape = getattr(self, name).shape
                setattr(self, name, nn.Parameter(torch.empty(shape, dtype=self.params_dtype, device="meta"), False))
            return
        # some experts of another type, a shape the kernel's layout refuses, or no kernel: dense
        for (projection, expert), (codes, scales, zeros) in groups.items():
            self._copy_dense(projection, expert, dequantize_int4(codes, scales, zeros).to(self.params_dtype))

    def _pack_int4(self, groups: dict[tuple[str, int], Int4Groups]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every expert's gate+up and down packed for tokenloom's int4_linear kernel and stacked, or
        None when the kernel is not built or a shape does not fit its layout."""
        w13, w2 = [], []
        for expert in range(self.num_experts):
            gate, up, down = (groups[(projection, expert)] for projection in PROJECTIONS)
            gate_up = (torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]]), torch.cat([gate[2], up[2]]))
            packed = []
            for codes, scales, zeros in (gate_up, down):
                rows, columns = codes.shape
                if scales.shape[1] * NATIVE_GROUP_SIZE != columns or not can_pack(rows, columns, NATIVE_GROUP_SIZE):
                    return None
                packed.append(pack_int4(codes, scales, zeros, torch.bfloat16))
            if any(weight.kernel is None for weight in packed):
                return None
            w13.append(packed[0].packed)
            w2.append(packed[1].packed)
        return torch.stack(w13), torch.stack(w2)

    # -- forward -----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's routed experts summed with its routing weights (this rank's share under
        tensor parallelism), in ``x``'s dtype."""
        activation = self.kernel_activation
        ops = ops_for(x) if activation is not None else None
        if self.w13_packed is not None and self.w2_packed is not None and activation is not None:
            return fused_experts(x, weights, ids, self.w13_packed, self.w2_packed, activation, ops)
        if ops is not None and activation is not None and self.w13_weight.dtype in (torch.float32, torch.bfloat16):
            return fused_experts(x, weights, ids, self.w13_weight, self.w2_weight, activation, ops)
        return fused_experts_reference(x, weights, ids, self.w13_weight, self.w2_weight, self.act_fn)

    def extra_repr(self) -> str:
        kind = "int4" if self.w13_packed is not None else str(self.w13_weight.dtype).removeprefix("torch.")
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"weights={kind}, tp={self.tp_rank}/{self.tp_size}"
        )


class SharedExpertGate(nn.Module):
    """``sigmoid(x @ weight.T)``: one scale per token for the shared expert's output, ``weight
    [1, H]`` (a Hugging Face checkpoint's shape; llama.cpp's ``ffn_gate_inp_shexp`` may hold it as
    a vector of ``H``). Replicated on every tensor-parallel rank, never quantized."""

    def __init__(self, hidden_size: int, *, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(1, hidden_size, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False
        )

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        tensor = materialize(loaded_weight, self.weight.dtype)
        if param_name != "weight" or tensor.numel() != self.weight.numel() or tensor.dim() > 2:
            raise ModelLoadError(
                f"{type(self).__name__} expects 'weight' of shape {tuple(self.weight.shape)} or "
                f"({self.weight.shape[1]},), got {param_name!r} of shape {tuple(tensor.shape)}"
            )
        self.weight.data.copy_(tensor.reshape(self.weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class FusedMoE(nn.Module):
    """A router (``gate``, never quantized) over ``experts``, and with
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
        self.gate = ReplicatedLinear(hidden_size, num_experts, params_dtype=params_dtype)
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
