"""Registers the Qwen3 architecture (dense). The class lives in
:mod:`~tokenloom.builtin_plugins.models.modeling_qwen3`, imported by name when a worker
builds the model: this entry-point module stays free of torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("Qwen3ForCausalLM", "tokenloom.builtin_plugins.models.modeling_qwen3:Qwen3ForCausalLM")
