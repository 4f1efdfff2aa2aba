"""``SpeculativeConfig``: speculative decoding from ``--speculative-config`` (vLLM's JSON keys),
checked key by key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError

# --speculative-config keys as vLLM names them; the values tokenloom cannot honour are refused
# by SpeculativeConfig.from_dict (the rest of vLLM's keys are refused as unknown)
SPECULATIVE_CONFIG_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "model",
    "quantization",
    "max_model_len",
    "revision",
    "draft_tensor_parallel_size",
    "acceptance_method",
    "disable_logprobs",
    "disable_log_stats",
    "adaptive_num_speculative_tokens",
    "verify_row_cost",
)
# vLLM's default n-gram window when neither bound is given
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """Speculative decoding, from ``--speculative-config`` (vLLM's JSON keys) or the older
    individual flags: a proposer plugin (``method``) drafts up to ``num_speculative_tokens``
    tokens per decoding sequence, and the target model verifies them all in one step."""

    method: str = "ngram"
    """The proposer plugin: ``ngram`` (prompt lookup), ``draft_model`` (a smaller model with the
    target's tokenizer, ``model``) or one a plugin registers."""
    num_speculative_tokens: int = 1
    """Draft tokens proposed per sequence and step (k): a step checks up to k + 1 tokens."""
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the shortest suffix of the sequence looked up in its earlier tokens."""
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    """ngram: the longest suffix looked up (the longest match is tried first)."""
    disable_by_batch_size: int | None = None
    """No speculation while more than this many requests are running or waiting: a full batch
    already keeps the machine busy, and drafts would only add work."""
    model: str | None = None
    """The draft model of a method that runs one (same tokenizer as the target): a path, a GGUF
    file or a packaged model name, resolved like the target's ``--model``."""
    quantization: str | None = None
    """The draft model's quantization method."""
    max_model_len: int | None = None
    """The draft model's context length."""
    disable_log_stats: bool = False
    """Leave the acceptance rate out of the periodic log line."""
    adaptive_num_speculative_tokens: bool = True
    """Draft fewer than ``num_speculative_tokens`` for a request whose drafts are seldom
    accepted: each request drafts the length its own acceptance so far makes pay best (see
    tokenloom/core/spec_decode/draft_length.py), at least one. False: always
    ``num_speculative_tokens``, as vLLM does."""
    verify_row_cost: float | None = None
    """With ``adaptive_num_speculative_tokens``: the time one more verified token adds to a
    decode step, as a fraction of that step (the platform's measured default when unset)."""

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's ``--speculative-config`` object -> a checked config; a ConfigError names the
        key to change."""

        def bad(message: str) -> ConfigError:
            return ConfigError(f"--speculative-config: {message}", param="speculative-config")

        for key in options:
            if key not in SPECULATIVE_CONFIG_KEYS:
                raise bad(f"unknown key {key!r}; known: {', '.join(SPECULATIVE_CONFIG_KEYS)}")
        values = dict(options)
        method = values.pop("method", None)
        if method is None:
            method = "draft_model" if values.get("model") else None
        if method is None:
            raise bad('give "method" (e.g. "ngram") or a draft "model"')
        if not isinstance(method, str) or not method:
            raise bad(f'"method" must be a proposer name, got {method!r}')
        if method == "ngram":
            # nothing would read a draft model's settings: refuse them rather than drop them
            for key in ("model", "quantization", "max_model_len"):
                if values.get(key) is not None:
                    raise bad(
                        f"{key} describes a draft model, and method 'ngram' runs none (it drafts from the prompt); remove {key}"
                    )
        if method == "draft_model":
            if not values.get("model"):
                raise bad(
                    'method "draft_model" needs "model": the draft model (a path, a GGUF file or a packaged name)'
                )
            if not isinstance(values["model"], str):
                raise bad(f'"model" must be a model name or path, got {values["model"]!r}')
            # the draft model proposes; a lookup setting would be read by nothing
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if values.get(key) is not None:
                    raise bad(
                        f"{key} configures n-gram lookup, and method 'draft_model' drafts with a model; remove {key}"
                    )
        if values.get("draft_tensor_parallel_size") not in (None, 1):
            raise bad("draft_tensor_parallel_size must be 1: tokenloom runs the draft in the target's worker")
        values.pop("draft_tensor_parallel_size", None)
        if values.get("acceptance_method", "rejection_sampler") != "rejection_sampler":
            raise bad(
                f"acceptance_method {values['acceptance_method']!r} is not implemented; "
                "tokenloom verifies drafts with rejection_sampler, which keeps the target distribution exactly"
            )
        values.pop("acceptance_method", None)
        # vLLM may skip logprobs while speculating; tokenloom always computes the ones a request
        # asks for with the target model: checked, then dropped (``tokenloom serve`` warns that
        # true has no effect, as it does for --disable-logprobs-during-spec-decoding)
        if not isinstance(values.pop("disable_logprobs", False), bool):
            raise bad("disable_logprobs must be true or false")
        if values.pop("revision", None) is not None:
            raise bad("revision is not implemented; pin the draft model by a local path instead")
        if "num_speculative_tokens" not in values:
            raise bad('"num_speculative_tokens" is required (the number of draft tokens per step, e.g. 3)')
        lookup_min, lookup_max = values.pop("prompt_lookup_min", None), values.pop("prompt_lookup_max", None)
        # one bound given: the other equals it (vLLM's rule)
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        elif lookup_min is None:
            lookup_min = lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        config = cls(method=method, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max, **values)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(message: str) -> ConfigError:
            return ConfigError(f"--speculative-config: {message}", param="speculative-config")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 64:
            raise bad(f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise bad(f"{key} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.disable_by_batch_size is not None and (
            not is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            raise bad(f"disable_by_batch_size must be a positive integer, got {self.disable_by_batch_size!r}")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise bad(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.adaptive_num_speculative_tokens, bool):
            raise bad(
                f"adaptive_num_speculative_tokens must be true or false, got {self.adaptive_num_speculative_tokens!r}"
            )
        if self.verify_row_cost is not None and (
            isinstance(self.verify_row_cost, bool)
            or not isinstance(self.verify_row_cost, (int, float))
            or not 0 <= self.verify_row_cost <= 10
        ):
            raise bad(
                "verify_row_cost must be a number in [0, 10] (one more verified token's time as a fraction "
                f"of a decode step, e.g. 0.06), got {self.verify_row_cost!r}"
            )
