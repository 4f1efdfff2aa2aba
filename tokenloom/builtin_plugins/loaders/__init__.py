"""The built-in weight formats, registered as ``"module:Class"`` strings. ``--load-format
auto`` asks them in this order which can read the files: safetensors, pt, gguf (dummy only
when named)."""

from tokenloom.plugin_api import hookimpl

PACKAGE = "tokenloom.builtin_plugins.loaders"


@hookimpl
def register_load_formats(register):
    register("safetensors", f"{PACKAGE}.safetensors_format:SafetensorsLoadFormat")
    register("pt", f"{PACKAGE}.pt_format:PtLoadFormat")
    register("gguf", f"{PACKAGE}.gguf_format:GGUFLoadFormat")
    register("dummy", f"{PACKAGE}.dummy_format:DummyLoadFormat")
