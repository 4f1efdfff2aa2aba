"""Default sampling parameters a model's files carry (for ``--generation-config auto``):
``generation_config.json`` in a Hugging Face directory, ``general.sampling.*`` in a GGUF file.

The chat template travels with the tokenizer (``tokenizer.chat_template``), not here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile, find_gguf_file
from tokenloom.builtin_plugins.loaders.hf_files import model_directory
from tokenloom.errors import ModelLoadError

# generation_config.json keys that are sampling defaults, under SamplingParams' names
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp's general.sampling.* keys
GGUF_KEYS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def generation_defaults(path: str) -> dict[str, Any]:
    """``{SamplingParams field: value}`` stated by the model at ``path``; empty when none."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        gguf = GGUFFile(gguf_file)
        values = {name: gguf.get(f"general.sampling.{key}") for key, name in GGUF_KEYS.items()}
        return {name: _plain(value) for name, value in values.items() if value is not None}
    config_path = os.path.join(model_directory(path), "generation_config.json")
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    return {name: values[key] for key, name in HF_KEYS.items() if values.get(key) is not None}


def _plain(value: Any) -> Any:
    # float32 metadata (e.g. 0.7) read back as 0.699999988; round to what the author wrote
    return round(value, 6) if isinstance(value, float) else value
