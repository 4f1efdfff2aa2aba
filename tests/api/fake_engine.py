"""A deterministic stand-in for ``AsyncLLM`` (same interface) so the HTTP layer is tested
without a model: each of the ``n`` outputs replays a fixed reply through the real
tokenizer, one token per step, honouring max_tokens, stop strings, logprobs, prompt
logprobs and the output kind. It records what it was asked and what was aborted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tokenloom.core.config import LoRAConfig
from tokenloom.core.logits_processors import LogitsProcessorResolver
from tokenloom.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenloom.core.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.errors import ContextLengthError, InvalidRequestError

DEFAULT_REPLIES = (
    " The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest.",
    " Once upon a time there was a small robot who loved to read books about the sea and the stars.",
    " Paris is the capital of France, and it is famous for its museums, its food and its long history.",
)


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.25
    prefix_cache_queries: int = 100
    prefix_cache_hits: int = 40
    num_preemptions: int = 2
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    spec_decoding: Any = None  # a SpecDecodingStats when the engine speculates
    mm_cache_queries: int = 5
    mm_cache_hits: int = 3


@dataclass
class RecordedRequest:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


class FakeEngine:
    def __init__(
        self,
        tokenizer,
        *,
        model_name: str = "smollm2",
        served_model_names: list[str] | None = None,
        max_model_len: int = 512,
        max_logprobs: int = 20,
        replies: tuple[str, ...] = DEFAULT_REPLIES,
        step_delay: float = 0.0,
        num_cached_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.served_model_names = served_model_names or [model_name]
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.replies = replies
        self.step_delay = step_delay
        self.num_cached_tokens = num_cached_tokens
        self.is_running = True
        self.errored = False
        self.started = False
        self.shut_down = False
        self.fail_at_start: Exception | None = None
        self.fail_after_steps: int | None = None
        self.requests: list[RecordedRequest] = []
        self.aborted: list[str] = []
        self.abort_calls: list[str] = []
        self.prefix_cache_resets = 0
        self.counters = FakeStats()
        self.first_step_event = asyncio.Event()
        # the rest of what the server reads of an engine (EngineClient)
        self.runner_type = "generate"
        self.hf_config = None
        self.vocab_size = len(tokenizer) if tokenizer is not None else 0
        self.generation_defaults: dict[str, Any] = {}
        self.max_num_seqs = 256
        self.eos_token_ids = {tokenizer.eos_token_id} if tokenizer is not None else set()
        self.scheduling_policy = "priority"  # so a request's priority reaches the fake
        self.logits_processor_resolver = LogitsProcessorResolver(None, None)
        self.lora_config = LoRAConfig()
        self.dead_reason: str | None = None

    async def start(self) -> None:
        self.started = True
        self.is_running = True

    async def shutdown(self) -> None:
        self.shut_down = True
        self.is_running = False

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    def resolve_lora(self, lora_request: Any) -> Any:
        raise InvalidRequestError("the fake engine runs no LoRA adapters", param="model")

    async def add_lora(self, lora_request: Any) -> bool:
        self.resolve_lora(lora_request)
        return False

    async def remove_lora(self, lora_int_id: int) -> bool:
        return False

    async def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    async def encode(self, prompt, pooling_params, request_id: str, *, priority: int = 0):
        raise InvalidRequestError("the fake engine generates; it does not pool", param="model")
        yield  # an async generator, as the interface's

    def stats(self) -> FakeStats:
        return self.counters

    # -- generation -----------------------------------------------------------------------

    def _logprob_entries(self, token_id: int, chosen_logprob: float, step: int, num_top: int) -> dict[int, Logprob]:
        """Odd steps put the chosen token at rank 2 behind ``token_id + 1`` so that "chosen
        outside the top N" is exercised."""
        vocab = len(self.tokenizer)
        chosen_rank = 2 if step % 2 else 1
        entries = {token_id: Logprob(chosen_logprob, chosen_rank, self.tokenizer.decode([token_id]))}
        rank, candidate = 1, token_id
        while rank <= num_top:
            if rank == chosen_rank:
                rank += 1
                continue
            candidate = (candidate + 1) % vocab
            logprob = chosen_logprob + 0.3 if rank < chosen_rank else chosen_logprob - rank
            entries[candidate] = Logprob(logprob, rank, self.tokenizer.decode([candidate]))
            rank += 1
        return entries

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0):
        params = sampling_params
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ContextLengthError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) > {self.max_model_len}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise InvalidRequestError("too many logprobs", param="logprobs")
        if self.fail_at_start is not None:
            raise self.fail_at_start
        self.requests.append(RecordedRequest(request_id, prompt, prompt_ids, params, priority))

        plans = []
        for index in range(params.n):
            reply = self.replies[index % len(self.replies)]
            plans.append(self.tokenizer(reply, add_special_tokens=False)["input_ids"][:max_tokens])
        emitted_text = [""] * params.n
        emitted_tokens = [0] * params.n
        logprobs_so_far: list[list] = [[] for _ in range(params.n)]
        cumulative = [0.0] * params.n
        finish = [None] * params.n
        stop_reason = [None] * params.n
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                self._logprob_entries(token, -1.5, 0, params.prompt_logprobs) for token in prompt_ids[1:]
            ]
        metrics = RequestMetrics(arrival_time=0.0, num_cached_tokens=self.num_cached_tokens)
        self.counters.prompt_tokens_total += len(prompt_ids)
        done = False
        step = 0
        try:
            while not all(finish):
                if self.fail_after_steps is not None and step >= self.fail_after_steps:
                    raise RuntimeError("simulated engine failure")
                await asyncio.sleep(self.step_delay)
                step_outputs = []
                for index in range(params.n):
                    if finish[index]:
                        continue
                    plan = plans[index]
                    count = emitted_tokens[index] + 1
                    token_id = plan[count - 1]
                    text = self.tokenizer.decode(plan[:count], skip_special_tokens=params.skip_special_tokens)
                    chosen = -(0.5 + 0.1 * step) - 0.05 * ((index + 2) % 3)
                    cumulative[index] += chosen
                    if params.logprobs is not None:
                        logprobs_so_far[index].append(self._logprob_entries(token_id, chosen, step, params.logprobs))
                    for stop in params.stop:
                        position = text.find(stop)
                        if position >= 0:
                            text = text[: position + (len(stop) if params.include_stop_str_in_output else 0)]
                            finish[index], stop_reason[index] = "stop", stop
                            break
                    if finish[index] is None and count == len(plan):
                        finish[index] = "length" if count == max_tokens else "stop"
                    emitted_tokens[index] = count
                    self.counters.generation_tokens_total += 1
                    new_text = text[len(emitted_text[index]) :]
                    step_outputs.append((index, new_text, token_id, text))
                    emitted_text[index] = text
                step += 1
                self.first_step_event.set()
                if params.output_kind is RequestOutputKind.FINAL_ONLY and not all(finish):
                    continue
                outputs = []
                if params.output_kind is RequestOutputKind.DELTA:
                    for index, new_text, token_id, _ in step_outputs:
                        out_logprobs = logprobs_so_far[index][-1:] if params.logprobs is not None else None
                        outputs.append(
                            CompletionOutput(
                                index,
                                new_text,
                                [token_id],
                                cumulative[index],
                                out_logprobs,
                                finish[index],
                                stop_reason[index],
                            )
                        )
                else:
                    for index in range(params.n):
                        out_logprobs = list(logprobs_so_far[index]) if params.logprobs is not None else None
                        outputs.append(
                            CompletionOutput(
                                index,
                                emitted_text[index],
                                plans[index][: emitted_tokens[index]],
                                cumulative[index],
                                out_logprobs,
                                finish[index],
                                stop_reason[index],
                            )
                        )
                first_output = step == 1 or params.output_kind is not RequestOutputKind.DELTA
                done = all(finish)
                yield RequestOutput(
                    request_id,
                    prompt if isinstance(prompt, str) else None,
                    prompt_ids,
                    prompt_logprobs if first_output else None,
                    outputs,
                    done,
                    metrics,
                    num_cached_tokens=self.num_cached_tokens,
                )
        finally:
            if not done:
                self.aborted.append(request_id)


class LoopRecordingTokenizer:
    """Wraps a tokenizer and records, per call (``encode``, ``decode``, ``tokens``), whether it
    ran on the event loop's thread; everything else is the wrapped tokenizer's. Its deep copy
    (the server's truncating tokenizer) shares the record and says ``truncating``."""

    def __init__(self, inner, calls: list | None = None, name: str = "shared"):
        self.inner = inner
        self.calls: list[tuple[str, str, bool]] = [] if calls is None else calls
        self.name = name

    def _record(self, kind: str) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        self.calls.append((self.name, kind, on_loop))

    def __call__(self, *args, **kwargs):
        self._record("encode")
        return self.inner(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._record("decode")
        return self.inner.decode(*args, **kwargs)

    def convert_ids_to_tokens(self, *args, **kwargs):
        self._record("tokens")
        return self.inner.convert_ids_to_tokens(*args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __deepcopy__(self, memo):
        import copy

        return LoopRecordingTokenizer(copy.deepcopy(self.inner, memo), self.calls, "truncating")

    def on_loop(self, kind: str, name: str = "shared") -> list[bool]:
        """For each recorded call of ``kind`` by the ``name`` tokenizer: whether it ran on the loop."""
        return [on_loop for who, what, on_loop in self.calls if who == name and what == kind]
