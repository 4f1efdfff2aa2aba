"""``example``: the model source for tags ``example:NAME``.

``NAME`` is looked up in the directories listed in ``TOKENLOOM_EXAMPLE_MODELS`` (separated by
``os.pathsep``), in order: a directory ``NAME`` (Hugging Face layout) or a file ``NAME.gguf``.
"""

from __future__ import annotations

import os

from tokenloom.plugin_api import ModelLoadError, ModelSource, ResolvedModel

PREFIX = "example:"
MODELS_ENV = "TOKENLOOM_EXAMPLE_MODELS"


def model_directories() -> list[str]:
    return [directory for directory in os.environ.get(MODELS_ENV, "").split(os.pathsep) if directory]


class ExampleModelSource(ModelSource):
    def matches(self, model: str) -> bool:
        return model.startswith(PREFIX)

    def resolve(self, model: str, *, revision: str | None = None, download_dir: str | None = None) -> ResolvedModel:
        name = model[len(PREFIX) :]
        if not name or os.sep in name or name in (".", ".."):
            raise ModelLoadError(f"{model!r}: write example:NAME, where NAME is a model in ${MODELS_ENV}")
        directories = model_directories()
        if not directories:
            raise ModelLoadError(f"{model!r}: set {MODELS_ENV} to the directory that holds {name!r}")
        for directory in directories:
            candidate = os.path.join(directory, name)
            if os.path.isdir(candidate):
                return ResolvedModel(path=candidate, name=name, source="example")
            if os.path.isfile(candidate + ".gguf"):
                return ResolvedModel(path=candidate + ".gguf", name=name, source="example", load_format="gguf")
        available = sorted(
            entry.removesuffix(".gguf")
            for directory in directories
            if os.path.isdir(directory)
            for entry in os.listdir(directory)
            if os.path.isdir(os.path.join(directory, entry)) or entry.endswith(".gguf")
        )
        raise ModelLoadError(
            f"{model!r}: no directory {name!r} or file {name}.gguf in {MODELS_ENV} ({os.pathsep.join(directories)}); "
            f"available: {', '.join(available) or 'none'}"
        )
