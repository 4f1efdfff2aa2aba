"""Registers the Granite architecture (dense). The class lives in
:mod:`~tokenloom.builtin_plugins.models.modeling_granite`, imported by name when a worker
builds the model: this entry-point module stays free of torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("GraniteForCausalLM", "tokenloom.builtin_plugins.models.modeling_granite:GraniteForCausalLM")
