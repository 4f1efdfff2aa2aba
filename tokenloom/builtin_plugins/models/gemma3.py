"""Registers the Gemma 3 architectures (the text model, and the text part of the multimodal
checkpoint). The classes live in :mod:`~tokenloom.builtin_plugins.models.modeling_gemma3`,
imported by name when a worker builds the model: this entry-point module stays free of
torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("Gemma3ForCausalLM", "tokenloom.builtin_plugins.models.modeling_gemma3:Gemma3ForCausalLM")
    register(
        "Gemma3ForConditionalGeneration",
        "tokenloom.builtin_plugins.models.modeling_gemma3:Gemma3ForConditionalGeneration",
    )
