"""Request input to token ids and back, for every endpoint: text prompts tokenized and input
token ids decoded (in a worker thread when they are large, so the event loop keeps serving),
token ids checked against the vocabulary, truncation, and the prompt's length against the
context, which sets max_tokens.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import anyio

from tokenloom.errors import ContextLengthError, InvalidRequestError

T = TypeVar("T")

# Request input at least this large (characters of text, or token ids) is tokenized or
# detokenized in a worker thread: tokenizing runs at about a megabyte a second, and the event
# loop serves every other stream and /health. Smaller input stays on the loop, where the
# thread hop would cost more than the work, and never queues behind a large one for a thread.
# What a thread may be given is bounded before it starts, by --max-request-body-bytes; the
# context length is checked on the token count it returns.
OFF_LOOP_TOKENIZE_CHARS = 16 * 1024
OFF_LOOP_DETOKENIZE_TOKENS = 16 * 1024


async def off_loop_if_large(size: int, threshold: int, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)``: on the event loop when ``size`` is under ``threshold``, else in a worker thread."""
    if size < threshold:
        return work(*args)
    return await anyio.to_thread.run_sync(work, *args)


async def tokenize_off_loop_if_large(tokenize: Callable[..., T], text: str, *args: Any) -> T:
    return await off_loop_if_large(len(text), OFF_LOOP_TOKENIZE_CHARS, tokenize, text, *args)


def input_size(inputs: Sequence[Any]) -> int:
    """The characters of the texts and the number of token ids among ``inputs``."""
    return sum(len(item) if isinstance(item, (str, list)) else 0 for item in inputs)


class PromptInputs:
    """:class:`~tokenloom.api.serving_base.ServingContext`'s prompt methods; the attributes
    are set by its ``__init__``."""

    tokenizer: Any  # None under --skip-tokenizer-init
    vocab_size: int
    max_model_len: int
    generation_defaults: dict[str, Any]
    _truncating_tokenizer: Any
    _truncating_lock: threading.Lock

    def require_tokenizer(self, what: str, param: str) -> None:
        """A 400 saying why, when ``what`` needs the tokenizer the server skipped."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{what} needs the tokenizer, and this server was started with --skip-tokenizer-init: "
                'send prompts as token ids to /v1/completions ("prompt": [1, 2, 3]); outputs come back '
                "as token ids with empty text",
                param=param,
            )

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        self.require_tokenizer("a text prompt", "prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    @contextlib.contextmanager
    def truncating_tokenizer(self) -> Iterator[Any]:
        """The tokenizer for calls that ask it to truncate (see ``_truncating_tokenizer``);
        blocking: use it in a worker thread, never on the event loop."""
        with self._truncating_lock:
            if self._truncating_tokenizer is None:
                self._truncating_tokenizer = copy.deepcopy(self.tokenizer)
            yield self._truncating_tokenizer

    async def prepare_prompts(
        self, prompts: list[str | list[int]], add_special_tokens: bool, truncate_prompt_tokens: int | None
    ) -> list[list[int]]:
        """:meth:`prepare_prompt` for each prompt, in a worker thread when they are large."""

        def prepare_all() -> list[list[int]]:
            return [self.prepare_prompt(prompt, add_special_tokens, truncate_prompt_tokens) for prompt in prompts]

        return await off_loop_if_large(input_size(prompts), OFF_LOOP_TOKENIZE_CHARS, prepare_all)

    async def detokenize(self, token_ids: list[int], param: str) -> str:
        """The text of request input ``token_ids`` (checked against the vocabulary), in a worker
        thread when they are many."""

        def decode() -> str:
            self.check_token_ids(token_ids, param)
            text: str = self.tokenizer.decode(token_ids)
            return text

        return await off_loop_if_large(len(token_ids), OFF_LOOP_DETOKENIZE_TOKENS, decode)

    def check_token_id_list_size(self, token_ids: list[int] | None, param: str) -> None:
        vocab_size = self.vocab_size
        if token_ids is not None and len(token_ids) > vocab_size:
            raise InvalidRequestError(
                f"{param} has {len(token_ids)} ids, more than the vocabulary's {vocab_size}", param=param
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.vocab_size
        bad = next((token for token in token_ids if token < 0 or token >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{param} contains token id {bad}, outside the vocabulary (0..{vocab_size - 1})", param=param
            )

    def prepare_prompt(
        self, prompt: str | list[int], add_special_tokens: bool, truncate_prompt_tokens: int | None
    ) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenize(prompt, add_special_tokens)
        else:
            self.check_token_ids(prompt, "prompt")
            token_ids = list(prompt)
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens < 1:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens must be at least 1, got {truncate_prompt_tokens}",
                    param="truncate_prompt_tokens",
                )
            token_ids = token_ids[-truncate_prompt_tokens:]  # keep the end, like vLLM
        if not token_ids:
            raise InvalidRequestError("the prompt is empty (it has no tokens)", param="prompt")
        return token_ids

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, param: str = "max_tokens") -> int:
        """The requested max_tokens, or the rest of the context; both lengths in any error."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} "
                "tokens; shorten the prompt (or set truncate_prompt_tokens)",
                param="prompt",
            )
        cap = self.generation_defaults.get("max_tokens")  # the model's max_new_tokens
        if requested is None:
            return min(limit - num_prompt_tokens, cap) if cap is not None else limit - num_prompt_tokens
        if requested < 1:
            raise InvalidRequestError(f"{param} must be at least 1, got {requested}", param=param)
        if cap is not None:
            requested = min(requested, cap)  # as vLLM: the generation config's cap wins
        if num_prompt_tokens + requested > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} "
                f"tokens and {param} asks for {requested} more ({num_prompt_tokens + requested} in total); lower "
                f"{param} to at most {limit - num_prompt_tokens} or shorten the prompt",
                param=param,
            )
        return requested
