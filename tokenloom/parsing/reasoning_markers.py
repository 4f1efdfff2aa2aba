"""What marker-based reasoning parsers are built from (tokenloom's own and plugins', through
``tokenloom.plugin_api``): :class:`MarkedReasoningParser`
splits an output into a reasoning section, between a start and an end marker, and the
answer after it, streaming with the same code that splits whole outputs (so any split into
deltas gives the same result).

The text is kept as the model wrote it, as vLLM keeps it: the reasoning is everything
between the markers and the content everything after the end marker, whitespace included
(``"<think>\\nHmm.\\n</think>\\n\\nYes."`` is ``("\\nHmm.\\n", "\\n\\nYes.")``). Only the
markers themselves, and whitespace before a start marker that opens the output, are
dropped. An output with no reasoning section is all content, unchanged.

What a whole output gives, like vLLM's parsers: a section that was opened and closed gives
its reasoning even when empty (``""``, unless :attr:`empty_reasoning_is_none`), and
``None`` for an empty answer; an output with no section gives ``(None, output)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.core.parsers import (
    DeltaMessage,
    ParserTokenizer,
    ReasoningParser,
    find_first_marker,
    keep_special_tokens,
    partial_marker_length,
)

if TYPE_CHECKING:
    from tokenloom.core.parsers import ParserRequest, RequestT

# where the split is: deciding whether the output opens with reasoning, inside it, after it
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class _Split:
    """One split of one output, fed piece by piece: the state a streaming parser keeps."""

    def __init__(self, parser: MarkedReasoningParser):
        self.parser = parser
        self.state = _START
        self.buffer = ""
        self.section_opened = False  # a reasoning section began (by marker or from the start)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """What ``text`` completes: (reasoning, content)."""
        parser = self.parser
        self.buffer += text
        reasoning, content = "", ""
        if self.state == _START:
            opening = self.buffer.lstrip()
            marker = next((m for m in parser.start_markers if opening.startswith(m)), None)
            if marker is not None:
                # the marker (and any whitespace before it) is not part of the reasoning
                self.state, self.buffer = _REASONING, opening[len(marker) :]
            elif not final and any(m.startswith(opening) for m in parser.start_markers):
                return "", ""  # may still become a start marker (whitespace-only too)
            elif parser.starts_in_reasoning:
                self.state = _REASONING  # the template opened the section: keep every character
            else:
                self.state = _CONTENT
            self.section_opened = self.state == _REASONING
        if self.state == _REASONING:
            index, marker = find_first_marker(self.buffer, parser.end_markers)
            if marker is not None:
                reasoning = self.buffer[:index]
                self.buffer = self.buffer[index + len(marker) :]
                self.state = _CONTENT
            else:
                keep = 0 if final else partial_marker_length(self.buffer, parser.end_markers)
                reasoning = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
        if self.state == _CONTENT:
            content = self._content(final)
        return reasoning, content

    def _content(self, final: bool) -> str:
        """The answer text in the buffer, with :attr:`~MarkedReasoningParser.answer_end_markers` dropped."""
        markers = self.parser.answer_end_markers
        pieces = []
        while markers:
            index, marker = find_first_marker(self.buffer, markers)
            if marker is None:
                break
            pieces.append(self.buffer[:index])
            self.buffer = self.buffer[index + len(marker) :]
        keep = 0 if final or not markers else partial_marker_length(self.buffer, markers)
        pieces.append(self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return "".join(pieces)


class MarkedReasoningParser(ReasoningParser):
    """A reasoning parser for one marker pair. Subclasses set the markers; one instance per
    request."""

    start_markers: tuple[str, ...] = ()
    end_markers: tuple[str, ...] = ()
    # markers that close the answer (dropped wherever they appear in it), e.g. "</answer>"
    answer_end_markers: tuple[str, ...] = ()
    # True: the output is reasoning from its first character even without a start marker
    # (the chat template put the start marker in the prompt); False: only after one
    starts_in_reasoning = False
    # True when the markers are special tokens, which must be kept in the decoded text
    markers_are_special_tokens = False
    # True: an empty reasoning section gives None rather than ""
    empty_reasoning_is_none = False

    def __init__(self, tokenizer: ParserTokenizer | None = None) -> None:
        super().__init__(tokenizer)
        self._stream = _Split(self)

    def adjust_request(self, request: RequestT) -> RequestT:
        return keep_special_tokens(request) if self.markers_are_special_tokens else request

    def extract_reasoning(
        self, model_output: str, request: ParserRequest | None = None
    ) -> tuple[str | None, str | None]:
        split = _Split(self)
        reasoning, content = split.feed(model_output, final=True)
        if not split.section_opened:
            return None, content
        if not reasoning and self.empty_reasoning_is_none:
            return None, content or None
        return reasoning, content or None

    def extract_reasoning_delta(self, delta_text: str, request: ParserRequest | None = None) -> DeltaMessage | None:
        return self._message(*self._stream.feed(delta_text, final=False))

    def finish(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        return self._message(*self._stream.feed("", final=True))

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        if self.tokenizer is None:
            raise TypeError(f"{type(self).__name__}.is_reasoning_end needs the tokenizer it was constructed with")
        split = _Split(self)
        split.feed(self.tokenizer.decode(token_ids, skip_special_tokens=False), final=False)
        return split.state == _CONTENT

    @staticmethod
    def _message(reasoning: str, content: str) -> DeltaMessage | None:
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None)
