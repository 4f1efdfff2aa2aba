"""What every built-in reasoning parser shares: :class:`MarkedReasoningParser` splits an
output into a reasoning section, between a start and an end marker, and the answer after
it, streaming with the same code that splits whole outputs (so any split into deltas gives
the same result).

Whitespace around the reasoning, and between it and the answer, is dropped; an output with
no reasoning section is all content, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.plugin_api import (
    DeltaMessage,
    ParserTokenizer,
    ReasoningParser,
    find_first_marker,
    keep_special_tokens,
    partial_marker_length,
)

if TYPE_CHECKING:
    from tokenloom.plugin_api import ChatCompletionRequest, RequestT

# where the split is: deciding whether the output opens with reasoning, inside it, after it
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class _TrimmedText:
    """A stream of text with leading whitespace dropped and trailing whitespace held back
    (dropped at the end when ``keep_trailing`` is False)."""

    def __init__(self, keep_trailing: bool):
        self.keep_trailing = keep_trailing
        self.started = False
        self.held = ""

    def add(self, text: str) -> str:
        combined = self.held + text
        if not self.started:
            combined = combined.lstrip()
        body = combined.rstrip()
        self.held = combined[len(body) :]
        if body:
            self.started = True
        return body

    def close(self) -> str:
        held, self.held = self.held, ""
        return held if self.keep_trailing else ""


class _Split:
    """One split of one output, fed piece by piece: the state a streaming parser keeps."""

    def __init__(self, parser: MarkedReasoningParser):
        self.parser = parser
        self.state = _START
        self.buffer = ""
        self.reasoning = _TrimmedText(keep_trailing=False)
        self.answer: _TrimmedText | None = None  # the content after a reasoning section

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """What ``text`` completes: (reasoning, content)."""
        parser = self.parser
        self.buffer += text
        reasoning, content = [], []
        if self.state == _START:
            opening = self.buffer.lstrip()
            marker = next((m for m in parser.start_markers if opening.startswith(m)), None)
            if marker is not None:
                self.state, self.buffer = _REASONING, opening[len(marker) :]
            elif not final and any(m.startswith(opening) for m in parser.start_markers):
                return "", ""  # may still become a start marker
            elif parser.starts_in_reasoning:
                self.state = _REASONING
            else:
                self.state = _CONTENT
        if self.state == _REASONING:
            index, marker = find_first_marker(self.buffer, parser.end_markers)
            if marker is not None:
                reasoning += [self.reasoning.add(self.buffer[:index]), self.reasoning.close()]
                self.buffer = self.buffer[index + len(marker) :]
                self.state, self.answer = _CONTENT, _TrimmedText(keep_trailing=True)
            else:
                keep = 0 if final else partial_marker_length(self.buffer, parser.end_markers)
                reasoning.append(self.reasoning.add(self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep :]
                if final:
                    reasoning.append(self.reasoning.close())
        if self.state == _CONTENT:
            content.append(self.answer.add(self.buffer) if self.answer else self.buffer)
            if final and self.answer:
                content.append(self.answer.close())
            self.buffer = ""
        return "".join(reasoning), "".join(content)


class MarkedReasoningParser(ReasoningParser):
    """A reasoning parser for one marker pair. Subclasses set the markers; one instance per
    request."""

    start_markers: tuple[str, ...] = ()
    end_markers: tuple[str, ...] = ()
    # True: the output is reasoning from its first character even without a start marker
    # (the chat template put the start marker in the prompt); False: only after one
    starts_in_reasoning = False
    # True when the markers are special tokens, which must be kept in the decoded text
    markers_are_special_tokens = False

    def __init__(self, tokenizer: ParserTokenizer | None = None) -> None:
        super().__init__(tokenizer)
        self._stream = _Split(self)

    def adjust_request(self, request: RequestT) -> RequestT:
        return keep_special_tokens(request) if self.markers_are_special_tokens else request

    def extract_reasoning(
        self, model_output: str, request: ChatCompletionRequest | None = None
    ) -> tuple[str | None, str | None]:
        reasoning, content = _Split(self).feed(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_delta(
        self, delta_text: str, request: ChatCompletionRequest | None = None
    ) -> DeltaMessage | None:
        return self._message(*self._stream.feed(delta_text, final=False))

    def finish(self, request: ChatCompletionRequest | None = None) -> DeltaMessage | None:
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
