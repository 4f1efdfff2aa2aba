"""The ``local`` model source: a model directory or a single model file (e.g. ``.gguf``) on disk."""

from __future__ import annotations

import os

from tokenloom.plugin_api import ModelLoadError, ModelSource, ResolvedModel

MODEL_FILE_EXTENSIONS = (".gguf", ".safetensors", ".bin", ".pt")


def looks_like_path(model: str) -> bool:
    """True for tags that can only mean a file: absolute, ``./``, ``../``, ``~`` or a model file name."""
    return (
        os.path.isabs(model)
        or model.startswith(("./", "../", "~", ".\\", "..\\"))
        or model.endswith(MODEL_FILE_EXTENSIONS)
    )


class LocalModelSource(ModelSource):
    """Matches any existing path, and anything spelled like a path (so a typo gets a clear
    "does not exist" rather than a Hub lookup)."""

    def matches(self, model: str) -> bool:
        return os.path.exists(os.path.expanduser(model)) or looks_like_path(model)

    def resolve(self, model, *, revision=None, download_dir=None) -> ResolvedModel:
        path = os.path.abspath(os.path.expanduser(model))
        if not os.path.exists(path):
            raise ModelLoadError(f"model path {path} does not exist; pass an existing directory or .gguf file")
        load_format = "gguf" if os.path.isfile(path) and path.endswith(".gguf") else None
        return ResolvedModel(path=path, name=model, source="local", load_format=load_format)
