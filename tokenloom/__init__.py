"""tokenloom: a plugin-architected LLM inference and serving engine.

``from tokenloom import LLM, SamplingParams`` is the offline API (imported lazily, so that
``import tokenloom`` stays cheap and registers nothing).
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tokenloom.llm",
    "SamplingParams": "tokenloom.core.sampling_params",
    "RequestOutput": "tokenloom.core.outputs",
    "CompletionOutput": "tokenloom.core.outputs",
    "PoolingParams": "tokenloom.core.sampling_params",
    "PoolingRequestOutput": "tokenloom.core.outputs",
    "EngineArgs": "tokenloom.core.config",
    "BeamSearchParams": "tokenloom.core.beam_search",
    "AsyncLLM": "tokenloom.core.engine",
    "LLMEngine": "tokenloom.core.engine",
    "LoRARequest": "tokenloom.lora.request",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")
