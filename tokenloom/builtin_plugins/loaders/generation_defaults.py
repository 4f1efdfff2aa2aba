"""Default sampling parameters a model's files carry (for ``--generation-config auto``):
``generation_config.json`` in a Hugging Face directory, ``general.sampling.*`` in a GGUF file.

The chat template travels with the tokenizer (``tokenizer.chat_template``), not here.
"""

from __future__ import annotations

from typing import Any

from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile, find_gguf_file
from tokenloom.builtin_plugins.loaders.hf_files import model_directory
from tokenloom.plugin_api import read_generation_config_json

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
    return read_generation_config_json(model_directory(path))


def _plain(value: Any) -> Any:
    # float32 metadata (e.g. 0.7) read back as 0.699999988; round to what the author wrote
    return round(value, 6) if isinstance(value, float) else value
