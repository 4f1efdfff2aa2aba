"""The one stable import surface for plugin authors: hook markers, decorators, and the
interface of every plugin kind. Internal modules may move; the names here do not.

Importing this module is cheap: interfaces that need torch are imported on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from tokenloom.plugins.hookspecs import hookimpl
from tokenloom.plugins.manager import REGISTRATION_MARK

_LAZY = {
    # interfaces
    "Platform": "tokenloom.core.platform",
    "Executor": "tokenloom.core.executor",
    "ModelSource": "tokenloom.core.model_files",
    "ResolvedModel": "tokenloom.core.model_files",
    "LoadFormat": "tokenloom.core.model_files",
    "ModelProtocol": "tokenloom.core.model_interface",
    "ModelContext": "tokenloom.core.model_interface",
    "KVCacheSpec": "tokenloom.core.model_interface",
    "QuantizationMethod": "tokenloom.layers.quantization",
    "StructuredOutputBackend": "tokenloom.core.structured_output",
    "Matcher": "tokenloom.core.structured_output",
    "Constraint": "tokenloom.core.structured_output",
    "BackendOptions": "tokenloom.core.structured_output",
    "ToolParser": "tokenloom.api.parsers",
    "ReasoningParser": "tokenloom.api.parsers",
    "ToolCall": "tokenloom.api.parsers",
    "ToolCallDelta": "tokenloom.api.parsers",
    "ExtractedToolCalls": "tokenloom.api.parsers",
    "DeltaMessage": "tokenloom.api.parsers",
    # data that crosses boundaries
    "SamplingParams": "tokenloom.core.request",
    "RequestOutput": "tokenloom.core.request",
    "CompletionOutput": "tokenloom.core.request",
    "PoolingParams": "tokenloom.core.request",
    "PoolingRequestOutput": "tokenloom.core.request",
    "SchedulerOutput": "tokenloom.core.batch",
    "ModelRunnerOutput": "tokenloom.core.batch",
    "AttentionMetadata": "tokenloom.core.batch",
    # errors
    "InvalidRequestError": "tokenloom.errors",
    "ModelLoadError": "tokenloom.errors",
    "PluginError": "tokenloom.errors",
}

__all__ = ["hookimpl", "register_tool_parser", "register_reasoning_parser", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenloom.plugin_api' has no attribute {name!r}")


def _mark(kind: str, name: str, **options):
    def decorate(cls):
        # the class's own marks only, never a base class's (vars, not getattr)
        marks = list(vars(cls).get(REGISTRATION_MARK, ()))
        marks.append((kind, name, options))
        setattr(cls, REGISTRATION_MARK, tuple(marks))
        return cls

    return decorate


def register_tool_parser(name: str, **options):
    """Class decorator for a ``--tool-parser-plugin`` file: registers the parser under ``name``
    when the file is loaded as a plugin (marking only: nothing happens at import)."""
    return _mark("tool_parser", name, **options)


def register_reasoning_parser(name: str, **options):
    """Class decorator: registers a reasoning parser under ``name`` when its file or module is
    loaded as a plugin."""
    return _mark("reasoning_parser", name, **options)
