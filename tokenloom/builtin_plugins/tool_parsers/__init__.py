"""The built-in tool-call parsers (``--tool-call-parser NAME``), one format per module,
registered lazily: loading this plugin imports none of them."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl

_PACKAGE = "tokenloom.builtin_plugins.tool_parsers"

TOOL_PARSERS = {
    "hermes": "hermes:HermesToolParser",
    "mistral": "mistral:MistralToolParser",
    "llama3_json": "llama3_json:Llama3JsonToolParser",
    "llama4_json": "llama4_json:Llama4JsonToolParser",
    "pythonic": "pythonic:PythonicToolParser",
    "llama4_pythonic": "llama4_pythonic:Llama4PythonicToolParser",
    "granite": "granite:GraniteToolParser",
    "granite-20b-fc": "granite_20b_fc:Granite20bFCToolParser",
    "internlm": "internlm:InternLMToolParser",
    "jamba": "jamba:JambaToolParser",
    "phi4_mini_json": "phi4_mini_json:Phi4MiniJsonToolParser",
    "deepseek_v3": "deepseek_v3:DeepSeekV3ToolParser",
}


@hookimpl
def register_tool_parsers(register):
    for name, target in TOOL_PARSERS.items():
        register(name, f"{_PACKAGE}.{target}")
