"""Registers the OLMo 2 architecture. The class lives in
:mod:`~tokenloom.builtin_plugins.models.modeling_olmo2`, imported by name when a worker
builds the model: this entry-point module stays free of torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("Olmo2ForCausalLM", "tokenloom.builtin_plugins.models.modeling_olmo2:Olmo2ForCausalLM")
