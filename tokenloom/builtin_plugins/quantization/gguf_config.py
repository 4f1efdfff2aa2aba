"""The ``gguf`` quantization plugin's config: every linear layer of a GGUF model gets the one
:class:`~tokenloom.builtin_plugins.quantization.gguf.GGUFQuantizationMethod` (which decides per
tensor, by its GGML type, what to keep); the file's tensor types are the checkpoint's own
description, so there is nothing to parse."""

from __future__ import annotations

from tokenloom.builtin_plugins.quantization.gguf import GGUFQuantizationMethod
from tokenloom.layers.quantization import QuantizationConfig, QuantizationMethod


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self) -> None:
        self._method: QuantizationMethod | None = None

    def get_method(self, layer, prefix, shard_prefixes):
        if self._method is None:
            self._method = GGUFQuantizationMethod()
            self._method.exact_dtype = self.exact_dtype
        return self._method
