"""Interfaces of the server-side output parsers: :class:`ToolParser` (tool calls out of the
model's text) and :class:`ReasoningParser` (reasoning out of the answer). Implementations
are plugins; the server makes one parser instance per request, in the main process.

Streaming parsers feed on deltas: ``extract_delta(delta_text)`` returns what that delta
completed, ``finish()`` what is left at the end; any split of the text into deltas must
give the same result as ``extract`` on the whole text. When both parsers run, the reasoning
parser reads the output first and the tool parser reads only its ``content``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """A complete tool call."""

    name: str
    arguments: str  # JSON text
    id: str = ""


@dataclass
class ToolCallDelta:
    """A piece of a streamed tool call (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


@dataclass
class DeltaMessage:
    """What one streamed delta adds to the chat message."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser:
    """Registered with ``register_tool_parsers`` (or ``@register_tool_parser("name")`` in a
    ``--tool-parser-plugin`` file); chosen with ``--tool-call-parser``."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def adjust_request(self, request: Any) -> Any:
        """Change a chat request before generation (e.g. keep special tokens); default: none."""
        return request

    def extract(self, model_output: str, request: Any) -> ExtractedToolCalls:
        """Tool calls in a complete model output; malformed calls come back as content."""
        raise NotImplementedError

    def extract_delta(self, delta_text: str, request: Any) -> DeltaMessage | None:
        """What ``delta_text`` (the next piece of output) completes, or None for nothing yet."""
        raise NotImplementedError

    def finish(self, request: Any) -> DeltaMessage | None:
        """Whatever is still held back when the output ends."""
        return None


class ReasoningParser:
    """Registered with ``register_reasoning_parsers``; chosen with ``--reasoning-parser``."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def adjust_request(self, request: Any) -> Any:
        """Change a chat request before generation (e.g. keep the special tokens that mark
        reasoning); default: none."""
        return request

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a complete model output."""
        raise NotImplementedError

    def extract_reasoning_delta(self, delta_text: str, request: Any) -> DeltaMessage | None:
        """What ``delta_text`` completes, split into reasoning and content."""
        raise NotImplementedError

    def finish(self, request: Any) -> DeltaMessage | None:
        """Whatever is still held back when the output ends (e.g. a partial end marker)."""
        return None

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """True once the reasoning section is over in the output whose token ids (generated
        so far, prompt excluded) are ``token_ids``: constraints start after it."""
        raise NotImplementedError
