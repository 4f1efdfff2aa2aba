"""Writes a scripted model's directory: a ``config.json`` naming ``ScriptedForCausalLM``, the
tokenizer files of SmolLM2 (from its GGUF file, through tokenloom's GGUF load format), one
tiny safetensors weight, and ``scenarios.json`` with each scripted response tokenized."""

from __future__ import annotations

import json
import os

MAX_POSITION_EMBEDDINGS = 4096
LOGIT_MARGIN = 1.0e4
# what the chat template writes just before the answer (SmolLM2's ChatML)
RESPONSE_START = "<|im_start|>assistant\n"


def marker(name: str) -> str:
    """The text that selects a scenario when it is in the prompt (start a user message with it)."""
    return f"[[scenario:{name}]]"


def load_tokenizer(gguf_path: str):
    """SmolLM2's tokenizer from its GGUF file, as tokenloom's GGUF load format builds it."""
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    return GGUFLoadFormat().load_tokenizer(gguf_path, None)


def write_model_dir(directory: str, tokenizer, scenarios: dict[str, str]) -> str:
    """Create the model directory for ``scenarios`` (name -> response text) with
    ``tokenizer`` (see :func:`load_tokenizer`); returns it."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    config = {
        "architectures": ["ScriptedForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "dtype": "float32",
    }
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as config_file:
        json.dump(config, config_file, indent=2)
    table = {
        "response_start_ids": ids(RESPONSE_START),
        "scenarios": {
            name: {"marker_ids": ids(marker(name)), "response_ids": ids(text)} for name, text in scenarios.items()
        },
    }
    with open(os.path.join(directory, "scenarios.json"), "w", encoding="utf-8") as scenario_file:
        json.dump(table, scenario_file, ensure_ascii=False)
    save_file({"logit_margin": torch.tensor([LOGIT_MARGIN])}, os.path.join(directory, "model.safetensors"))
    return directory
