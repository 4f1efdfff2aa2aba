"""Pipeline stages for model plugins: which decoder layers a stage holds
(:func:`stage_layers`), the placeholder standing where another stage's module would be
(:class:`MissingLayer`), and what passes from one stage to the next
(:class:`~tokenloom.core.model_interface.IntermediateTensors`).

A model split into stages keeps Hugging Face's module names (``model.layers.7`` stays layer 7
on whichever stage holds it), so checkpoint names still find their module; another stage's
modules are :class:`MissingLayer`, which has no parameters and is never called.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenloom.errors import ConfigError


def stage_layers(num_layers: int, place: Any) -> range:
    """The decoder layers of pipeline stage ``place.pp_rank`` among ``place.pp_size`` stages
    (``place``: a :class:`~tokenloom.core.distributed.ParallelRank`; None: one stage).

    Layers are split as evenly as possible; when they don't divide, the extra layers go to the
    stages before the last one (the last stage also runs the final norm, the LM head and the
    sampler), counting back from the second-to-last.
    """
    pp_size = getattr(place, "pp_size", 1) if place is not None else 1
    pp_rank = getattr(place, "pp_rank", 0) if place is not None else 0
    if num_layers < pp_size:
        raise ConfigError(
            f"the model has {num_layers} decoder layers, fewer than the {pp_size} pipeline stages asked for: "
            f"use --pipeline-parallel-size {num_layers} or less",
            param="pipeline_parallel_size",
        )
    sizes = [num_layers // pp_size] * pp_size
    for extra in range(num_layers % pp_size):
        sizes[(pp_size - 2 - extra) % pp_size] += 1
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


def number_attention_layers(layers: list[nn.Module]) -> None:
    """Number the paged :class:`~tokenloom.layers.attention.Attention` modules of a stage's
    ``layers`` 0, 1, ... in order: a stage's KV cache holds one tensor per attention layer it
    runs, so the index a layer reads its cache at counts from the stage's first layer (on one
    stage this is each layer's own index, as built)."""
    from tokenloom.layers.attention import Attention

    attention_modules = [module for layer in layers for module in layer.modules() if isinstance(module, Attention)]
    for cache_index, attention in enumerate(attention_modules):
        attention.layer_index = cache_index


class MissingLayer(nn.Module):
    """Stands where another pipeline stage's module is: no parameters, never run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module lives on another pipeline stage and cannot run here")
