"""What completions and chat share: model-name and readiness checks, request ids, prompt
tokenization and length checks, SamplingParams from a request, logprob token strings,
usage, request logging, and running prompts through the engine (merged, timed for the
metrics, aborted when the client goes away).

Over ~400 lines on purpose: these are the checks every endpoint (completions, chat, the
Responses and Messages layers) must apply identically; one place keeps them from drifting.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from tokenloom.api.http_errors import request_id_of
from tokenloom.api.metrics import RequestTimer, ServerMetrics
from tokenloom.api.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from tokenloom.api.server_config import ServerConfig
from tokenloom.api.serving_models import ServedModels
from tokenloom.core.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tokenloom.core.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.errors import ContextLengthError, EngineDeadError, InvalidRequestError

if TYPE_CHECKING:
    from tokenloom.core.engine.protocol import EngineClient

logger = logging.getLogger(__name__)
T = TypeVar("T")
# what ServingContext.generate_all gives: (prompt_index, output) pairs, closed to abort early
IndexedOutputs = AsyncGenerator[tuple[int, RequestOutput], None]
# app._guarded: awaits a route's work, answering an unexpected exception with a logged 500
RouteGuard = Callable[[Request, Awaitable[Response]], Awaitable[Response]]

# Request input at least this large (characters of text, or token ids) is tokenized or
# detokenized in a worker thread: tokenizing runs at about a megabyte a second, and the event
# loop serves every other stream and /health. Smaller input stays on the loop, where the
# thread hop would cost more than the work, and never queues behind a large one for a thread.
# What a thread may be given is bounded before it starts, by --max-request-body-bytes; the
# context length is checked on the token count it returns.
OFF_LOOP_TOKENIZE_CHARS = 16 * 1024
OFF_LOOP_DETOKENIZE_TOKENS = 16 * 1024

# the unknown request fields one warning names, and the characters shown of each: the line
# stays short however many fields a request invents
MAX_LOGGED_UNKNOWN_FIELDS = 16
MAX_LOGGED_FIELD_CHARS = 64

# JSON has no -inf; OpenAI clients expect a number (vLLM sends the same floor)
MIN_LOGPROB = -9999.0


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


def logit_bias_by_token_id(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """A request's ``logit_bias`` (JSON object keys are strings) keyed by token id, as
    SamplingParams holds it; SamplingParams checks the count, the ids and the values."""
    if logit_bias is None:
        return None
    try:
        return {int(token_id): bias for token_id, bias in logit_bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids and values numbers", param="logit_bias") from None


class ClientDisconnected(Exception):
    """The client went away before the response was ready; there is no one to answer."""


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


class ServingContext:
    """Per-app state and the helpers both OpenAI endpoints use."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: ServerMetrics | None):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer = engine.tokenizer  # None under --skip-tokenizer-init
        self.vocab_size = len(self.tokenizer) if self.tokenizer is not None else int(engine.vocab_size)
        self.served_model_names = list(engine.served_model_names)
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

    def require_tokenizer(self, what: str, param: str) -> None:
        """A 400 saying why, when ``what`` needs the tokenizer the server skipped."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{what} needs the tokenizer, and this server was started with --skip-tokenizer-init: "
                'send prompts as token ids to /v1/completions ("prompt": [1, 2, 3]); outputs come back '
                "as token ids with empty text",
                param=param,
            )

    def check_logprobs(self, requested: int | None, param: str) -> None:
        max_logprobs = self.engine.max_logprobs  # -1 (no cap) is resolved by the engine
        if requested is not None and requested > max_logprobs:
            raise InvalidRequestError(
                f"{param} must be at most {max_logprobs} (the server's --max-logprobs), got {requested}", param=param
            )

    @property
    def max_samples(self) -> int:
        """The most samples (``n``, ``best_of``) one request may ask for: ``--max-num-seqs``,
        the most sequences one engine step runs. More could never run together, and each
        sample costs its own KV blocks and detokenizer, so a larger ``n`` is only a way for one
        client to crowd out the others."""
        return self.engine.max_num_seqs

    def num_samples(self, request: SamplingRequest) -> int:
        """How many samples to ask the engine for: ``best_of`` (we pick the best ``n``) or ``n``."""
        if request.stream_options is not None and not request.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if request.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {request.n}", param="n")
        max_samples = self.max_samples
        for param in ("n", "best_of"):
            value = getattr(request, param)
            if value is not None and value > max_samples:
                raise InvalidRequestError(
                    f"{param} must be at most {max_samples} (the server's --max-num-seqs), got {value}", param=param
                )
        if request.best_of is None:
            return request.n
        if request.best_of < request.n:
            raise InvalidRequestError(f"best_of must be >= n ({request.n}), got {request.best_of}", param="best_of")
        if request.stream and request.best_of > request.n:
            raise InvalidRequestError(
                "best_of > n cannot be streamed (the best samples are only known at the end); "
                "set stream to false or best_of equal to n",
                param="best_of",
            )
        return request.best_of

    # -- prompts ----------------------------------------------------------------------

    def engine_request_id(self, raw_request: Request, request: SamplingRequest, prefix: str) -> str:
        return f"{prefix}-{request.request_id or request_id_of(raw_request)}"

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

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        n: int,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_outputs: dict[str, Any] | None,
    ) -> SamplingParams:
        def default(value: T | None, fallback: T) -> T:
            return fallback if value is None else value

        def model_default(value: Any, name: str, fallback: Any) -> Any:
            """The request's value, else the generation config's, else OpenAI's default."""
            return value if value is not None else self.generation_defaults.get(name, fallback)

        self.check_token_id_list_size(request.allowed_token_ids, "allowed_token_ids")
        if self.tokenizer is None:
            # without a tokenizer these would be dropped silently (no text to match, no words to tokenize)
            for name in ("stop", "bad_words"):
                if getattr(request, name):
                    self.require_tokenizer(name, name)
        self.check_priority(request.priority)
        for param, given in (
            ("length_penalty", request.length_penalty != 1.0),
            ("early_stopping", request.early_stopping),
        ):
            if given:
                raise InvalidRequestError(
                    f"{param} only applies to beam search: set use_beam_search to true, or remove {param}",
                    param=param,
                )
        logits_processors = None
        if request.logits_processors is not None:
            logits_processors = self.engine.logits_processor_resolver.resolve(request.logits_processors) or None
        return SamplingParams(
            n=n,
            presence_penalty=default(request.presence_penalty, 0.0),
            frequency_penalty=default(request.frequency_penalty, 0.0),
            repetition_penalty=model_default(request.repetition_penalty, "repetition_penalty", 1.0),
            temperature=model_default(request.temperature, "temperature", 1.0),
            top_p=model_default(request.top_p, "top_p", 1.0),
            top_k=model_default(request.top_k, "top_k", 0),
            min_p=model_default(request.min_p, "min_p", 0.0),
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            bad_words=request.bad_words,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            detokenize=self.tokenizer is not None,
            logit_bias=logit_bias_by_token_id(request.logit_bias),
            allowed_token_ids=request.allowed_token_ids,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            # the API layer always accumulates deltas itself: streaming or not, one code path
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs,
            cache_salt=request.cache_salt,
            logits_processors=logits_processors,
        )

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority means something only under ``--scheduling-policy priority``;
        under fcfs a non-zero one is refused rather than ignored."""
        policy = self.engine.scheduling_policy
        if priority != 0 and policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} was given, but the server schedules {policy} (first come, first "
                "served): remove priority, or start the server with --scheduling-policy priority",
                param="priority",
            )

    # -- beam search -------------------------------------------------------------------

    def check_beam_search(
        self, request: SamplingRequest, num_beams: int, structured_outputs: dict[str, Any] | None
    ) -> None:
        """Refuse, by name, what a beam search cannot honour: it ranks beams by the model's own
        log-probabilities, so anything that would reshape the distribution (or a stream of
        partial text) would otherwise be dropped without a word. vLLM refuses streaming too."""
        if request.stream:
            raise InvalidRequestError(
                "use_beam_search cannot be streamed (the best beams are only known at the end); set stream to false",
                param="stream",
            )
        if structured_outputs is not None:
            raise InvalidRequestError(
                "use_beam_search cannot be combined with structured outputs (guided_*, structured_outputs, "
                "response_format, or a tool_choice that forces a call)",
                param="use_beam_search",
            )
        refused = {
            "stop": bool(request.stop),
            "logit_bias": bool(request.logit_bias),
            "allowed_token_ids": request.allowed_token_ids is not None,
            "bad_words": bool(request.bad_words),
            "presence_penalty": request.presence_penalty not in (None, 0.0),
            "frequency_penalty": request.frequency_penalty not in (None, 0.0),
            "repetition_penalty": request.repetition_penalty not in (None, 1.0),
            "top_p": request.top_p not in (None, 1.0),
            "top_k": request.top_k not in (None, 0, -1),
            "min_p": request.min_p not in (None, 0.0),
            "min_tokens": request.min_tokens != 0,
            "prompt_logprobs": request.prompt_logprobs is not None,
            "logits_processors": bool(request.logits_processors),
        }
        for param, given in refused.items():
            if given:
                raise InvalidRequestError(
                    f"{param} is not supported with use_beam_search (beams are ranked by the model's own "
                    f"log-probabilities); remove {param} or use_beam_search",
                    param=param,
                )
        if not isinstance(request.length_penalty, (int, float)) or request.length_penalty != request.length_penalty:
            raise InvalidRequestError("length_penalty must be a number", param="length_penalty")
        max_logprobs = self.engine.max_logprobs
        if 2 * num_beams > max_logprobs:
            param = "best_of" if request.best_of is not None else "n"
            raise InvalidRequestError(
                f"use_beam_search with {num_beams} beams ({param}) needs the top {2 * num_beams} logprobs of every "
                f"beam at each step, more than the server's --max-logprobs {max_logprobs}; lower {param} to at most "
                f"{max_logprobs // 2}",
                param=param,
            )

    def beam_search_params(self, request: SamplingRequest, num_beams: int, max_tokens: int) -> Any:
        from tokenloom.core.beam_search import BeamSearchParams

        return BeamSearchParams(
            beam_width=num_beams,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            # vLLM's default for beam search; the beams are ranked on raw logprobs either way
            temperature=request.temperature if request.temperature is not None else 0.0,
            length_penalty=float(request.length_penalty),
            early_stopping=request.early_stopping,
            stop_token_ids=tuple(request.stop_token_ids or ()),
        )

    async def beam_search(
        self,
        prompts: list[tuple[list[int], Any]],
        request_id: str,
        priority: int,
        num_choices: int,
        logprobs: int | None,
        skip_special_tokens: bool,
    ) -> IndexedOutputs:
        """Beam search for each ``(prompt_token_ids, BeamSearchParams)`` on the engine, as the
        ``(prompt_index, output)`` pairs :meth:`generate_all` gives: one finished output per
        prompt, holding its ``num_choices`` best beams. Each step's beams are one-token engine
        requests that run batched; leaving early (cancelled, client gone) aborts them."""
        import contextlib

        from tokenloom.core.beam_search import beam_search_async

        eos_token_ids = set(self.engine.eos_token_ids)
        if not eos_token_ids and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos_token_ids = {self.tokenizer.eos_token_id}
        step_counter = iter(range(1 << 62))

        async def one_token(token_ids: list[int], params: SamplingParams, beam_id: str) -> RequestOutput:
            final = None
            stream = self.engine.generate(token_ids, params, beam_id, priority=priority)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    final = output
            if final is None or final.error:
                raise RuntimeError(f"beam {beam_id} failed: {final.error if final else 'no output'}")
            return final

        async def generate(beams: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
            step = next(step_counter)
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            tasks = [
                asyncio.ensure_future(one_token(tokens, params, f"{request_id}-beam-{step}-{index}"))
                for index, tokens in enumerate(beams)
            ]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*tasks, return_exceptions=True)

        def decode(token_ids: list[int]) -> str:
            text: str = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
            return text

        for prompt_index, (prompt_token_ids, params) in enumerate(prompts):
            timer = RequestTimer(self.metrics, len(prompt_token_ids))
            result = (await beam_search_async(generate, [prompt_token_ids], params, eos_token_ids, decode))[0]
            beams = result.sequences[:num_choices]
            outputs = [
                CompletionOutput(
                    index=index,
                    text=beam.text or "",
                    token_ids=beam.output_token_ids,
                    cumulative_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs if logprobs is not None else None,
                    finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason,
                )
                for index, beam in enumerate(beams)
            ]
            timer.on_output(sum(len(output.token_ids) for output in outputs))
            timer.on_finish([output.finish_reason or "length" for output in outputs])
            yield (
                prompt_index,
                RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt_token_ids,
                    prompt_logprobs=None,
                    outputs=outputs,
                    finished=True,
                ),
            )

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

    # -- the engine -------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one prompt (with ``lora_request``'s adapter, if any),
        observed for the metrics; leaving early (an error, a cancelled task, a closed
        generator) aborts the request in the engine."""
        timer = RequestTimer(self.metrics, len(prompt_token_ids))
        if lora_request is None:
            stream = self.engine.generate(prompt_token_ids, params, request_id, priority=priority)
        else:
            stream = self.engine.generate(
                prompt_token_ids, params, request_id, priority=priority, lora_request=lora_request
            )
        finished = False
        # DELTA outputs only carry the choices that moved, so remember how each one ended
        finish_reasons: dict[int, str] = {}
        try:
            async for output in stream:
                timer.on_output(sum(len(choice.token_ids) for choice in output.outputs))
                for choice in output.outputs:
                    if choice.finish_reason is not None:
                        finish_reasons[choice.index] = choice.finish_reason
                if output.finished:
                    finished = True
                    timer.on_finish([finish_reasons.get(index, "abort") for index in range(params.n)])
                yield output
        finally:
            if not finished:
                # shielded: under a cancelled scope any unshielded await would be cancelled too
                with anyio.CancelScope(shield=True):
                    await self._abort(stream, request_id)

    async def _abort(self, stream: Any, request_id: str) -> None:
        try:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
            else:
                await self.engine.abort(request_id)
        except Exception as exc:  # aborting must never hide the original error
            logger.warning("aborting request %s failed: %s", request_id, exc)

    async def generate_all(
        self,
        prompts: list[tuple[list[int], SamplingParams]],
        request_id: str,
        priority: int,
        lora_request: Any = None,
    ) -> IndexedOutputs:
        """Several ``(prompt_token_ids, params)`` at once, as ``(prompt_index, output)`` in
        arrival order."""
        if len(prompts) == 1:
            prompt_token_ids, params = prompts[0]
            async for output in self.generate(prompt_token_ids, params, request_id, priority, lora_request):
                yield 0, output
            return
        streams = [
            self.generate(prompt_token_ids, params, f"{request_id}-{index}", priority, lora_request)
            for index, (prompt_token_ids, params) in enumerate(prompts)
        ]
        async for item in merge_streams(streams):
            yield item


def pick_best(choices: list[ChoiceState], n: int) -> list[ChoiceState]:
    """best_of: the ``n`` samples with the highest cumulative logprob, best first."""
    ranked = sorted(
        choices,
        key=lambda choice: choice.cumulative_logprob if choice.cumulative_logprob is not None else float("-inf"),
        reverse=True,
    )
    return ranked[:n]


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that goes away
    while a chunk is being sent still aborts the engine request at once (not at GC time)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, item
    finally:
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for stream in streams:
                await stream.aclose()


class GenerationRun(Protocol):
    """One generation request's answer, built from the ``(prompt_index, output)`` pairs of
    :meth:`ServingContext.generate_all` (the completions, chat, Responses and Messages runs)."""

    def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        """The server-sent events, from the first output on; closes ``outputs`` when done."""
        ...

    async def collect(self, outputs: IndexedOutputs) -> BaseModel:
        """The whole response, once every output is in."""
        ...


async def respond(
    raw_request: Request, run: GenerationRun, outputs: IndexedOutputs, request_id: str, stream: bool
) -> Response:
    """The HTTP response of one generation request: ``run.stream(first, outputs)`` as
    server-sent events, or ``run.collect(outputs)`` as JSON; 499 when the client goes away
    before the first output (or the whole response) is ready."""
    try:
        if stream:
            first = await cancel_on_disconnect(raw_request, anext(outputs))
            return EngineStreamingResponse(run.stream(first, outputs), media_type="text/event-stream")
        response = await cancel_on_disconnect(raw_request, run.collect(outputs))
    except ClientDisconnected:
        logger.info("request %s: the client disconnected; aborted", request_id)
        return Response(status_code=499)
    return JSONResponse(response.model_dump(mode="json"))


async def cancel_on_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work`` unless the client disconnects first, in which case ``work`` is
    cancelled (aborting its engine requests) and ClientDisconnected is raised."""
    outcome: dict[str, Any] = {}

    async with anyio.create_task_group() as task_group:

        async def run() -> None:
            try:
                outcome["value"] = await work
            except Exception as exc:  # re-raised below, outside the task group
                outcome["error"] = exc
            task_group.cancel_scope.cancel()

        async def watch() -> None:
            while True:
                message = await raw_request.receive()
                if message["type"] == "http.disconnect":
                    outcome["disconnected"] = True
                    task_group.cancel_scope.cancel()
                    return

        task_group.start_soon(run)
        task_group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise ClientDisconnected()
    value: T = outcome["value"]
    return value
