"""Registers the Phi-3 architecture. The class lives in
:mod:`~tokenloom.builtin_plugins.models.modeling_phi3`, imported by name when a worker
builds the model: this entry-point module stays free of torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("Phi3ForCausalLM", "tokenloom.builtin_plugins.models.modeling_phi3:Phi3ForCausalLM")
