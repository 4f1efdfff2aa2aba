"""What a request asks for, checked when it is built: :class:`SamplingParams` (a generate
request's sampling, stops, logprobs and constraints) and :class:`PoolingParams` (a pooling
request's), with the caps on fields whose cost grows with their size, shaped like vLLM's.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import InvalidRequestError

# Caps on request fields whose cost (memory, per-token work in the engine thread) grows with
# their size. Generous next to OpenAI's (4 stop sequences, 300 logit_bias entries) so that no
# real client meets them, small enough that one request cannot stall the others.
MAX_STOP_STRINGS = 64


MAX_STOP_STRING_CHARS = 1024


MAX_STOP_TOKEN_IDS = 1024


MAX_BAD_WORDS = 1024


MAX_LOGIT_BIAS_ENTRIES = 1024


# a list of allowed ids longer than any vocabulary is never useful (the server also checks
# it against the model's vocabulary size)
MAX_ALLOWED_TOKEN_IDS = 262144


MAX_CACHE_SALT_CHARS = 4096


def unwrap_prompt(prompt: Any, param: str) -> Any:
    """vLLM's dict prompt forms (``{"prompt_token_ids": [...]}``, ``{"prompt": "..."}``) as the
    text or token ids inside; other prompts unchanged."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param=param)


def check_encodable(text: str, param: str) -> None:
    """A 400 naming ``param`` for text that cannot be encoded as UTF-8 (a lone surrogate such
    as ``"\\ud800"``, which JSON can carry but no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} holds text that is not valid Unicode (an unpaired surrogate "
            f"{text[exc.start]!r} at character {exc.start}); send well-formed UTF-8",
            param=param,
        ) from None


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request; the same fields and defaults as vLLM's ``SamplingParams``.

    Every field is checked on construction; a bad value raises
    :class:`~tokenloom.errors.InvalidRequestError` naming the parameter.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # a constraint for a structured-output backend (dict form of vLLM's StructuredOutputsParams)
    structured_outputs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    # vLLM's per-request prefix-cache isolation: requests share cached KV blocks only when
    # their salts are equal (None shares with other unsalted requests)
    cache_salt: str | None = None
    # per-request logits processors, run on this request's logits row each step: plain-data
    # LogitsProcessorSpecs (what the server resolves a request's names to; they cross to
    # worker processes) or, offline with the in-process executor, callables
    # ``fn(prompt_token_ids, output_token_ids, logits) -> logits``
    logits_processors: list[Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                param="logit_bias",
            )
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    "logit_bias keys must be token ids and values numbers", param="logit_bias"
                ) from None
            infinite = next((token for token, bias in self.logit_bias.items() if not math.isfinite(bias)), None)
            if infinite is not None:
                raise InvalidRequestError(
                    f"logit_bias[{infinite}] is {self.logit_bias[infinite]}; biases must be finite numbers "
                    "(use allowed_token_ids or bad_words to force or ban a token)",
                    param="logit_bias",
                )
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> None:
            raise InvalidRequestError(f"{param} {message}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            bad("best_of", f"must be an integer >= n ({self.n}), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            bad("temperature", f"must be a finite number, got {self.temperature}")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", f"must be a non-negative integer, got {self.logprobs}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", f"must be a non-negative integer, got {self.prompt_logprobs}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            bad("truncate_prompt_tokens", f"must be at least 1, got {self.truncate_prompt_tokens}")
        # __post_init__ made these lists
        stop = self.stop if isinstance(self.stop, list) else []
        stop_token_ids = self.stop_token_ids or []
        bad_words = self.bad_words or []
        if any(not isinstance(s, str) for s in stop):
            bad("stop", "must be a string or a list of strings")
        if any(not s for s in stop):
            bad("stop", "must not contain empty strings")
        if len(stop) > MAX_STOP_STRINGS:
            bad("stop", f"has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        longest_stop = max(stop, key=len, default="")
        if len(longest_stop) > MAX_STOP_STRING_CHARS:
            bad(
                "stop",
                f"holds a string of {len(longest_stop)} characters; each may have at most {MAX_STOP_STRING_CHARS}",
            )
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if len(bad_words) > MAX_BAD_WORDS:
            bad("bad_words", f"has {len(bad_words)} entries; at most {MAX_BAD_WORDS} are allowed")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            bad("allowed_token_ids", "must not be empty")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            bad(
                "allowed_token_ids",
                f"has {len(self.allowed_token_ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS} are allowed",
            )
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not self.cache_salt:
                bad("cache_salt", "must be a non-empty string")
            if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
                bad("cache_salt", f"has {len(self.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed")
            check_encodable(self.cache_salt, "cache_salt")
        for index, stop_string in enumerate(stop):
            check_encodable(stop_string, f"stop[{index}]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: Any) -> SamplingParams:
        import dataclasses

        return dataclasses.replace(self, **changes)


@dataclass
class PoolingParams:
    """How to pool one request of a pooling model (``--runner pooling``), like vLLM's.

    ``None`` fields take the model's pooler settings (``--pooler-config`` or the model's
    sentence-transformers files).
    """

    # keep only the first ``dimensions`` values (Matryoshka models), before normalizing
    dimensions: int | None = None
    normalize: bool | None = None
    softmax: bool | None = None
    # text: the tokenizer truncates to this many tokens; token ids: the last ones are kept
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool) or self.dimensions < 1
        ):
            raise InvalidRequestError(
                f"dimensions must be a positive integer, got {self.dimensions!r}", param="dimensions"
            )
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < 1
        ):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens!r}",
                param="truncate_prompt_tokens",
            )

    def clone(self, **changes: Any) -> PoolingParams:
        import dataclasses

        return dataclasses.replace(self, **changes)
