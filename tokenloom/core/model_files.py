"""Interfaces that turn a model tag into files and files into config, tokenizer and weights:
:class:`ModelSource` (tag -> local path) and :class:`LoadFormat` (path -> the rest).
Implementations are plugins."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ResolvedModel:
    """A model tag resolved to local files."""

    path: str  # a directory or a single file (e.g. a .gguf)
    name: str  # a display name for these files (logs); not the served name (--served-model-name, else the tag)
    source: str  # the model source plugin that resolved it
    load_format: str | None = None  # a hint, e.g. "gguf" for a .gguf file


class ModelSource:
    """Turns a model tag into local files. Registered with ``register_model_sources``.

    Called in the main process at start-up: ``matches`` on each source in registration order,
    then ``resolve`` on the first that matches.
    """

    def matches(self, model: str) -> bool:
        """True when this source recognises ``model``."""
        raise NotImplementedError

    def resolve(self, model: str, *, revision: str | None = None, download_dir: str | None = None) -> ResolvedModel:
        """Local files for ``model``; raise ModelLoadError with what to do when impossible."""
        raise NotImplementedError


class LoadFormat:
    """Reads config, tokenizer and weights from local model files.

    Registered with ``register_load_formats``. ``can_load``, ``load_config`` and
    ``load_tokenizer`` run in the main process; ``iterate_weights`` runs in the worker.
    """

    #: the model architectures the format reads, by its own name for each -> the registered
    #: architecture it loads as (``gguf``: llama.cpp's ``{"llama": "LlamaForCausalLM", ...}``);
    #: None: any architecture, under the name the files' config gives. ``tokenloom models`` shows it.
    architecture_names: ClassVar[dict[str, str] | None] = None

    def can_load(self, path: str) -> bool:
        """True when this format can read the files at ``path`` (for ``--load-format auto``)."""
        raise NotImplementedError

    def load_config(self, path: str, model_config: Any) -> Any:
        """The model's ``transformers.PretrainedConfig``."""
        raise NotImplementedError

    def load_tokenizer(self, path: str, model_config: Any) -> Any:
        """A ``transformers`` tokenizer (with ``chat_template`` when the files carry one)."""
        raise NotImplementedError

    def quantization(self, path: str) -> str | None:
        """The quantization method the weights need (e.g. "gguf"), or None."""
        return None

    def generation_defaults(self, path: str) -> dict[str, Any]:
        """The request defaults the files recommend (``--generation-config auto``), under
        SamplingParams' names: temperature, top_p, top_k, min_p, repetition_penalty, and
        max_tokens (generation_config.json's max_new_tokens). Runs in the main process; a
        format whose files state none keeps this default, ``{}``."""
        return {}

    def iterate_weights(self, path: str, model_config: Any, load_config: Any) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_parameter_name, tensor)`` one at a time (never all in memory)."""
        raise NotImplementedError
