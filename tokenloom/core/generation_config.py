"""The request defaults a model's generation config puts in force (vLLM's
``--generation-config auto|vllm|PATH`` and ``--override-generation-config``).

A model's authors state recommended sampling settings in ``generation_config.json`` (or a
GGUF's ``general.sampling.*`` keys, read by its load format). Requests that leave
temperature, top_p, top_k, min_p or repetition_penalty unset take them, and
``max_new_tokens`` caps every request's ``max_tokens``. The result is a plain dict under
SamplingParams' names (``max_new_tokens`` becomes ``max_tokens``), resolved once at start-up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from tokenloom.errors import ConfigError, ModelLoadError

# generation_config.json keys that are request defaults -> SamplingParams' names
HF_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FILE_NAME = "generation_config.json"
AUTO = "auto"  # the model's own files
NONE = "vllm"  # vLLM's name for "ignore the model's defaults"


def read_generation_config_json(folder: str) -> dict[str, Any]:
    """``{SamplingParams field: value}`` from ``folder/generation_config.json``; empty when
    the file is absent, ModelLoadError when it cannot be read."""
    config_path = os.path.join(folder, FILE_NAME)
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(values, dict):
        raise ModelLoadError(f"{config_path} does not hold a JSON object")
    return {name: values[key] for key, name in HF_KEYS.items() if values.get(key) is not None}


def check_override(override: dict[str, Any] | None) -> None:
    """``--override-generation-config`` keys are ones that set a request default, with a
    number for a value: anything else would be dropped silently, so it is refused."""
    for key, value in (override or {}).items():
        if key not in HF_KEYS:
            raise ConfigError(
                f"--override-generation-config: {key!r} is not a request default tokenloom applies; "
                f"known keys: {', '.join(HF_KEYS)}",
                param="override-generation-config",
            )
        _check_value(key, value, "--override-generation-config", ConfigError)


def check_generation_config_choice(choice: str) -> None:
    """``auto``, ``vllm`` or an existing folder (checked before the model loads)."""
    if choice in (AUTO, NONE):
        return
    if not os.path.isdir(choice):
        raise ConfigError(
            f"--generation-config: {choice!r} is neither auto, vllm nor an existing folder "
            f"(a folder holding {FILE_NAME})",
            param="generation-config",
        )


def resolve_generation_defaults(
    choice: str, override: dict[str, Any] | None, model_defaults: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The request defaults in force, under SamplingParams' names: the model's (``auto``,
    ``model_defaults()``), none (``vllm``) or a folder's; then the override on top."""
    check_generation_config_choice(choice)
    check_override(override)
    if choice == AUTO:
        defaults = dict(model_defaults())
        source = "the model's files"
    elif choice == NONE:
        defaults = {}
        source = ""
    else:
        defaults = read_generation_config_json(choice)
        source = os.path.join(choice, FILE_NAME)
    for name, value in defaults.items():
        key = next(key for key, field in HF_KEYS.items() if field == name)
        _check_value(key, value, source, ModelLoadError)
    defaults.update({HF_KEYS[key]: value for key, value in (override or {}).items()})
    return defaults


def _check_value(key: str, value: Any, source: str, error: type[Exception]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{source}: {key} must be a number, got {value!r}")
    if key in ("top_k", "max_new_tokens") and value != int(value):
        raise error(f"{source}: {key} must be a whole number, got {value!r}")
    if key == "max_new_tokens" and value < 1:
        raise error(f"{source}: max_new_tokens must be at least 1, got {value!r}")
