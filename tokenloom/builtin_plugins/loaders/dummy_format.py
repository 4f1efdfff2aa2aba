"""The ``dummy`` load format (``--load-format dummy``): the real config and tokenizer of the
model's files, but no weights, for profiling without reading a checkpoint.

``iterate_weights`` yields nothing and ``initializes_randomly`` is True: the model runner is
expected to fill the parameters with small seeded random values (``--seed``). Never chosen by
``--load-format auto``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenloom.plugin_api import LoadFormat, ModelLoadError


class DummyLoadFormat(LoadFormat):
    """Config and tokenizer from the real files, random weights; see the module docstring."""

    initializes_randomly = True
    auto_selectable = False

    def can_load(self, path: str) -> bool:
        return False  # only ever chosen by name

    def delegate(self, path: str) -> LoadFormat:
        """The real format that reads the files at ``path``: GGUF, safetensors, then .pt, tried in
        that order (imported here: the dummy format alone must not import their readers)."""
        from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
        from tokenloom.builtin_plugins.loaders.pt_format import PtLoadFormat
        from tokenloom.builtin_plugins.loaders.safetensors_format import SafetensorsLoadFormat

        for format_class in (GGUFLoadFormat, SafetensorsLoadFormat, PtLoadFormat):
            load_format = format_class()
            if load_format.can_load(path):
                return load_format
        raise ModelLoadError(
            f"--load-format dummy still reads the model's config and tokenizer, but no format can read {path} "
            "(expected a .gguf file or a Hugging Face directory with config.json)"
        )

    def load_config(self, path: str, model_config: Any) -> Any:
        return self.delegate(path).load_config(path, model_config)

    def load_tokenizer(self, path: str, model_config: Any) -> Any:
        return self.delegate(path).load_tokenizer(path, model_config)

    def quantization(self, path: str) -> str | None:
        return None  # random weights are dense, whatever the files hold

    def generation_defaults(self, path: str) -> dict[str, Any]:
        return self.delegate(path).generation_defaults(path)

    def iterate_weights(self, path: str, model_config: Any, load_config: Any) -> Iterator[tuple[str, Any]]:
        return iter(())
