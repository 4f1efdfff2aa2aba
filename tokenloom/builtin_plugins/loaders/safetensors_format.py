"""The ``safetensors`` load format: a Hugging Face model directory (single file or sharded with
``model.safetensors.index.json``), or one ``.safetensors`` file next to its ``config.json``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from tokenloom.builtin_plugins.loaders import hf_files
from tokenloom.plugin_api import ModelLoadError

EXTENSIONS = (".safetensors",)
INDEX_NAMES = ("model.safetensors.index.json",)


class SafetensorsLoadFormat(hf_files.HfDirectoryFormat):
    """Weights are memory-mapped and yielded one tensor at a time."""

    def can_load(self, path: str) -> bool:
        if os.path.isfile(path):
            return path.endswith(EXTENSIONS)
        return os.path.isdir(path) and any(name.endswith(EXTENSIONS) for name in os.listdir(path))

    def iterate_weights(self, path: str, model_config: Any, load_config: Any) -> Iterator[tuple[str, Any]]:
        from safetensors import SafetensorError, safe_open

        files = hf_files.weight_files(path, EXTENSIONS, INDEX_NAMES, getattr(load_config, "ignore_patterns", None))
        if not files:
            raise ModelLoadError(f"no .safetensors files in {path} (after --ignore-patterns)")
        for file in hf_files.with_progress(
            files, load_config, total=len(files), description="loading safetensors shards", unit="shard"
        ):
            try:
                with safe_open(file, framework="pt", device="cpu") as shard:
                    for name in shard.keys():
                        yield name, shard.get_tensor(name)
            except SafetensorError as exc:
                raise ModelLoadError(
                    f"safetensors file {file} is truncated or corrupt ({exc}); download the model again"
                ) from exc
            except OSError as exc:
                raise ModelLoadError(f"cannot read safetensors file {file}: {exc}") from exc
