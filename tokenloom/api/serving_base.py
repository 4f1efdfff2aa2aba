"""The per-app state every OpenAI endpoint shares (:class:`ServingContext`: the engine, the
served model names, the generation config's defaults), the checks every request passes first
(readiness, the model name, unknown fields), request ids and logging, and the pieces of every
answer: choices accumulated from the engine's outputs, best_of's pick, logprob token strings
and usage. ServingContext's prompt, sampling and engine-run methods are in
:mod:`~tokenloom.api.prompt_inputs`, :mod:`~tokenloom.api.request_sampling` and
:mod:`~tokenloom.api.engine_runs`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from tokenloom.api.engine_runs import EngineRuns
from tokenloom.api.http_errors import request_id_of
from tokenloom.api.metrics import ServerMetrics
from tokenloom.api.multimodal_inputs import MultiModalInputs
from tokenloom.api.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from tokenloom.api.request_sampling import RequestSampling
from tokenloom.api.server_config import ServerConfig
from tokenloom.api.serving_models import ServedModels
from tokenloom.api.tracing import RequestTracer
from tokenloom.core.outputs import CompletionOutput, Logprob, PromptLogprobs
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import EngineDeadError

if TYPE_CHECKING:
    from tokenloom.core.engine.protocol import EngineClient

logger = logging.getLogger(__name__)
# app._guarded: awaits a route's work, answering an unexpected exception with a logged 500
RouteGuard = Callable[[Request, Awaitable[Response]], Awaitable[Response]]

# the unknown request fields one warning names, and the characters shown of each: the line
# stays short however many fields a request invents
MAX_LOGGED_UNKNOWN_FIELDS = 16
MAX_LOGGED_FIELD_CHARS = 64

# JSON has no -inf; OpenAI clients expect a number (vLLM sends the same floor)
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB) if value == value else MIN_LOGPROB


@dataclass
class ChoiceState:
    """One choice (one engine output) accumulated from the engine's DELTA outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, output: CompletionOutput) -> None:
        self.text += output.text
        self.token_ids.extend(output.token_ids)
        if output.logprobs:
            self.logprobs.extend(output.logprobs)
        if output.cumulative_logprob is not None:
            self.cumulative_logprob = output.cumulative_logprob
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason


class ServingContext(RequestSampling, EngineRuns):
    """Per-app state and the helpers every OpenAI endpoint uses (the prompt, sampling and
    engine-run ones through its bases)."""

    def __init__(
        self,
        engine: EngineClient,
        config: ServerConfig,
        metrics: ServerMetrics | None,
        multimodal: MultiModalInputs | None = None,
    ):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tracer: RequestTracer | None = None  # set by build_app under --otlp-traces-endpoint
        self.tokenizer = engine.tokenizer  # None under --skip-tokenizer-init
        self.vocab_size = len(self.tokenizer) if self.tokenizer is not None else int(engine.vocab_size)
        self.served_model_names = list(engine.served_model_names)
        # the model's processor and the media limits (None given: the model takes text only)
        self.multimodal = multimodal or MultiModalInputs(None, ServerConfig(), self.served_model_names[0])
        self.max_model_len = int(engine.max_model_len)
        # --generation-config: defaults for requests that leave a sampling field unset, and
        # max_tokens (the model's max_new_tokens) caps every request
        self.generation_defaults: dict[str, Any] = dict(engine.generation_defaults)
        # the base model's names and the LoRA adapters a request's ``model`` may name
        self.models = ServedModels(engine, self.served_model_names, self.max_model_len)
        # calls that set truncation change the fast tokenizer's state (an exclusive borrow of
        # the Rust tokenizer): they get a copy of their own, one call at a time, so the shared
        # tokenizer's users in other threads neither fail ("Already borrowed") nor see it
        self._truncating_tokenizer: Any = None
        self._truncating_lock = threading.Lock()
        if self.generation_defaults:
            logger.info(
                "request defaults from the generation config (--generation-config vllm ignores them): %s",
                ", ".join(f"{name}={value}" for name, value in sorted(self.generation_defaults.items())),
            )

    # -- checks -----------------------------------------------------------------------

    def check_ready(self) -> None:
        if self.engine.errored:
            reason = self.engine.dead_reason  # e.g. which worker died, and how
            cause = f" ({reason})" if reason else ""
            raise EngineDeadError(
                f"the engine has stopped after an error{cause}; see the server log and restart the server"
            )
        if not self.engine.is_running:
            raise EngineDeadError("the engine is not running yet (or is shutting down); retry shortly")

    def check_model(self, requested: str | None) -> str:
        """The model name for the response: the requested name when it is one we serve (the
        base model's or a LoRA adapter's)."""
        return self.models.check_model(requested)

    def warn_unknown_fields(self, request: Any, endpoint: str) -> None:
        """One log line for a request with fields the server ignores (vLLM's), whatever their
        number: the first few names, each shortened and quoted (a name may hold a newline)."""
        names = request.unknown_fields()
        if not names:
            return
        shown = [
            repr(name if len(name) <= MAX_LOGGED_FIELD_CHARS else name[: MAX_LOGGED_FIELD_CHARS - 3] + "...")
            for name in names[:MAX_LOGGED_UNKNOWN_FIELDS]
        ]
        more = len(names) - len(shown)
        logger.warning(
            "%s: the following fields were present in the request but ignored: %s%s",
            endpoint,
            ", ".join(shown),
            f" and {more} more" if more else "",
        )

    # -- requests ---------------------------------------------------------------------

    def engine_request_id(self, raw_request: Request, request: SamplingRequest, prefix: str) -> str:
        return f"{prefix}-{request.request_id or request_id_of(raw_request)}"

    def log_request(self, request_id: str, prompt: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not self.config.enable_log_requests:  # prompts in server logs are private data: opt in
            return
        limit = self.config.max_log_len
        shown_prompt = prompt[:limit] if (limit is not None and isinstance(prompt, str)) else prompt
        shown_ids = prompt_token_ids[:limit] if limit is not None else prompt_token_ids
        logger.info(
            "received request %s: prompt: %r, prompt_token_ids: %s, params: %s",
            request_id,
            shown_prompt if isinstance(prompt, str) else None,
            shown_ids,
            params,
        )

    # -- outputs ----------------------------------------------------------------------

    def return_token_ids(self, request: SamplingRequest) -> bool:
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.config.return_tokens_as_token_ids

    def token_text(self, token_id: int, logprob: Logprob | None, as_token_id: bool) -> str:
        if as_token_id or self.tokenizer is None:  # no tokenizer: no text to show
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text: str = self.tokenizer.decode([token_id])
        return text

    def usage(self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
        details = (
            PromptTokensDetails(cached_tokens=num_cached_tokens) if self.config.enable_prompt_tokens_details else None
        )
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=details,
        )

    @staticmethod
    def prompt_logprobs_json(
        prompt_logprobs: PromptLogprobs | None,
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's shape: per prompt position None or {token_id: {logprob, rank, decoded_token}}."""
        if prompt_logprobs is None:
            return None
        return [
            None
            if position is None
            else {
                str(token_id): {
                    "logprob": clamp_logprob(entry.logprob),
                    "rank": entry.rank,
                    "decoded_token": entry.decoded_token,
                }
                for token_id, entry in position.items()
            }
            for position in prompt_logprobs
        ]


def pick_best(choices: list[ChoiceState], n: int) -> list[ChoiceState]:
    """best_of: the ``n`` samples with the highest cumulative logprob, best first."""
    ranked = sorted(
        choices,
        key=lambda choice: choice.cumulative_logprob if choice.cumulative_logprob is not None else float("-inf"),
        reverse=True,
    )
    return ranked[:n]
