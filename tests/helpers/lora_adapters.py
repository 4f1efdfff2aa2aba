"""PEFT adapters made in tests: random, with a non-zero B (PEFT initialises B to zero, which
would make every adapter the base model), saved as PEFT saves them."""

from __future__ import annotations

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base_model, directory, *, r, alpha, targets, seed, use_rslora=False, scale=0.2, safe=True):
    """Wrap ``base_model`` (a transformers model, left unchanged) in a random LoRA and save it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora, bias="none"
    )
    peft_model = get_peft_model(base_model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if any(side in name for side in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(directory), safe_serialization=safe)
    peft_model.unload()  # takes the LoRA layers out again: base_model is as it was
    return str(directory)


def peft_greedy(base_model, adapter_dir, prompts_ids, max_new_tokens, *, merged=False, pad_token_id=0):
    """transformers + PEFT greedy continuation of each prompt (token ids), the adapter applied
    beside the base weights, or merged into them. ``base_model``: a factory of a fresh model
    (needed to merge), or a model to wrap and give back unchanged."""
    from peft import PeftModel

    reuse = not callable(base_model) or isinstance(base_model, torch.nn.Module)
    if reuse and merged:
        raise ValueError("merging changes the base weights: pass a factory of fresh models")
    model = PeftModel.from_pretrained(base_model if reuse else base_model(), adapter_dir).eval()
    if merged:
        model = model.merge_and_unload().eval()
    results = []
    for ids in prompts_ids:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_token_id,
            )
        results.append(generated[0, len(ids) :].tolist())
    if reuse:
        model.unload()  # the LoRA layers out again: base_model is as it was
    return results


# SmolLM2-135M's shapes (the model the e2e servers run), for adapters written without loading it
SMOLLM2_135M = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
}


def save_constant_adapter(directory, *, value, r=4, targets=ALL_PROJECTIONS, embeddings=True, config=SMOLLM2_135M):
    """A PEFT adapter for ``config``'s model (SmolLM2-135M's by default) whose every weight is
    ``value`` (nan, or a huge finite number whose products overflow), on every layer's ``targets``
    and, with ``embeddings``, on ``embed_tokens`` and ``lm_head``; ``lora_alpha = r``, so its
    scaling is 1 and ``value`` is what the slots hold. Written directly, without PEFT."""
    import json
    import os
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from tokenloom.lora.peft import SUPPORTED_PROJECTIONS, module_shapes_from_config

    shapes = module_shapes_from_config(SimpleNamespace(**config))
    prefix = "base_model.model.model."
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for projection in targets:
            name = f"layers.{layer}.{SUPPORTED_PROJECTIONS[projection]}.{projection}"
            in_features, out_features = shapes[name]
            tensors[f"{prefix}{name}.lora_A.weight"] = torch.full((r, in_features), value)
            tensors[f"{prefix}{name}.lora_B.weight"] = torch.full((out_features, r), value)
    if embeddings:
        vocab, hidden = config["vocab_size"], config["hidden_size"]
        tensors[f"{prefix}embed_tokens.lora_embedding_A"] = torch.full((r, vocab), value)
        tensors[f"{prefix}embed_tokens.lora_embedding_B"] = torch.full((hidden, r), value)
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.full((r, hidden), value)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.full((vocab, r), value)
    os.makedirs(directory, exist_ok=True)
    modules = list(targets) + (["embed_tokens", "lm_head"] if embeddings else [])
    with open(os.path.join(directory, "adapter_config.json"), "w") as handle:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": modules, "bias": "none"}, handle)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    return str(directory)
