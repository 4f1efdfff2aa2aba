"""The one stable import surface for plugin authors: hook markers, decorators, and the
interface of every plugin kind. Internal modules may move; the names here do not. A model
plugin's model file imports its layers from :mod:`tokenloom.model_api` (which imports torch).

Importing this module is cheap: interfaces that need torch are imported on first access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tokenloom.plugins.hookspecs import Register, hookimpl
from tokenloom.plugins.manager import REGISTRATION_MARK

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and editors
    from tokenloom.api.protocol import ChatCompletionRequest
    from tokenloom.core.batch import AttentionMetadata, ModelRunnerOutput, SchedulerOutput
    from tokenloom.core.byte_level import bytes_to_unicode
    from tokenloom.core.executor import Executor, WorkerSpec
    from tokenloom.core.generation_config import read_generation_config_json
    from tokenloom.core.kv_connector import KVBlockCorruptError, KVConnector, KVConnectorContext
    from tokenloom.core.logits_processors import LogitsProcessor
    from tokenloom.core.model_files import LoadFormat, ModelSource, ResolvedModel
    from tokenloom.core.model_interface import IntermediateTensors, KVCacheSpec, ModelContext, ModelProtocol
    from tokenloom.core.multimodal.inputs import MultiModalItem
    from tokenloom.core.multimodal.mrope import MROPE_GRID
    from tokenloom.core.multimodal.processor import (
        ImageEmbeddings,
        MultiModalProcessor,
        PlaceholderExpansion,
        ProcessedPrompt,
        ProcessorContext,
        image_hash,
        splice_placeholders,
    )
    from tokenloom.core.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from tokenloom.core.parsers import (
        DeltaMessage,
        ExtractedToolCalls,
        ParserRequest,
        ParserTokenizer,
        ReasoningParser,
        RequestT,
        ToolCall,
        ToolCallDelta,
        ToolParser,
        find_first_marker,
        keep_special_tokens,
        partial_marker_length,
    )
    from tokenloom.core.platform import Platform
    from tokenloom.core.sampling_params import PoolingParams, SamplingParams
    from tokenloom.core.spec_decode.proposer import Draft, DraftRequest, Proposer, ProposerSpec
    from tokenloom.core.structured_output_backend import (
        Matcher,
        StructuredOutputBackend,
        allocate_bitmask,
        set_allowed_tokens,
    )
    from tokenloom.core.structured_output_compile import compile_cancelled
    from tokenloom.core.structured_output_constraints import BackendOptions, Constraint
    from tokenloom.errors import InvalidRequestError, ModelLoadError, PluginError
    from tokenloom.layers.quantization import (
        ParameterLayout,
        QuantizationConfig,
        QuantizationMethod,
        UnquantizedMethod,
        add_parameter,
    )
    from tokenloom.parsing.reasoning_markers import MarkedReasoningParser
    from tokenloom.parsing.tool_sections import (
        NEED_MORE,
        ParsedCall,
        Section,
        SectionToolParser,
        arguments_json,
        call_from_object,
        calls_from_array,
        json_array_section,
        json_object_section,
        json_value_end,
        load_json,
        skip_whitespace,
    )

_LAZY = {
    # interfaces
    "Platform": "tokenloom.core.platform",
    "Executor": "tokenloom.core.executor",
    "WorkerSpec": "tokenloom.core.executor",
    "Proposer": "tokenloom.core.spec_decode.proposer",
    "KVConnector": "tokenloom.core.kv_connector",
    "KVConnectorContext": "tokenloom.core.kv_connector",
    "KVBlockCorruptError": "tokenloom.core.kv_connector",
    "ProposerSpec": "tokenloom.core.spec_decode.proposer",
    "DraftRequest": "tokenloom.core.spec_decode.proposer",
    "Draft": "tokenloom.core.spec_decode.proposer",
    "ModelSource": "tokenloom.core.model_files",
    "ResolvedModel": "tokenloom.core.model_files",
    "LoadFormat": "tokenloom.core.model_files",
    "ModelProtocol": "tokenloom.core.model_interface",
    "ModelContext": "tokenloom.core.model_interface",
    "KVCacheSpec": "tokenloom.core.model_interface",
    "IntermediateTensors": "tokenloom.core.model_interface",
    "MultiModalProcessor": "tokenloom.core.multimodal.processor",
    "ProcessorContext": "tokenloom.core.multimodal.processor",
    "ProcessedPrompt": "tokenloom.core.multimodal.processor",
    "image_hash": "tokenloom.core.multimodal.processor",
    "ImageEmbeddings": "tokenloom.core.multimodal.processor",
    "PlaceholderExpansion": "tokenloom.core.multimodal.processor",
    "splice_placeholders": "tokenloom.core.multimodal.processor",
    "MultiModalItem": "tokenloom.core.multimodal.inputs",
    "MROPE_GRID": "tokenloom.core.multimodal.mrope",
    "QuantizationConfig": "tokenloom.layers.quantization",
    "QuantizationMethod": "tokenloom.layers.quantization",
    "UnquantizedMethod": "tokenloom.layers.quantization",
    "ParameterLayout": "tokenloom.layers.quantization",
    "add_parameter": "tokenloom.layers.quantization",
    "StructuredOutputBackend": "tokenloom.core.structured_output_backend",
    "LogitsProcessor": "tokenloom.core.logits_processors",
    "Matcher": "tokenloom.core.structured_output_backend",
    "Constraint": "tokenloom.core.structured_output_constraints",
    "BackendOptions": "tokenloom.core.structured_output_constraints",
    "compile_cancelled": "tokenloom.core.structured_output_compile",
    "allocate_bitmask": "tokenloom.core.structured_output_backend",
    "set_allowed_tokens": "tokenloom.core.structured_output_backend",
    # what load formats and guided-decoding backends share with the core: GPT-2's byte-level
    # alphabet, generation_config.json's sampling defaults
    "bytes_to_unicode": "tokenloom.core.byte_level",
    "read_generation_config_json": "tokenloom.core.generation_config",
    "ToolParser": "tokenloom.core.parsers",
    "ReasoningParser": "tokenloom.core.parsers",
    "ParserTokenizer": "tokenloom.core.parsers",
    "ParserRequest": "tokenloom.core.parsers",
    "ToolCall": "tokenloom.core.parsers",
    "ToolCallDelta": "tokenloom.core.parsers",
    "ExtractedToolCalls": "tokenloom.core.parsers",
    "DeltaMessage": "tokenloom.core.parsers",
    "RequestT": "tokenloom.core.parsers",
    # what the built-in parsers are made of: streaming text helpers and their base classes
    "partial_marker_length": "tokenloom.core.parsers",
    "find_first_marker": "tokenloom.core.parsers",
    "keep_special_tokens": "tokenloom.core.parsers",
    "SectionToolParser": "tokenloom.parsing.tool_sections",
    "Section": "tokenloom.parsing.tool_sections",
    "ParsedCall": "tokenloom.parsing.tool_sections",
    "NEED_MORE": "tokenloom.parsing.tool_sections",
    "json_value_end": "tokenloom.parsing.tool_sections",
    "arguments_json": "tokenloom.parsing.tool_sections",
    "json_object_section": "tokenloom.parsing.tool_sections",
    "json_array_section": "tokenloom.parsing.tool_sections",
    "call_from_object": "tokenloom.parsing.tool_sections",
    "calls_from_array": "tokenloom.parsing.tool_sections",
    "load_json": "tokenloom.parsing.tool_sections",
    "skip_whitespace": "tokenloom.parsing.tool_sections",
    "MarkedReasoningParser": "tokenloom.parsing.reasoning_markers",
    "ChatCompletionRequest": "tokenloom.api.protocol",
    # data that crosses boundaries
    "SamplingParams": "tokenloom.core.sampling_params",
    "RequestOutput": "tokenloom.core.outputs",
    "CompletionOutput": "tokenloom.core.outputs",
    "PoolingParams": "tokenloom.core.sampling_params",
    "PoolingRequestOutput": "tokenloom.core.outputs",
    "SchedulerOutput": "tokenloom.core.batch",
    "ModelRunnerOutput": "tokenloom.core.batch",
    "AttentionMetadata": "tokenloom.core.batch",
    # errors
    "InvalidRequestError": "tokenloom.errors",
    "ModelLoadError": "tokenloom.errors",
    "PluginError": "tokenloom.errors",
}

# every name below, spelled out so that linters and type checkers see the re-exports
__all__ = [
    "Register",
    "hookimpl",
    "register_reasoning_parser",
    "register_tool_parser",
    "Platform",
    "Executor",
    "WorkerSpec",
    "Proposer",
    "ProposerSpec",
    "KVConnector",
    "KVConnectorContext",
    "KVBlockCorruptError",
    "DraftRequest",
    "Draft",
    "ModelSource",
    "ResolvedModel",
    "LoadFormat",
    "ModelProtocol",
    "ModelContext",
    "KVCacheSpec",
    "IntermediateTensors",
    "MultiModalProcessor",
    "ProcessorContext",
    "ProcessedPrompt",
    "image_hash",
    "ImageEmbeddings",
    "PlaceholderExpansion",
    "splice_placeholders",
    "MultiModalItem",
    "MROPE_GRID",
    "QuantizationConfig",
    "QuantizationMethod",
    "UnquantizedMethod",
    "ParameterLayout",
    "add_parameter",
    "StructuredOutputBackend",
    "LogitsProcessor",
    "Matcher",
    "Constraint",
    "BackendOptions",
    "compile_cancelled",
    "allocate_bitmask",
    "set_allowed_tokens",
    "bytes_to_unicode",
    "read_generation_config_json",
    "ToolParser",
    "ReasoningParser",
    "ParserTokenizer",
    "ParserRequest",
    "ToolCall",
    "ToolCallDelta",
    "ExtractedToolCalls",
    "DeltaMessage",
    "RequestT",
    "partial_marker_length",
    "find_first_marker",
    "keep_special_tokens",
    "SectionToolParser",
    "Section",
    "ParsedCall",
    "NEED_MORE",
    "json_value_end",
    "arguments_json",
    "json_object_section",
    "json_array_section",
    "call_from_object",
    "calls_from_array",
    "load_json",
    "skip_whitespace",
    "MarkedReasoningParser",
    "ChatCompletionRequest",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "SchedulerOutput",
    "ModelRunnerOutput",
    "AttentionMetadata",
    "InvalidRequestError",
    "ModelLoadError",
    "PluginError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenloom.plugin_api' has no attribute {name!r}")


ClassT = TypeVar("ClassT", bound=type)


def _mark(kind: str, name: str, **options: Any) -> Callable[[ClassT], ClassT]:
    if not isinstance(name, str) or not name:
        # the likely slip: ``@register_tool_parser`` with no parentheses passes the class as the name
        what = f"the class {name.__qualname__}" if isinstance(name, type) else repr(name)
        raise TypeError(
            f"@register_{kind}(name) needs the name the flag will choose, e.g. "
            f'@register_{kind}("my_{kind}"); it got {what}'
        )

    def decorate(cls: ClassT) -> ClassT:
        # the class's own marks only, never a base class's (vars, not getattr)
        marks = list(vars(cls).get(REGISTRATION_MARK, ()))
        marks.append((kind, name, options))
        setattr(cls, REGISTRATION_MARK, tuple(marks))
        return cls

    return decorate


def register_tool_parser(name: str, **options: Any) -> Callable[[ClassT], ClassT]:
    """Class decorator for a ``--tool-parser-plugin`` file: registers the parser under ``name``
    when the file is loaded as a plugin (marking only: nothing happens at import)."""
    return _mark("tool_parser", name, **options)


def register_reasoning_parser(name: str, **options: Any) -> Callable[[ClassT], ClassT]:
    """Class decorator: registers a reasoning parser under ``name`` when its file or module is
    loaded as a plugin."""
    return _mark("reasoning_parser", name, **options)
