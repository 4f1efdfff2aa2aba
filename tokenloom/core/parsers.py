"""Interfaces of the output parsers, plugin kinds like the others in ``core``:
:class:`ToolParser` (tool calls out of the model's text) and :class:`ReasoningParser`
(reasoning out of the answer), the data they return, the :class:`ParserTokenizer` they are
given, and the text helpers every streaming parser needs (partial-marker hold-back, marker
search). Implementations are plugins; the server makes one parser instance per request, in
the main process. Plugin authors import all of it from :mod:`tokenloom.plugin_api`.

Streaming parsers feed on deltas: ``extract_delta(delta_text)`` returns what that delta
completed, ``finish()`` what is left at the end; any split of the text into deltas must
give the same result as ``extract`` on the whole text (:mod:`tokenloom.plugin_testing`
checks it). When both parsers run, the reasoning parser reads the output first and the
tool parser reads only its ``content``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

# what ``model_copy`` returns: a request of the type it was called on
CopiedRequestT = TypeVar("CopiedRequestT", bound="ParserRequest")


class ParserRequest(Protocol):
    """What a parser may read of the chat request it parses for (import it from
    :mod:`tokenloom.plugin_api`): the server's ``ChatCompletionRequest`` (a pydantic model)
    has these and more. A parser never changes the request in place; ``adjust_request``
    returns a changed copy made with ``model_copy``."""

    @property
    def tools(self) -> Sequence[Mapping[str, Any]] | None:
        """The request's ``tools`` in OpenAI's shape (``{"type": "function", "function": {...}}``)."""
        ...

    @property
    def tool_choice(self) -> str | Mapping[str, Any] | None:
        """``"auto"``, ``"none"``, ``"required"``, a named function (a dict), or None (unset)."""
        ...

    def model_copy(
        self: CopiedRequestT, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> CopiedRequestT:
        """A copy with the fields in ``update`` replaced (e.g. ``skip_special_tokens``)."""
        ...


# ``adjust_request`` returns the type it was given (the chat request, or None outside the server)
RequestT = TypeVar("RequestT", bound="ParserRequest | None")


class ParserTokenizer(Protocol):
    """What a parser may call on the tokenizer it is constructed with: the model's Hugging Face
    tokenizer (a ``PreTrainedTokenizerFast``), shared with the server. Anything beyond these
    four methods may differ between models; never change the tokenizer's state."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...  # int (the unknown token's id if absent)

    def get_vocab(self) -> dict[str, int]: ...


@dataclass
class ToolCall:
    """A complete tool call."""

    name: str
    arguments: str  # JSON text of an object
    id: str = ""  # empty: the server assigns its usual ``chatcmpl-tool-...`` id


@dataclass
class ToolCallDelta:
    """A piece of a streamed tool call (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ExtractedToolCalls:
    """What :meth:`ToolParser.extract` found in a complete output."""

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
    ``--tool-parser-plugin`` file); chosen with ``--tool-call-parser``. One instance per
    request: a streaming parser keeps its state on ``self``.

    ``request`` is the chat request being answered (None when a parser is used outside the
    server, e.g. in tests); parsers read it (``request.tools``) and never change it in place.
    """

    def __init__(self, tokenizer: ParserTokenizer | None = None):
        self.tokenizer = tokenizer

    def adjust_request(self, request: RequestT) -> RequestT:
        """A changed copy of the chat request before generation (e.g. keep special tokens in
        the text); default: the request unchanged."""
        return request

    def extract(self, model_output: str, request: ParserRequest | None = None) -> ExtractedToolCalls:
        """Tool calls in a complete model output; malformed calls come back as content."""
        raise NotImplementedError

    def extract_delta(self, delta_text: str, request: ParserRequest | None = None) -> DeltaMessage | None:
        """What ``delta_text`` (the next piece of output) completes, or None for nothing yet."""
        raise NotImplementedError

    def finish(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        """Whatever is still held back when the output ends."""
        return None


class ReasoningParser:
    """Registered with ``register_reasoning_parsers``; chosen with ``--reasoning-parser``. One
    instance per request (and one per guided sequence, in the engine, for
    :meth:`is_reasoning_end`)."""

    def __init__(self, tokenizer: ParserTokenizer | None = None):
        self.tokenizer = tokenizer

    def adjust_request(self, request: RequestT) -> RequestT:
        """A changed copy of the chat request before generation (e.g. keep the special tokens
        that mark reasoning); default: the request unchanged."""
        return request

    def extract_reasoning(
        self, model_output: str, request: ParserRequest | None = None
    ) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a complete model output."""
        raise NotImplementedError

    def extract_reasoning_delta(self, delta_text: str, request: ParserRequest | None = None) -> DeltaMessage | None:
        """What ``delta_text`` completes, split into reasoning and content."""
        raise NotImplementedError

    def finish(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        """Whatever is still held back when the output ends (e.g. a partial end marker)."""
        return None

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether the reasoning section is over in an output whose generated token ids (prompt
        excluded) are ``token_ids``: a guided request's constraint starts at the next token.

        Called in the engine thread on a fresh instance: first with ``[]`` before the first
        token, then after each token until it returns True (never again after that).

        - ``[]``: True only if the parser knows no reasoning section can come (then the
          very first token is constrained); False if the model may still open one (then
          tokens stay free until the answer is seen to start).
        - Output that has begun and is not (the start of) a reasoning section -- a model that
          never reasons, or reasoning switched off -- must return True at once, or the
          answer goes unconstrained.
        - Inside a section: False; from the token that closes it on: True.

        A parser without it (``NotImplementedError``) gets constraints from the first token.
        """
        raise NotImplementedError


def partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker: text
    that must wait for the next delta before it can be called content (hold-back)."""
    longest = max((len(marker) for marker in markers), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        suffix = text[-length:]
        if any(marker.startswith(suffix) for marker in markers):
            return length
    return 0


def find_first_marker(text: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """``(index, marker)`` of the earliest marker in ``text`` (the longest on a tie), or ``(-1, None)``."""
    best_index, best_marker = -1, None
    for marker in markers:
        index = text.find(marker)
        if index < 0:
            continue
        if best_marker is None or index < best_index or (index == best_index and len(marker) > len(best_marker)):
            best_index, best_marker = index, marker
    return best_index, best_marker


def keep_special_tokens(request: RequestT) -> RequestT:
    """``request`` with special tokens decoded into the text, verbatim (no spaces around
    them), so that markers made of special tokens reach the parser."""
    if request is None:
        return request
    return request.model_copy(update={"skip_special_tokens": False, "spaces_between_special_tokens": False})
