"""A request's sampling fields checked and turned into what the engine runs: SamplingParams
(with the generation config's defaults), or BeamSearchParams under use_beam_search; the checks
on n and best_of, logprobs, priority, and what a beam search cannot honour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from tokenloom.api.prompt_inputs import PromptInputs
from tokenloom.api.protocol import SamplingRequest
from tokenloom.core.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenloom.core.engine.protocol import EngineClient

T = TypeVar("T")


def logit_bias_by_token_id(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """A request's ``logit_bias`` (JSON object keys are strings) keyed by token id, as
    SamplingParams holds it; SamplingParams checks the count, the ids and the values."""
    if logit_bias is None:
        return None
    try:
        return {int(token_id): bias for token_id, bias in logit_bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids and values numbers", param="logit_bias") from None


class RequestSampling(PromptInputs):
    """:class:`~tokenloom.api.serving_base.ServingContext`'s sampling methods: a request's
    token ids and stop strings need what :class:`PromptInputs` knows of the vocabulary and
    tokenizer. The attributes are set by ServingContext's ``__init__``."""

    engine: EngineClient

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
