"""The built-in reasoning parsers (``--reasoning-parser NAME``), one model family per module,
registered lazily: loading this plugin imports none of them."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl

_PACKAGE = "tokenloom.builtin_plugins.reasoning_parsers"

REASONING_PARSERS = {
    "deepseek_r1": "deepseek_r1:DeepSeekR1ReasoningParser",
    "qwen3": "qwen3:Qwen3ReasoningParser",
    "granite": "granite:GraniteReasoningParser",
    "mistral": "mistral:MistralReasoningParser",
    "glm45": "glm45:Glm45ReasoningParser",
    "hunyuan_a13b": "hunyuan_a13b:HunyuanA13BReasoningParser",
    "seed_oss": "seed_oss:SeedOssReasoningParser",
    "step3": "step3:Step3ReasoningParser",
    "openai_gptoss": "openai_gptoss:GptOssReasoningParser",
}


@hookimpl
def register_reasoning_parsers(register):
    for name, target in REASONING_PARSERS.items():
        register(name, f"{_PACKAGE}.{target}")
