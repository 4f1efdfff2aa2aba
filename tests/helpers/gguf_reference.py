"""transformers' model of a real GGUF file in float32, the reference the parity tests compare
tokenloom with: built from tokenloom's ``gguf`` load format (its config and dequantized weights)
rather than by transformers' own GGUF conversion, which
tests/builtin_plugins/loaders/test_gguf_real_models.py proves equal to it, config field by field
and every weight value by value. That conversion runs Python over every tensor (and over
Gemma 3's 262k-token vocabulary for its config): most of the time of the modules that needed it."""

from __future__ import annotations

import torch

from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight
from tokenloom.core.config import ModelConfig


def transformers_model(path: str):
    """transformers' causal LM of the GGUF file at ``path``, in float32, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    load_format = GGUFLoadFormat()
    fields = load_format.load_config(path, ModelConfig()).to_dict()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {
        name: weight.dequantize() if isinstance(weight, GGUFWeight) else weight.float()
        for name, weight in load_format.iterate_weights(path, None, None)
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if missing:  # the file holds no head: it is tied to the embedding
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return model.eval()
