"""Fixtures of the engine's parts: the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    return GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
