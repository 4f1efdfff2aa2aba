"""The quantization interface linear layers carry, and the unquantized default.

Two objects, in the shape of vLLM's: a :class:`QuantizationConfig`, which a quantization plugin
builds once per model from the checkpoint (``from_checkpoint``: config.json's
``quantization_config``, a GGUF file's tensor types, or nothing but ``--quantization``), and
decides per linear layer, by its module name, which :class:`QuantizationMethod` the layer gets
(an ignore list, an unquantized LM head, one scheme per layer); and the method, which creates
the layer's parameters, loads checkpoint tensors into them, repacks them once loading is done,
and runs the layer's matmul.

A method may create parameters of its own naming beside (or instead of) ``weight``: each
carries a :class:`ParameterLayout` saying which of its dimensions follow the layer's output
rows and input columns and how many logical values one stored element packs, so the layer's
loader (:meth:`tokenloom.layers.linear.LinearBase.load_checkpoint_weight`) cuts a checkpoint
tensor for its tensor-parallel rank and places a fused layer's shards (q/k/v, gate/up) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear


def materialize(loaded_weight: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A checkpoint tensor as a dense torch tensor (packed weights are dequantized)."""
    if hasattr(loaded_weight, "dequantize") and not isinstance(loaded_weight, torch.Tensor):
        loaded_weight = loaded_weight.dequantize()
    tensor = torch.as_tensor(loaded_weight)
    return tensor.to(dtype) if dtype is not None else tensor


@dataclass(frozen=True)
class ParameterLayout:
    """How a named quantized parameter lines up with its layer's logical ``[out, in]`` weight.

    :param output_dim: the dimension that follows the output rows (None: not split by rows;
        a fused layer's shards then share it, or, with ``per_shard``, each has its own entry).
    :param input_dim: the dimension that follows the input columns (None: whole on every
        rank of a row-parallel layer, e.g. a per-channel scale).
    :param output_pack: logical output rows per stored element along ``output_dim`` (8 for
        int4 zero points packed into int32 along the rows).
    :param per_shard: one entry per shard of a fused layer along dimension 0 (a per-tensor
        scale of q, k and v), rather than one value for the layer.
    """

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_pack: int = 1
    per_shard: bool = False


def add_parameter(layer: nn.Module, name: str, tensor: torch.Tensor, layout: ParameterLayout) -> nn.Parameter:
    """Register ``tensor`` as ``layer.<name>``, loaded from the checkpoint by ``layout``."""
    parameter = nn.Parameter(tensor, requires_grad=False)
    parameter.checkpoint_layout = layout  # type: ignore[attr-defined]
    layer.register_parameter(name, parameter)
    return parameter


def parameter_layout(parameter: Any) -> ParameterLayout | None:
    """The layout :func:`add_parameter` gave ``parameter``, or None for a plain one."""
    layout: ParameterLayout | None = getattr(parameter, "checkpoint_layout", None)
    return layout


class QuantizationMethod:
    """How one linear layer holds and multiplies its weight.

    ``create_weights`` is called once per layer; the layer then receives checkpoint tensors:
    ``weight`` through :meth:`load_weight` (``loaded_weight`` may be packed, e.g. a GGUF
    block-quantized tensor), every other name through the :class:`ParameterLayout` of the
    parameter ``create_weights`` added under that name; ``process_weights_after_loading``
    runs once after all weights are loaded; ``apply`` is the layer's forward.
    """

    name: str = "none"

    # set by the config before any layer is built: False when the platform chose the model
    # dtype (``--dtype auto``), and the method may then compute small batches in a narrower
    # dtype where that is faster; True (the default, and whenever the user named ``--dtype``)
    # means no lower precision than that dtype
    exact_dtype: bool = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        """Create the layer's parameters (``layer.weight``, ``[output_size, input_size]``,
        and/or named ones with :func:`add_parameter`)."""
        raise NotImplementedError

    def checkpoint_names(self, layer: nn.Module) -> tuple[str, ...]:
        """The parameter names the checkpoint must provide for this layer (besides its bias)."""
        return ("weight",)

    def load_weight(self, layer: nn.Module, loaded_weight: Any, output_offset: int, output_size: int) -> None:
        """Copy ``loaded_weight`` (rows ``output_offset:output_offset+output_size`` of the
        layer's output, a shard of a fused layer) into the layer's weight."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack weights once loading is complete (e.g. to a fast kernel's layout)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``."""
        raise NotImplementedError

    def pack_expert_rows(self, loaded_weight: Any, dtype: torch.dtype) -> Any:
        """A checkpoint weight's rows ``[R, K]`` (one expert's, or several experts' stacked) packed
        for one of tokenloom's CPU kernels, when this method keeps such a weight in its own codes
        in a layer of ``dtype``: an :class:`~tokenloom.kernels.int4_matmul.Int4Weight` packed for
        tokenloom's kernel or a :class:`~tokenloom.kernels.kquant_matmul.KQuantWeight`; else None
        (it is loaded dense). How layers that are not linear (:mod:`tokenloom.layers.fused_moe`) ask;
        the experts pass a stacked down tensor's every expert at once, so a method bounds its own
        packers' temporaries."""
        return None


class QuantizationConfig:
    """Registered with ``register_quantization_methods`` under the name a checkpoint's
    ``quantization_config.quant_method`` (or a load format's :meth:`LoadFormat.quantization`)
    states; built once per model, in the main process to check the checkpoint and again in
    each worker.
    """

    name: str = "none"

    # set by the loader before any method is asked for (see QuantizationMethod.exact_dtype)
    exact_dtype: bool = True

    #: whether the checkpoint stores the LM head in this method's tensors (GPTQ's ``lm_head:
    #: true``: ``lm_head.qweight`` and so on): the model then builds its head as a linear layer
    #: of this config (:class:`~tokenloom.layers.embedding.QuantizedLMHead`, never tied to the
    #: embedding, which stays dense), and :meth:`get_method` is asked for it by the name ``lm_head``
    quantizes_lm_head: bool = False

    @classmethod
    def from_checkpoint(cls, hf_config: Any) -> QuantizationConfig:
        """The config for a checkpoint (``hf_config.quantization_config``, when it has one,
        is the checkpoint's own description); raise ConfigError naming what is unsupported."""
        return cls()

    def get_method(self, layer: nn.Module, prefix: str, shard_prefixes: tuple[str, ...]) -> QuantizationMethod | None:
        """The method for the linear layer at module path ``prefix`` (a fused layer's
        checkpoint modules are ``shard_prefixes``, e.g. its q_proj, k_proj and v_proj), or
        None to leave it unquantized."""
        raise NotImplementedError

    def bind_layers(self, model: nn.Module) -> None:
        """Give every linear layer built with this config its method, by its module name
        (the loader calls this once the model is built, before any weight is loaded). A fused
        layer's checkpoint modules come from the model's ``stacked_params`` (fused sub-module,
        checkpoint sub-module, shard id), as its weight loading maps them."""
        stacked = tuple(getattr(model, "stacked_params", ()))
        for prefix, module in model.named_modules():
            if getattr(module, "quant_config", None) is not self:
                continue
            parent, _, leaf = prefix.rpartition(".")
            originals = tuple(original for fused, original, _ in stacked if fused == leaf)
            shard_prefixes = tuple(f"{parent}.{name}" if parent else name for name in originals) or (prefix,)
            module.bind_quantization(prefix, shard_prefixes)  # type: ignore[operator]


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """``quantization_config`` of a Hugging Face config, as a dict, or None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return dict(config)


class UnquantizedMethod(QuantizationMethod):
    """Dense weights in the model dtype. Once loaded, a CPU weight oneDNN multiplies natively
    is replaced by its oneDNN-packed form (:mod:`tokenloom.kernels.onednn_linear`): the same
    values in the matmul's own layout (``layer.weight.to_dense()`` reads them back)."""

    name = "none"

    def create_weights(self, layer, input_size, output_size, dtype):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def load_weight(self, layer, loaded_weight, output_offset, output_size):
        tensor = materialize(loaded_weight, layer.weight.dtype)
        if tensor.shape[0] != output_size or tensor.shape[1:] != layer.weight.shape[1:]:
            raise ValueError(
                f"weight shape {tuple(tensor.shape)} does not fit rows {output_offset}:{output_offset + output_size} "
                f"of a parameter of shape {tuple(layer.weight.shape)}"
            )
        layer.weight.data[output_offset : output_offset + output_size].copy_(tensor)

    def process_weights_after_loading(self, layer):
        if packable(layer.weight):
            layer.weight = nn.Parameter(pack_weight(layer.weight), requires_grad=False)

    def apply(self, layer, x, bias):
        if layer.weight.is_mkldnn:
            return packed_linear(x, layer.weight, bias)
        return torch.nn.functional.linear(x, layer.weight, bias)
