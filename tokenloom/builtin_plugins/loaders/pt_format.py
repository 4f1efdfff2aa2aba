"""The ``pt`` load format: PyTorch pickles (``*.bin`` / ``*.pt``, sharded with
``pytorch_model.bin.index.json``), read with ``torch.load(weights_only=True, mmap=True)``."""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Iterator
from typing import Any

from tokenloom.builtin_plugins.loaders import hf_files
from tokenloom.plugin_api import ModelLoadError

EXTENSIONS = (".bin", ".pt", ".pth")
INDEX_NAMES = ("pytorch_model.bin.index.json", "model.pt.index.json")


class PtLoadFormat(hf_files.HfDirectoryFormat):
    """Only tensors are unpickled (``weights_only``); memory-mapped when the file allows it."""

    def can_load(self, path: str) -> bool:
        if os.path.isfile(path):
            return path.endswith(EXTENSIONS)
        if not os.path.isdir(path):
            return False
        names = os.listdir(path)
        # a directory with safetensors too is the safetensors format's: the same weights, safer to read
        return any(n.endswith(EXTENSIONS) for n in names) and not any(n.endswith(".safetensors") for n in names)

    def iterate_weights(self, path: str, model_config: Any, load_config: Any) -> Iterator[tuple[str, Any]]:
        import torch

        files = hf_files.weight_files(path, EXTENSIONS, INDEX_NAMES, getattr(load_config, "ignore_patterns", None))
        files = [f for f in files if os.path.basename(f) != "training_args.bin"]
        if not files:
            raise ModelLoadError(f"no .bin/.pt weight files in {path} (after --ignore-patterns)")
        for file in hf_files.with_progress(
            files, load_config, total=len(files), description="loading pt shards", unit="shard"
        ):
            state_dict = _load_state_dict(torch, file)
            for name in list(state_dict):
                # popped so a shard's tensors are released as they are consumed
                yield name, state_dict.pop(name)


def _load_state_dict(torch, file: str) -> dict:
    try:
        try:
            state_dict = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # files in torch's legacy (pre-zip) format cannot be memory-mapped
            state_dict = torch.load(file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(
            f"cannot read PyTorch weight file {file} ({type(exc).__name__}: {exc}); "
            "it is truncated, corrupt or not a state dict of tensors"
        ) from exc
    if isinstance(state_dict, dict) and isinstance(state_dict.get("state_dict"), dict):
        state_dict = state_dict["state_dict"]
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ModelLoadError(f"PyTorch weight file {file} does not hold a dict of tensors")
    return state_dict
