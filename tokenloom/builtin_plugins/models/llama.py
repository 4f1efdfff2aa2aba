"""Registers the Llama and Mistral architectures. The classes live in
:mod:`~tokenloom.builtin_plugins.models.modeling_llama`, imported by name when a worker
builds the model: this entry-point module stays free of torch, so listing plugins is fast."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_models(register):
    register("LlamaForCausalLM", "tokenloom.builtin_plugins.models.modeling_llama:LlamaForCausalLM")
    register("MistralForCausalLM", "tokenloom.builtin_plugins.models.modeling_llama:MistralForCausalLM")
