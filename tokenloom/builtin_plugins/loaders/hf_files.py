"""Helpers shared by the Hugging Face directory formats (safetensors, pt, dummy): config and
tokenizer from a local directory (never the network), ``--hf-overrides``, choosing weight
files (shard index, ``--ignore-patterns``), and the load progress bar; :class:`HfDirectoryFormat`
is the base of the formats that read a Hugging Face checkpoint's weights.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from tokenloom.errors import ModelLoadError
from tokenloom.plugin_api import LoadFormat


def model_directory(path: str) -> str:
    """The directory holding a model's config: ``path`` itself, or the directory of a file."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def apply_hf_overrides(config: Any, overrides: dict[str, Any] | None) -> Any:
    """Set ``--hf-overrides`` values on ``config``; a dict given for a nested config updates it."""
    for key, value in (overrides or {}).items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)
    return config


def load_hf_config(path: str, model_config: Any) -> Any:
    """``AutoConfig`` from the local directory, with ``--hf-overrides`` applied."""
    from transformers import AutoConfig

    directory = model_directory(path)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ModelLoadError(f"no config.json in {directory}: a Hugging Face model directory needs one")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for bad configs
        raise ModelLoadError(
            f"cannot read {os.path.join(directory, 'config.json')}: {type(exc).__name__}: {exc}"
        ) from exc
    return apply_hf_overrides(config, getattr(model_config, "hf_overrides", None))


def load_hf_tokenizer(path: str, model_config: Any) -> Any:
    """``AutoTokenizer`` from ``--tokenizer`` or the model directory (``--tokenizer-mode slow``
    asks for the slow tokenizer)."""
    from transformers import AutoTokenizer

    directory = getattr(model_config, "tokenizer", None) or model_directory(path)
    if not os.path.isdir(directory):
        raise ModelLoadError(
            f"tokenizer directory {directory} does not exist; pass --tokenizer with a local tokenizer directory"
        )
    use_fast = getattr(model_config, "tokenizer_mode", "auto") != "slow"
    try:
        return AutoTokenizer.from_pretrained(
            directory, use_fast=use_fast, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises many kinds for missing/broken tokenizer files
        raise ModelLoadError(f"cannot load a tokenizer from {directory}: {type(exc).__name__}: {exc}") from exc


def is_ignored(relative_path: str, ignore_patterns: Iterable[str] | None) -> bool:
    return any(fnmatch.fnmatch(relative_path, pattern) for pattern in ignore_patterns or ())


def weight_files(
    path: str, extensions: tuple[str, ...], index_names: tuple[str, ...], ignore_patterns: Iterable[str] | None = None
) -> list[str]:
    """The weight files of a model: ``path`` itself if it is one; else the shards named by an index
    file (e.g. ``model.safetensors.index.json``); else every top-level file with one of
    ``extensions``. ``ignore_patterns`` are fnmatch globs on paths relative to the directory."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path} does not exist")
    for index_name in index_names:
        index_path = os.path.join(path, index_name)
        if os.path.isfile(index_path):
            shards = _shards_from_index(index_path)
            files = [os.path.join(path, shard) for shard in shards if not is_ignored(shard, ignore_patterns)]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise ModelLoadError(
                    f"{index_path} names weight files that are missing: {', '.join(sorted(missing))}; "
                    "download the model again"
                )
            return files
    return sorted(
        os.path.join(path, name)
        for name in os.listdir(path)
        if name.endswith(extensions)
        and os.path.isfile(os.path.join(path, name))
        and not is_ignored(name, ignore_patterns)
    )


def _shards_from_index(index_path: str) -> list[str]:
    try:
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read the shard index {index_path}: {type(exc).__name__}: {exc}") from exc


def with_progress(
    items: Iterable[Any], load_config: Any, *, total: int | None, description: str, unit: str = "tensor"
) -> Iterator[Any]:
    """``items``, under a tqdm bar when ``--use-tqdm-on-load`` is on."""
    if not getattr(load_config, "use_tqdm_on_load", False):
        yield from items
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=description, unit=unit, leave=False) as bar:
        for item in items:
            yield item
            bar.update(1)


class HfDirectoryFormat(LoadFormat):
    """A format of a Hugging Face checkpoint (safetensors, pt): config, tokenizer and
    generation defaults come from the model's directory the same way whatever its weight files;
    a subclass says which files it can load and how it reads their tensors."""

    def load_config(self, path: str, model_config: Any) -> Any:
        return load_hf_config(path, model_config)

    def load_tokenizer(self, path: str, model_config: Any) -> Any:
        return load_hf_tokenizer(path, model_config)

    def generation_defaults(self, path: str) -> dict[str, Any]:
        # imported here: generation_defaults imports this module
        from tokenloom.builtin_plugins.loaders.generation_defaults import generation_defaults

        return generation_defaults(path)
