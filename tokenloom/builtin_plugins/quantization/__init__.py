"""Quantization method plugins. This module is the entry point: it registers each method by a
lazy "module:Class" string, so listing plugins imports no torch."""

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_quantization_methods(register):
    register("gguf", "tokenloom.builtin_plugins.quantization.gguf_config:GGUFConfig")
    register("compressed-tensors", "tokenloom.builtin_plugins.quantization.compressed_tensors:CompressedTensorsConfig")
    register("gptq", "tokenloom.builtin_plugins.quantization.gptq:GPTQConfig")
    register("awq", "tokenloom.builtin_plugins.quantization.awq:AWQConfig")
