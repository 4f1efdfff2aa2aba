"""The built-in model architectures, by the name a checkpoint's ``config.json`` gives
(``architectures``; a GGUF file's architecture is mapped onto the same names), registered as
``"module:Class"`` strings: loading this plugin imports no model code."""

from tokenloom.plugin_api import hookimpl

PACKAGE = "tokenloom.builtin_plugins.models"

# architecture -> (the class that builds it, the runner it serves with)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": (f"{PACKAGE}.modeling_llama:LlamaForCausalLM", "generate"),
    "MistralForCausalLM": (f"{PACKAGE}.modeling_llama:MistralForCausalLM", "generate"),
    "Qwen2ForCausalLM": (f"{PACKAGE}.modeling_qwen2:Qwen2ForCausalLM", "generate"),
    "Qwen3ForCausalLM": (f"{PACKAGE}.modeling_qwen3:Qwen3ForCausalLM", "generate"),
    "Qwen3MoeForCausalLM": (f"{PACKAGE}.modeling_qwen3_moe:Qwen3MoeForCausalLM", "generate"),
    "MixtralForCausalLM": (f"{PACKAGE}.modeling_mixtral:MixtralForCausalLM", "generate"),
    "Qwen2MoeForCausalLM": (f"{PACKAGE}.modeling_qwen2_moe:Qwen2MoeForCausalLM", "generate"),
    "OlmoeForCausalLM": (f"{PACKAGE}.modeling_olmoe:OlmoeForCausalLM", "generate"),
    "Gemma2ForCausalLM": (f"{PACKAGE}.modeling_gemma2:Gemma2ForCausalLM", "generate"),
    "Gemma3ForCausalLM": (f"{PACKAGE}.modeling_gemma3:Gemma3ForCausalLM", "generate"),
    "Gemma3ForConditionalGeneration": (f"{PACKAGE}.modeling_gemma3:Gemma3ForConditionalGeneration", "generate"),
    "LlavaForConditionalGeneration": (f"{PACKAGE}.modeling_llava:LlavaForConditionalGeneration", "generate"),
    "LlavaNextForConditionalGeneration": (
        f"{PACKAGE}.modeling_llava_next:LlavaNextForConditionalGeneration",
        "generate",
    ),
    "Qwen2VLForConditionalGeneration": (f"{PACKAGE}.modeling_qwen2_vl:Qwen2VLForConditionalGeneration", "generate"),
    "Qwen2_5_VLForConditionalGeneration": (
        f"{PACKAGE}.modeling_qwen2_vl:Qwen2_5_VLForConditionalGeneration",
        "generate",
    ),
    "Idefics3ForConditionalGeneration": (f"{PACKAGE}.modeling_idefics3:Idefics3ForConditionalGeneration", "generate"),
    "Olmo2ForCausalLM": (f"{PACKAGE}.modeling_olmo2:Olmo2ForCausalLM", "generate"),
    "GraniteForCausalLM": (f"{PACKAGE}.modeling_granite:GraniteForCausalLM", "generate"),
    "Phi3ForCausalLM": (f"{PACKAGE}.modeling_phi3:Phi3ForCausalLM", "generate"),
    "BertModel": (f"{PACKAGE}.modeling_bert:BertModel", "pooling"),
    # any other decoder-only causal LM transformers has (--model-impl; core/model_loader.py:TRANSFORMERS_FALLBACK)
    "TransformersForCausalLM": (f"{PACKAGE}.transformers_fallback:TransformersForCausalLM", "generate"),
}

# architecture -> the multimodal processor of a model that sees (core/multimodal/processor.py)
MULTIMODAL_PROCESSORS: dict[str, str] = {
    "LlavaForConditionalGeneration": f"{PACKAGE}.llava_processing:LlavaProcessor",
    "LlavaNextForConditionalGeneration": f"{PACKAGE}.llava_next_processing:LlavaNextProcessor",
    "Qwen2VLForConditionalGeneration": f"{PACKAGE}.qwen2_vl_processing:Qwen2VLProcessor",
    "Qwen2_5_VLForConditionalGeneration": f"{PACKAGE}.qwen2_vl_processing:Qwen2VLProcessor",
    "Idefics3ForConditionalGeneration": f"{PACKAGE}.idefics3_processing:Idefics3Processor",
    "Gemma3ForConditionalGeneration": f"{PACKAGE}.gemma3_processing:Gemma3Processor",
}


@hookimpl
def register_models(register):
    for architecture, (target, runner) in MODELS.items():
        options = {"runner": runner} if runner != "generate" else {}
        if architecture in MULTIMODAL_PROCESSORS:
            options["multimodal_processor"] = MULTIMODAL_PROCESSORS[architecture]
        register(architecture, target, **options)
