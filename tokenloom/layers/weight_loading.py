"""Loading checkpoint tensors, by their Hugging Face names, into a model built from
tokenloom layers: fused projections take their shards through a stacked-parameter mapping,
every other tensor goes to the module at its dotted path. A missing tensor is an error that
names it, and so is a checkpoint tensor the model has no place for, unless the model lists it as
ignorable: a model that dropped, say, its q/k norms would otherwise serve wrong text silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from tokenloom.errors import ModelLoadError
from tokenloom.layers.linear import LinearBase, process_weights_after_loading
from tokenloom.layers.quantization import materialize

# (fused sub-module, checkpoint sub-module, shard id) of the common decoder projections
DECODER_STACKED_PARAMS: tuple[tuple[str, str, Any], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# checkpoint entries that are not weights: the rotary buffers some exporters save
ROTARY_BUFFERS = ("*rotary_emb.inv_freq", "*rotary_emb.cos_cached", "*rotary_emb.sin_cached")


def _expected_entries(model: nn.Module, skip_prefixes: tuple[str, ...]) -> set[tuple[str, str, Any]]:
    """``(module path, parameter name, shard id)`` of everything the checkpoint must provide."""
    expected = set()
    for path, module in model.named_modules():
        if path.startswith(skip_prefixes) or (path + ".").startswith(skip_prefixes):
            continue
        if getattr(module, "checks_own_weights", False):
            continue  # it names what it lacks itself, in process_weights_after_loading (fused experts)
        if isinstance(module, LinearBase):
            for name in module.method.checkpoint_names(module):
                expected.update((path, name, shard_id) for shard_id in module.shard_ids)
            if module.bias is not None:
                expected.update((path, "bias", shard_id) for shard_id in module.shard_ids)
        else:
            expected.update((path, name, None) for name, _ in module.named_parameters(recurse=False))
    return expected


def _load_plain_parameter(module: nn.Module, param_name: str, loaded_weight: Any) -> None:
    param = getattr(module, param_name, None)
    if not isinstance(param, torch.Tensor):
        raise ModelLoadError(f"{type(module).__name__} has no parameter {param_name!r}")
    tensor = materialize(loaded_weight, param.dtype)
    if tensor.shape != param.shape:
        raise ModelLoadError(f"{param_name!r}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.data.copy_(tensor)


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Any]],
    *,
    stacked_params: Iterable[tuple[str, str, Any]] = DECODER_STACKED_PARAMS,
    rename: Callable[[str], str] | None = None,
    skip_prefixes: tuple[str, ...] = (),
    ignored: tuple[str, ...] = (),
) -> set[str]:
    """Load ``(hf_name, tensor)`` pairs into ``model`` and run each linear layer's
    ``process_weights_after_loading``; returns the model parameter names filled.

    A checkpoint tensor no module takes is a ModelLoadError naming it.

    :param rename: maps a checkpoint name to the model's name.
    :param skip_prefixes: model names not loaded and not required (e.g. a tied ``lm_head.``).
    :param ignored: shell-style patterns (:func:`fnmatch.fnmatchcase`; ``*`` crosses dots) of
        checkpoint names the model may leave unread, e.g. :data:`ROTARY_BUFFERS`.
    """
    modules = dict(model.named_modules())
    stacked_params = [(f".{fused}.", f".{original}.", shard_id) for fused, original, shard_id in stacked_params]
    loaded: set[tuple[str, str, Any]] = set()
    unexpected: list[str] = []
    for checkpoint_name, loaded_weight in weights:
        name = rename(checkpoint_name) if rename else checkpoint_name
        if name.startswith(skip_prefixes):
            continue
        if any(fnmatchcase(checkpoint_name, pattern) for pattern in ignored):
            continue
        shard_id = None
        dotted = "." + name  # so a top-level "q_proj.weight" matches ".q_proj." too
        for fused, original, stacked_shard in stacked_params:
            if original in dotted:
                name, shard_id = dotted.replace(original, fused, 1)[1:], stacked_shard
                break
        module_path, _, param_name = name.rpartition(".")
        module = modules.get(module_path)
        if module is None:
            unexpected.append(checkpoint_name)
            continue
        try:
            if hasattr(module, "load_checkpoint_weight"):
                module.load_checkpoint_weight(param_name, loaded_weight, shard_id)
            else:
                _load_plain_parameter(module, param_name, loaded_weight)
        except (ModelLoadError, ValueError) as error:
            # quantization methods report shape mismatches as ValueError
            raise ModelLoadError(f"checkpoint tensor {checkpoint_name!r}: {error}") from error
        loaded.add((module_path, param_name, shard_id))
    missing = _expected_entries(model, skip_prefixes) - loaded
    if missing:
        names = sorted(
            (f"{path}.{param}" if path else param) + ("" if shard is None else f" (shard {shard})")
            for path, param, shard in missing
        )
        raise ModelLoadError(f"the checkpoint lacks {len(names)} weight(s) the model needs: {', '.join(names[:10])}")
    if unexpected:
        raise ModelLoadError(
            f"the checkpoint holds {len(unexpected)} tensor(s) {type(model).__name__} has no parameter for: "
            f"{', '.join(unexpected[:10])}; it is not the architecture its config names, or a variant of "
            "it tokenloom does not implement (a model plugin names the tensors it may leave unread in "
            "its ignored_checkpoint_weights)"
        )
    process_weights_after_loading(model)
    own_checks = {path for path, module in modules.items() if getattr(module, "checks_own_weights", False)}
    filled = {f"{path}.{param}" if path else param for path, param, _ in loaded if path not in own_checks}
    # a quantization method may repack a layer's checkpoint tensors into parameters of other
    # names (a kernel's layout): a layer that took its checkpoint tensors has them all filled; a
    # module checking its own weights (fused experts) filled all of its parameters, or raised
    loaded_layers = {path for path, _, _ in loaded}
    for path, module in modules.items():
        if isinstance(module, LinearBase) and path in loaded_layers:
            filled.update(f"{path}.{name}" for name, _ in module.named_parameters(recurse=False) if name != "bias")
        elif path in own_checks:
            filled.update(f"{path}.{name}" for name, _ in module.named_parameters(recurse=False))
    return filled
