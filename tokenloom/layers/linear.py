"""Linear layers that carry a quantization method and know their tensor-parallel shard:
replicated, column- and row-parallel, and the fused QKV and gate/up projections that load
several checkpoint tensors into row ranges of one weight.

Each layer's weight is created and multiplied by its ``quant_method``. A layer built with the
model's :class:`~tokenloom.layers.quantization.QuantizationConfig` instead of a method gets its
method once the model is built (:meth:`LinearBase.bind_quantization`, which the config calls with
the layer's module name), so the config decides per layer. Checkpoint tensors go through
:meth:`LinearBase.load_checkpoint_weight`, which cuts this rank's slice: ``weight`` goes to
``quant_method.load_weight`` (a dense tensor is narrowed, a packed GGUF tensor is cut in its
packed form: whole rows for a column split, whole quantization blocks of every row for a row
split, so no rank dequantizes more than its own slice); every other parameter a method created
is cut and placed by its :class:`~tokenloom.layers.quantization.ParameterLayout`.

Under tensor parallelism a layer is given its group's communicator (``tp_group``: the model
passes ``ctx.parallel.tp``, a :class:`tokenloom.core.distributed.Communicator`; layers take it
as an argument rather than importing core), and takes its rank and size from it. Column-parallel
layers need no communication; a row-parallel layer sums its partial products with one
all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.quantization import (
    ParameterLayout,
    QuantizationConfig,
    QuantizationMethod,
    UnquantizedMethod,
    materialize,
    parameter_layout,
)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising when it does not divide evenly."""
    if numerator % denominator:
        raise ConfigError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}): "
            "choose a --tensor-parallel-size that divides it",
            param="tensor_parallel_size",
        )
    return numerator // denominator


def tp_place(tp_group: Any, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(rank, size)`` of a layer: its communicator's when it has one, else the arguments."""
    if tp_group is None:
        return tp_rank, tp_size
    return tp_group.rank, tp_group.size


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """``(KV heads each rank holds, ranks holding each KV head)``. With at least as many ranks
    as KV heads each rank holds one, replicated on ``tp_size / total_num_kv_heads`` ranks (the
    ranks whose query heads read it); otherwise the KV heads are split evenly."""
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ConfigError(
                f"the number of KV heads ({total_num_kv_heads}) does not divide the tensor-parallel size "
                f"({tp_size}): each KV head is replicated on an equal number of ranks; choose a "
                "--tensor-parallel-size that is a multiple or a divisor of it",
                param="tensor_parallel_size",
            )
        return 1, tp_size // total_num_kv_heads
    return divide(total_num_kv_heads, tp_size, "number of KV heads"), 1


def tensor_parallel_all_reduce(tensor: torch.Tensor, tp_group: Any, tp_size: int) -> torch.Tensor:
    """Sum partial results across tensor-parallel ranks (identity for one rank)."""
    if tp_size == 1:
        return tensor
    if tp_group is None:
        raise RuntimeError(
            f"a layer split over {tp_size} tensor-parallel ranks was built without a communicator (tp_group)"
        )
    summed: torch.Tensor = tp_group.all_reduce(tensor)
    return summed


def _is_packed(loaded_weight: Any) -> bool:
    return hasattr(loaded_weight, "dequantize") and not isinstance(loaded_weight, torch.Tensor)


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with ``W`` owned by ``quant_method``.

    :param input_size: logical input features of this rank's weight.
    :param output_size: logical output features of this rank's weight.
    :param quant_method: this layer's method, or the model's QuantizationConfig (the method is
        then chosen by the layer's module name in :meth:`bind_quantization`; until then the
        layer has no weight), or None for dense weights.
    """

    #: shard ids a fused layer loads (``None``: one unfused checkpoint tensor)
    shard_ids: tuple[Any, ...] = (None,)
    #: the LoRA path beside the base matmul (a :class:`tokenloom.lora.layers.LinearLoRA`, set
    #: when the engine serves adapters): ``add_delta(x, output)`` adds each token's adapter delta
    lora: Any = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        quant_method: QuantizationMethod | QuantizationConfig | None = None,
        params_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        super().__init__()
        tp_rank, tp_size = tp_place(tp_group, tp_rank, tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tensor-parallel rank {tp_rank} is outside 0..{tp_size - 1}")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_config = quant_method if isinstance(quant_method, QuantizationConfig) else None
        self.quant_method: QuantizationMethod | None = None
        if self.quant_config is None:
            self._create_weights(quant_method or UnquantizedMethod())  # type: ignore[arg-type]
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=self.params_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def _create_weights(self, method: QuantizationMethod) -> None:
        self.quant_method = method
        method.create_weights(self, self.input_size, self.output_size, self.params_dtype)

    def bind_quantization(self, prefix: str, shard_prefixes: tuple[str, ...]) -> None:
        """Ask the model's quantization config for this layer's method by its module name
        ``prefix`` (a fused layer's checkpoint modules are ``shard_prefixes``) and create its
        weights; a layer the config leaves alone gets dense ones."""
        if self.quant_config is None or self.quant_method is not None:
            raise RuntimeError(f"the linear layer {prefix!r} was not built with a quantization config to bind")
        self._create_weights(self.quant_config.get_method(self, prefix, shard_prefixes) or UnquantizedMethod())

    @property
    def method(self) -> QuantizationMethod:
        """The layer's quantization method (an error before :meth:`bind_quantization`)."""
        if self.quant_method is None:
            raise RuntimeError(
                f"this {type(self).__name__} was built with a quantization config but never bound to its module "
                "name: build the model with tokenloom's loader, or call config.bind_layers(model) after building it"
            )
        return self.quant_method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.method.apply(self, x, self.bias)
        return output if self.lora is None else self.lora.add_delta(x, output)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # a weight packed for the CPU matmul (UnquantizedMethod) is saved as the plain tensor
        super()._save_to_state_dict(destination, prefix, keep_vars)
        weight = destination.get(prefix + "weight")
        if isinstance(weight, torch.Tensor) and weight.is_mkldnn:
            destination[prefix + "weight"] = weight.to_dense()

    # -- loading ---------------------------------------------------------------------

    def shard_rows(self, shard_id: Any) -> tuple[int, int, int]:
        """``(output_offset, output_size, checkpoint_row_start)``: where ``shard_id``'s rows
        sit in this rank's weight, and where this rank's slice starts in the checkpoint tensor."""
        return 0, self.output_size, self.tp_rank * self.output_size

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        """Load one checkpoint tensor (``param_name`` "weight", "bias", or a parameter the
        quantization method created), or one shard of a fused layer, into this rank's parameter."""
        if shard_id not in self.shard_ids:
            raise ModelLoadError(f"{type(self).__name__} has no shard {shard_id!r} (it loads {self.shard_ids})")
        offset, size, checkpoint_start = self.shard_rows(shard_id)
        if param_name == "bias":
            if self.bias is None:
                raise ModelLoadError(f"the checkpoint has a bias for a {type(self).__name__} built without one")
            tensor = self._slice_for_rank(materialize(loaded_weight, self.bias.dtype), checkpoint_start, size, dim=0)
            self._check_rows(tensor, size, "bias")
            self.bias.data[offset : offset + size].copy_(tensor)
            return
        parameter = self._parameters.get(param_name)
        layout = parameter_layout(parameter)
        if param_name == "weight" and layout is None:
            self.method.load_weight(self, self._weight_for_rank(loaded_weight, checkpoint_start, size), offset, size)
            return
        if parameter is None or layout is None:
            raise ModelLoadError(
                f"{type(self).__name__} (quantization {self.method.name}) has no parameter {param_name!r}; it "
                f"loads {', '.join(self.method.checkpoint_names(self))}: the checkpoint's quantization is not "
                "the one this layer was given"
            )
        self._load_laid_out(parameter, layout, param_name, torch.as_tensor(loaded_weight), shard_id)

    def _load_laid_out(
        self, parameter: torch.Tensor, layout: ParameterLayout, name: str, tensor: torch.Tensor, shard_id: Any
    ) -> None:
        """Cut a checkpoint tensor for this rank by its layout and copy it into ``parameter``
        (at the shard's rows, or the shard's entry of a per-shard parameter)."""
        offset, size, checkpoint_start = self.shard_rows(shard_id)
        target = parameter.data
        if layout.per_shard:
            target = target[self.shard_ids.index(shard_id)]
            tensor = tensor.reshape(target.shape) if tensor.numel() == target.numel() else tensor
        elif layout.output_dim is not None:
            pack = layout.output_pack
            if offset % pack or size % pack or checkpoint_start % pack:
                raise ModelLoadError(
                    f"{name!r} packs {pack} output rows per element, and this shard's rows "
                    f"{checkpoint_start}:{checkpoint_start + size} do not start and end on a packed element"
                )
            tensor = self._slice_for_rank(tensor, checkpoint_start // pack, size // pack, layout.output_dim)
            target = target.narrow(layout.output_dim, offset // pack, size // pack)
        if layout.input_dim is not None:
            columns = self._input_columns(target.shape[layout.input_dim])
            if columns is not None:
                tensor = self._slice_for_rank(tensor, columns[0], columns[1], layout.input_dim)
        if tensor.shape != target.shape:
            raise ModelLoadError(
                f"{name!r}: checkpoint shape {tuple(tensor.shape)} does not fit {tuple(target.shape)} of this "
                f"layer's parameter of shape {tuple(parameter.shape)}"
            )
        target.copy_(tensor)

    def _input_columns(self, local_size: int) -> tuple[int, int] | None:
        """``(start, size)`` of this rank's slice along an input dimension of ``local_size``
        per rank, or None when every rank holds all of it."""
        return None

    def _weight_for_rank(self, loaded_weight: Any, checkpoint_start: int, size: int) -> Any:
        """This rank's rows of a column-split weight (or of one shard of a fused weight); a
        packed weight is cut in its packed form when it can be (``narrow_rows``)."""
        if self.tp_size == 1:
            return loaded_weight
        if _is_packed(loaded_weight):
            if not hasattr(loaded_weight, "narrow_rows"):
                raise ModelLoadError(
                    f"a packed {type(loaded_weight).__name__} checkpoint weight cannot be split for tensor parallelism"
                )
            rows = loaded_weight.shape[0]
            if checkpoint_start + size > rows:
                raise ModelLoadError(
                    f"packed checkpoint tensor with {rows} rows has no rows {checkpoint_start}:{checkpoint_start + size}"
                )
            return loaded_weight.narrow_rows(checkpoint_start, size)
        return self._slice_for_rank(torch.as_tensor(loaded_weight), checkpoint_start, size, dim=0)

    @staticmethod
    def _slice_for_rank(tensor: torch.Tensor, start: int, size: int, dim: int) -> torch.Tensor:
        if tensor.shape[dim] == size and start == 0:
            return tensor
        if start + size > tensor.shape[dim]:
            raise ModelLoadError(f"checkpoint tensor of shape {tuple(tensor.shape)} has no rows {start}:{start + size}")
        return tensor.narrow(dim, start, size)

    @staticmethod
    def _check_rows(tensor: torch.Tensor, size: int, what: str) -> None:
        if tensor.shape[0] != size:
            raise ModelLoadError(f"{what} of shape {tuple(tensor.shape)} does not fit {size} rows")

    def extra_repr(self) -> str:
        quant = self.quant_method.name if self.quant_method is not None else "unbound"
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"quant={quant}, tp={self.tp_rank}/{self.tp_size}"
        )


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, **kwargs):
        super().__init__(input_size, output_size, **{**kwargs, "tp_rank": 0, "tp_size": 1, "tp_group": None})


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(
        self, input_size: int, output_size: int, *, tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None, **kwargs
    ):
        self.total_output_size = output_size
        tp_rank, tp_size = tp_place(tp_group, tp_rank, tp_size)
        super().__init__(
            input_size,
            divide(output_size, tp_size, "output size"),
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
            **kwargs,
        )


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed across ranks."""

    def __init__(
        self, input_size: int, output_size: int, *, tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None, **kwargs
    ):
        self.total_input_size = input_size
        tp_rank, tp_size = tp_place(tp_group, tp_rank, tp_size)
        super().__init__(
            divide(input_size, tp_size, "input size"),
            output_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
            **kwargs,
        )

    def shard_rows(self, shard_id):
        # rows are whole on every rank; the split is along the input columns
        return 0, self.output_size, 0

    def _weight_for_rank(self, loaded_weight, checkpoint_start, size):
        if self.tp_size == 1:
            return loaded_weight
        column_start = self.tp_rank * self.input_size
        if _is_packed(loaded_weight):
            # a packed tensor is cut in whole quantization blocks of each row (it raises,
            # naming the tensor, when this rank's columns start or end inside a block)
            if not hasattr(loaded_weight, "narrow_columns"):
                raise ModelLoadError(
                    f"a packed {type(loaded_weight).__name__} checkpoint weight cannot be split for tensor parallelism"
                )
            return loaded_weight.narrow_columns(column_start, self.input_size)
        return self._slice_for_rank(torch.as_tensor(loaded_weight), column_start, self.input_size, dim=1)

    def _input_columns(self, local_size):
        return None if self.tp_size == 1 else (self.tp_rank * local_size, local_size)

    def load_checkpoint_weight(self, param_name, loaded_weight, shard_id=None):
        if param_name == "bias" and self.tp_rank != 0:
            return  # the bias is added once, on rank 0, before the sum across ranks
        super().load_checkpoint_weight(param_name, loaded_weight, shard_id)

    @property
    def sums_partials(self) -> bool:
        """True when this rank's output is a partial product summed over ranks: a quantization
        method may then return it wider than ``x`` (float32), to be rounded once after the sum."""
        return self.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        output = self.method.apply(self, x, bias)
        if self.tp_size > 1:
            # summed in float32 and rounded once, as one worker's matmul rounds its whole sum:
            # a 16-bit all-reduce would round after every addition
            wide = output.float() if output.dtype in (torch.bfloat16, torch.float16) else output
            output = tensor_parallel_all_reduce(wide, self.tp_group, self.tp_size).to(x.dtype)
        return output if self.lora is None else self.lora.add_delta(x, output)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight (e.g. gate and
    up): checkpoint shard ``i`` fills rows ``sum(output_sizes[:i]) / tp_size`` onwards."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        **kwargs,
    ):
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(range(len(output_sizes)))
        tp_rank, tp_size = tp_place(tp_group, tp_rank, tp_size)
        for size in output_sizes:
            divide(size, tp_size, "each merged output size")
        super().__init__(input_size, sum(output_sizes), tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, **kwargs)

    def shard_rows(self, shard_id):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        return offset, size, self.tp_rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight, split by heads across ranks. With
    fewer KV heads than ranks, each KV head is replicated on ``tp_size / num_kv_heads`` ranks."""

    shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        **kwargs,
    ):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_rank, tp_size = tp_place(tp_group, tp_rank, tp_size)
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        self.num_kv_heads, self.num_kv_head_replicas = kv_heads_per_rank(total_num_kv_heads, tp_size)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, **kwargs)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def shard_rows(self, shard_id):
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank * self.q_size
        first_kv_head = (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, first_kv_head * self.head_size


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every linear layer's quantization method, and every other layer with a
    ``process_weights_after_loading()`` of its own, repack its weights (call once, after all
    weights are loaded)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
