"""The built-in model sources, registered as ``"module:Class"`` strings and asked in this order
which one takes a model tag: a local path, a Hugging Face repo id, a model a pip package ships."""

from tokenloom.plugin_api import hookimpl

PACKAGE = "tokenloom.builtin_plugins.model_sources"


@hookimpl
def register_model_sources(register):
    register("local", f"{PACKAGE}.local:LocalModelSource")
    register("huggingface", f"{PACKAGE}.huggingface:HuggingFaceModelSource")
    register("pip_packages", f"{PACKAGE}.pip_packages:PipPackageModelSource")
