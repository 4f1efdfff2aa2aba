"""The engine-server boundary: :class:`EngineClient`, everything the HTTP server asks of an
engine, and :func:`build_engine_client`, which chooses the engine for a set of arguments.

Implemented by :class:`~tokenloom.core.engine.async_llm.AsyncLLM` (one engine on a thread),
:class:`~tokenloom.core.engine.data_parallel.DataParallelAsyncLLM` (``-dp N`` replicas behind
the same surface) and the tests' fakes; ``tokenloom.api`` reads an engine only through it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenloom.core.config import EngineArgs, LoRAConfig
    from tokenloom.core.engine.engine_stats import EngineStats
    from tokenloom.core.logits_processors import LogitsProcessorResolver
    from tokenloom.core.outputs import PoolingRequestOutput, RequestOutput
    from tokenloom.core.sampling_params import PoolingParams, SamplingParams
    from tokenloom.plugins.manager import PluginSet

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """What the server needs of an engine. Every member is read on the event loop; none may
    block it (work that takes time runs on the engine's own thread or process)."""

    # -- the model and its limits, fixed once the engine is built ----------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a transformers fast tokenizer), shared with the engine."""

    @property
    def model_name(self) -> str:
        """The model as the operator named it (``--model``)."""

    @property
    def served_model_names(self) -> list[str]:
        """The names requests may give as ``model`` (``--served-model-name``; the first is listed)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def runner_type(self) -> str:
        """``generate`` or ``pooling``: which kind of request the engine serves (and so which routes exist)."""

    @property
    def hf_config(self) -> Any:
        """The model's transformers config (pooling reads its hidden size and Matryoshka dimensions)."""

    @property
    def max_logprobs(self) -> int:
        """``--max-logprobs``, with -1 (no cap) resolved to the vocabulary size."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The request defaults in force (``--generation-config``), under SamplingParams' names."""

    @property
    def max_num_seqs(self) -> int:
        """``--max-num-seqs``: the cap on ``n`` and ``best_of``."""

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokens that end a generation (beam search finishes a beam on them)."""

    @property
    def scheduling_policy(self) -> str:
        """``fcfs`` or ``priority``: whether a request's ``priority`` means anything."""

    @property
    def lora_config(self) -> LoRAConfig:
        """The LoRA settings (``--enable-lora``, ``--max-loras``, ``--max-cpu-loras``, ...)."""

    @property
    def logits_processor_resolver(self) -> LogitsProcessorResolver:
        """Checks a request's ``logits_processors`` (registered names, ``--logits-processor-pattern``)."""

    # -- health --------------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """The engine takes requests (``/health`` answers 200)."""

    @property
    def errored(self) -> bool:
        """The engine stopped for good (a worker or replica died or hung): every request is a 503."""

    @property
    def dead_reason(self) -> str | None:
        """Why it stopped (which worker or replica, and how); None while it runs."""

    def stats(self) -> EngineStats:
        """The counters ``/metrics`` and the periodic log line read (cheap: no engine call)."""

    # -- life cycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind outputs to the running event loop and start what runs the engine; idempotent."""

    async def shutdown(self) -> None:
        """Stop the engine and its workers; open requests end."""

    # -- requests --------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as they come; bad input raises before anything is queued, and
        closing the generator early (``aclose()``) aborts the request. ``request_id`` must be unused."""

    def encode(
        self, prompt: Any, pooling_params: PoolingParams | None, request_id: str, *, priority: int = 0
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """The pooled output of one prompt (a single, final item)."""

    async def abort(self, request_id: str) -> None:
        """End a request now (its stream ends with what it has)."""

    def resolve_lora(self, lora_request: Any) -> Any:
        """The adapter checked against the model, its path local; reads files the first time."""

    async def add_lora(self, lora_request: Any) -> bool:
        """Check an adapter so requests can name it (``/v1/load_lora_adapter``)."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (``/v1/unload_lora_adapter``); False when it was not loaded."""

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (``/reset_prefix_cache``), on every replica."""


def build_engine_client(engine_args: EngineArgs, plugins: PluginSet | None = None) -> EngineClient:
    """The engine for these arguments, built (a build error is raised here): one
    :class:`~tokenloom.core.engine.async_llm.AsyncLLM`, or with ``data_parallel_size > 1`` a
    :class:`~tokenloom.core.engine.data_parallel.DataParallelAsyncLLM` over that many replicas
    (this node's share of them with --data-parallel-hybrid-lb; one engine of the rank given
    with --data-parallel-rank, behind an external load balancer).
    Blocks while the engine builds: call it off the event loop."""
    from tokenloom.core.engine.async_llm import AsyncLLM

    if engine_args.data_parallel_size != 1:
        from tokenloom.core.engine.data_parallel import DataParallelAsyncLLM
        from tokenloom.core.engine.replica_handles import replica_engine_args, single_replica_rank

        parallel = engine_args.create_engine_config().parallel
        single_rank = single_replica_rank(parallel)
        if single_rank is None:
            return DataParallelAsyncLLM.from_engine_args(engine_args, plugins)
        logger.info(
            "data parallel: this server runs the replica of rank %d of %d; a load balancer in front spreads the requests",
            single_rank,
            parallel.data_parallel_size,
        )
        engine_args = replica_engine_args(engine_args, single_rank)
    return AsyncLLM.from_engine_args(engine_args, plugins)
