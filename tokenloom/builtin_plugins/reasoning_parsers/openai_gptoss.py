"""``openai_gptoss``: OpenAI gpt-oss, whose output is in the harmony format: a sequence of
messages, each naming its channel in a header, written with special tokens (kept in the
decoded text for this parser)::

    <|channel|>analysis<|message|>Two plus two is four.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 4.

The prompt ends with ``<|start|>assistant``, so the first message's header starts at
``<|channel|>``; later ones repeat ``<|start|>assistant``. A message ends with ``<|end|>``,
``<|return|>`` or ``<|call|>`` (or with the output). The text of ``analysis`` messages is
the reasoning (several are joined with a newline, as vLLM joins them), the text of the
``final`` message the content, both exactly as written. Messages on other channels
(``commentary``: tool-call preambles and calls) and text outside any message are passed on
as content verbatim, markup included, so that nothing the model wrote is lost.
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
    from tokenloom.plugin_api import ParserRequest, RequestT

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HEADER_OPENERS = (START, CHANNEL)
REASONING_CHANNEL = "analysis"
ANSWER_CHANNEL = "final"


class _HarmonyScan:
    """One parse of one output, fed piece by piece: the state a streaming parser keeps."""

    def __init__(self) -> None:
        self.buffer = ""
        self.channel: str | None = None  # the channel of the message being read, None between messages
        self.reasoning_messages = 0
        self.saw_answer = False
        self._separator_due = False  # a second reasoning message starts with the joining newline

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """What ``text`` completes: (reasoning, content)."""
        self.buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buffer:
            if self.channel is None:
                if not self._read_header_or_text(final, content):
                    break
            elif not self._read_message(final, reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    def _read_header_or_text(self, final: bool, content: list[str]) -> bool:
        """Between messages: a header opens the next message, anything else is content. False
        when nothing more can be decided before more text arrives."""
        buffer = self.buffer
        if not buffer.startswith(HEADER_OPENERS):
            if not final and any(opener.startswith(buffer) for opener in HEADER_OPENERS):
                return False
            index, _ = find_first_marker(buffer[1:], HEADER_OPENERS)
            end = len(buffer) if index < 0 else index + 1
            if index < 0 and not final:
                end -= partial_marker_length(buffer, HEADER_OPENERS)
            content.append(buffer[:end])
            self.buffer = buffer[end:]
            return end > 0
        header_end = buffer.find(MESSAGE)
        if header_end < 0:
            if not final:
                return False
            content.append(buffer)  # a header the output never finished
            self.buffer = ""
            return False
        header = buffer[:header_end]
        channel_at = header.find(CHANNEL)
        channel_words = header[channel_at + len(CHANNEL) :].split() if channel_at >= 0 else []
        channel = channel_words[0] if channel_words else ""
        # a header such as "commentary to=functions.f <|constrain|>json" names no plain channel
        plain = len(channel_words) == 1 and "<|" not in header[channel_at + len(CHANNEL) :]
        if channel == REASONING_CHANNEL and plain:
            self.channel = REASONING_CHANNEL
        elif channel == ANSWER_CHANNEL and plain:
            self.channel = ANSWER_CHANNEL
        else:
            self.channel = ""  # passed on verbatim, header included
            content.append(buffer[: header_end + len(MESSAGE)])
        self.buffer = buffer[header_end + len(MESSAGE) :]
        if self.channel == REASONING_CHANNEL:
            self.reasoning_messages += 1
        elif self.channel == ANSWER_CHANNEL:
            self.saw_answer = True
        self._separator_due = self.channel == REASONING_CHANNEL and self.reasoning_messages > 1
        return True

    def _read_message(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        buffer = self.buffer
        index, marker = find_first_marker(buffer, MESSAGE_ENDS)
        if marker is None:
            end = len(buffer) - (0 if final else partial_marker_length(buffer, MESSAGE_ENDS))
        else:
            end = index
        text = buffer[:end]
        if self.channel == REASONING_CHANNEL:
            if self._separator_due and (text or marker is not None or final):
                reasoning.append("\n")
                self._separator_due = False
            reasoning.append(text)
        elif self.channel == ANSWER_CHANNEL:
            content.append(text)
        else:
            content.append(text + (marker or ""))
        if marker is None:
            self.buffer = buffer[end:]
            return False
        self.buffer = buffer[index + len(marker) :]
        self.channel = None
        return True


class GptOssReasoningParser(ReasoningParser):
    """Reasoning and content of gpt-oss's harmony-format output; one instance per request."""

    def __init__(self, tokenizer: ParserTokenizer | None = None) -> None:
        super().__init__(tokenizer)
        self._stream = _HarmonyScan()

    def adjust_request(self, request: RequestT) -> RequestT:
        # <|channel|>, <|message|>, <|end|> ... are special tokens
        return keep_special_tokens(request)

    def extract_reasoning(
        self, model_output: str, request: ParserRequest | None = None
    ) -> tuple[str | None, str | None]:
        scan = _HarmonyScan()
        reasoning, content = scan.feed(model_output, final=True)
        return (reasoning if scan.reasoning_messages else None), (content or None)

    def extract_reasoning_delta(self, delta_text: str, request: ParserRequest | None = None) -> DeltaMessage | None:
        return self._message(*self._stream.feed(delta_text, final=False))

    def finish(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        return self._message(*self._stream.feed("", final=True))

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """True once the final message's header is complete, or once the output is seen not
        to open with a harmony header (a model that does not write harmony)."""
        if self.tokenizer is None:
            raise TypeError(f"{type(self).__name__}.is_reasoning_end needs the tokenizer it was constructed with")
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        if text and not text.startswith(HEADER_OPENERS) and not any(o.startswith(text) for o in HEADER_OPENERS):
            return True
        scan = _HarmonyScan()
        scan.feed(text, final=False)
        return scan.saw_answer

    @staticmethod
    def _message(reasoning: str, content: str) -> DeltaMessage | None:
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None)
