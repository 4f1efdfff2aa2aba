"""tokenloom-example-plugin: the hooks only. Targets are "module:Class" strings, imported by
tokenloom on first use, so loading this plugin imports nothing else (no torch: the model file
is imported by the worker that builds the model)."""

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("example_call_tags", "tokenloom_example_plugin.call_tags:CallTagToolParser")


@hookimpl
def register_model_sources(register):
    register("example", "tokenloom_example_plugin.example_source:ExampleModelSource")


@hookimpl
def register_models(register):
    register("ArceeForCausalLM", "tokenloom_example_plugin.modeling_arcee:ArceeForCausalLM")


@hookimpl
def register_quantization_methods(register):
    register("example-int8", "tokenloom_example_plugin.int8_weight_only:Int8WeightOnlyConfig")
