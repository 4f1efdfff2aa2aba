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
