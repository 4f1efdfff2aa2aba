"""Continuous batching: each step decides which sequences run and how many tokens each
computes, under a token budget and a sequence cap, with chunked prefill, prefix-cache hits,
preemption by recompute, and FCFS or priority order. It owns the waiting and running queues
and the :class:`~tokenloom.core.block_manager.BlockManager`.

Chunked prefill disabled means a prompt is never split: one that does not fit the step's
remaining budget waits (head of line), and one longer than the whole budget (possible for a
resumed request with its output) runs whole, alone in a step, once nothing else is scheduled.

With pipeline parallelism the engine keeps several batches in flight (vLLM V1's batch
queue): ``schedule()`` may run again before the previous batch's ``update_from_output``, and a
sequence with a batch in flight is never scheduled again (nor preempted) until its result is
applied, so a sequence is in at most one batch and every batch sees its latest tokens.

Over ~400 lines on purpose: admission, ``schedule()``, ``update_from_output()`` and preemption
keep one set of invariants together (a sequence is in exactly one of the waiting queue and the
running list, holds blocks only while running, and every finished id reaches the worker once);
split apart, each half would have to re-check the other's.

With a KV connector (``--kv-transfer-config``, :mod:`tokenloom.core.kv_connector`) a third place
holds sequences: ``_loading``, requests whose prefix blocks the worker is loading. They hold
their blocks there (an aborted one until its loader is done writing them) and return to the head
of the waiting queue, still holding them, when the worker reports the load.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tokenloom.core.batch import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenloom.core.block_manager import BlockManager
from tokenloom.core.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.kv_connector import KVConnector, KVConnectorOutput, KVConnectorScheduler, KVConnectorStats
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.errors import ConfigError, ContextLengthError, InvalidRequestError, OverloadedError

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# share of the model length above which a prompt's chunk is capped when several prompts may
# prefill at once and no --long-prefill-token-threshold is given (vLLM's default)
LONG_PREFILL_SHARE = 0.04

# where a request stands in the waiting order: lower runs first (see Scheduler._order_key)
OrderKey = tuple[float, ...]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None
    kv_connector: KVConnectorStats | None = None


@dataclass
class SpecDecodingStats:
    """Speculative decoding since start, counted like vLLM's ``spec_decode_*`` metrics."""

    num_spec_tokens: int
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [position] how often the draft at that position was accepted
    num_accepted_tokens_per_pos: list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_accepted_tokens_per_pos is None:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_position = self.num_accepted_tokens_per_pos
        assert per_position is not None  # set in __post_init__
        for position in range(num_accepted_tokens):
            per_position[position] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos or []),
        )


class _FCFSQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._sequences: deque[EngineSequence] = deque()

    def push(self, seq: EngineSequence, order_key: OrderKey) -> None:
        self._sequences.append(seq)

    def push_front(self, seq: EngineSequence, order_key: OrderKey) -> None:
        self._sequences.appendleft(seq)

    def peek(self) -> EngineSequence:
        return self._sequences[0]

    def pop(self) -> EngineSequence:
        return self._sequences.popleft()

    def remove_ids(self, seq_ids: set[str]) -> None:
        self._sequences = deque(r for r in self._sequences if r.seq_id not in seq_ids)

    def __len__(self) -> int:
        return len(self._sequences)


class _PriorityQueue:
    """Waiting requests by (priority, arrival); a preempted request keeps its original key,
    which puts it ahead of everything that arrived after it at its priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[OrderKey, EngineSequence]] = []

    def push(self, seq: EngineSequence, order_key: OrderKey) -> None:
        heapq.heappush(self._heap, (order_key, seq))

    push_front = push

    def peek(self) -> EngineSequence:
        return self._heap[0][1]

    def pop(self) -> EngineSequence:
        return heapq.heappop(self._heap)[1]

    def remove_ids(self, seq_ids: set[str]) -> None:
        self._heap = [entry for entry in self._heap if entry[1].seq_id not in seq_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class Scheduler:
    """vLLM-v1-style scheduler: ``schedule()`` then ``update_from_output()`` once per step.

    The engine must call ``update_from_output`` after every ``schedule`` (even an empty one):
    requests the scheduler finishes on its own are returned from there.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        *,
        max_loras: int | None = None,
        send_token_ids: bool = False,
        num_lookahead_tokens: int = 0,
        enable_kv_cache_events: bool = False,
        kv_connector: KVConnector | None = None,
    ):
        """:param send_token_ids: put each step's tokens in ``CachedRequestData.new_token_ids``
        (pipeline parallelism: the stages before the last never sample).
        :param kv_connector: the scheduler side of ``--kv-transfer-config``'s connector."""
        if max_model_len < 2:
            raise ConfigError(
                f"max_model_len must be at least 2 (one prompt and one output token), got {max_model_len}",
                param="max-model-len",
            )
        if scheduler_config.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"--scheduling-policy must be fcfs or priority, got {scheduler_config.scheduling_policy!r}",
                param="scheduling-policy",
            )
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.max_num_seqs = scheduler_config.max_num_seqs
        max_waiting = scheduler_config.max_waiting_requests
        # 0 or less (or None) lifts the limit
        self.max_waiting_requests = max_waiting if max_waiting is not None and max_waiting > 0 else None
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.max_num_partial_prefills = max(1, scheduler_config.max_num_partial_prefills)
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        if not self.long_prefill_token_threshold and self.max_num_partial_prefills > 1:
            self.long_prefill_token_threshold = max(1, int(max_model_len * LONG_PREFILL_SHARE))
        self.use_priority = scheduler_config.scheduling_policy == "priority"
        # LoRA adapters the worker holds slots for: at most this many distinct ones run at once
        # (None: the engine serves no adapters)
        self.max_loras = max_loras
        self.block_manager = BlockManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            enable_kv_cache_events=enable_kv_cache_events,
        )

        self.sequences: dict[str, EngineSequence] = {}
        self.waiting = _PriorityQueue() if self.use_priority else _FCFSQueue()
        self.running: list[EngineSequence] = []
        self.num_preemptions = 0
        self._admission_seq: dict[str, int] = {}
        self._next_admission_seq = 0
        # ids whose state the worker must drop at the next step
        self._finished_seq_ids: set[str] = set()
        self._preempted_seq_ids: set[str] = set()
        # requests finished inside schedule(); the next update_from_output returns them
        self._finished_in_schedule: list[EngineSequence] = []
        # requests scheduled in a batch whose result update_from_output has not applied yet
        # (several batches in flight under pipeline parallelism), by id: the object scheduled,
        # so a result never lands on a later request that reuses an aborted request's id
        self._in_flight: dict[str, EngineSequence] = {}
        self.send_token_ids = send_token_ids
        self.speculative = speculative
        self.spec_decoding_stats = SpecDecodingStats(speculative.num_speculative_tokens) if speculative else None
        # slots past a request's scheduled tokens, allocated while speculating, where the
        # proposer writes its drafts' KV right after the step (a draft model: k)
        self.num_lookahead_tokens = num_lookahead_tokens if speculative else 0
        self.kv_connector = KVConnectorScheduler(kv_connector, self.block_manager) if kv_connector else None
        # requests whose prefix blocks the KV connector is loading: out of both queues, holding
        # their blocks (an aborted one too, until the loader is done writing them)
        self._loading: dict[str, EngineSequence] = {}
        # requests back in the waiting queue after their load, holding blocks and computed tokens
        self._loaded_ids: set[str] = set()

    # ---- admission -------------------------------------------------------------------------

    def add_sequence(self, seq: EngineSequence) -> None:
        """Queue a request, or reject it at once when it can never run."""
        self.add_sequences([seq])

    def add_sequences(self, sequences: list[EngineSequence]) -> None:
        """Queue the sequences of one user request together, or none of them: every check runs
        on all of them before the first is queued, so a refusal leaves nothing behind.

        The waiting-queue limit admits the group while fewer than ``max_waiting_requests``
        sequences wait, so a group may overshoot the limit by its size minus one (``n`` is
        capped by the request validation), and a request with ``n`` above the limit can run.
        """
        seen: set[str] = set()
        for seq in sequences:
            if seq.seq_id in seen:
                raise InvalidRequestError(f"request id {seq.seq_id!r} appears twice in one request", param="request_id")
            seen.add(seq.seq_id)
            self._check_admissible(seq)
        if self.max_waiting_requests is not None and len(self.waiting) >= self.max_waiting_requests:
            raise OverloadedError(
                f"{len(self.waiting)} requests are already waiting "
                f"(--max-waiting-requests {self.max_waiting_requests}); retry later"
            )
        for seq in sequences:
            seq.status = SequenceStatus.WAITING
            self.sequences[seq.seq_id] = seq
            self._admission_seq[seq.seq_id] = self._next_admission_seq
            self._next_admission_seq += 1
            self.waiting.push(seq, self._order_key(seq))

    def _check_admissible(self, seq: EngineSequence) -> None:
        """Raise when ``seq`` can never be queued: its id is taken, or it can never fit."""
        seq_id = seq.seq_id
        if seq_id in self.sequences:
            raise InvalidRequestError(
                f"request id {seq_id!r} is already in use; give each request a unique id", param="request_id"
            )
        num_prompt_tokens = seq.num_prompt_tokens
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty: it must hold at least one token", param="prompt")
        # a pooling prompt may fill the context: no output token follows it
        num_output_slots = 0 if seq.pooling_params is not None else 1
        if num_prompt_tokens + num_output_slots > self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens, but the model's maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one output token); shorten the prompt "
                f"to at most {self.max_model_len - 1} tokens",
                param="prompt",
            )
        block_size = self.block_manager.block_size
        num_blocks_needed = self.block_manager.num_blocks_needed(num_prompt_tokens + 1)
        if num_blocks_needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens and needs {num_blocks_needed} KV-cache blocks of "
                f"{block_size} tokens, but the cache has only {self.block_manager.num_blocks} blocks; shorten "
                "the prompt or give the KV cache more memory (--gpu-memory-utilization, "
                "--kv-cache-memory-bytes, --num-gpu-blocks-override)",
                param="prompt",
            )

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first (a decode token or the next prompt chunk
        each, in admission order), then waiting ones in policy order, all within the token
        budget and the sequence cap."""
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids_by_seq: dict[str, list[int]] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        preempted_this_step = False
        speculate = self._speculation_on()

        # a snapshot: preemption removes requests from self.running while we walk it
        for seq in list(self.running):
            if token_budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if seq.seq_id in self._in_flight:
                continue  # its tokens are not known until its batch comes back
            num_new_tokens = self._num_running_tokens_to_schedule(seq, token_budget)
            if num_new_tokens == 0:
                continue
            # drafts are verified in this step or never: the next step brings new ones
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            if speculate and drafts and seq.num_tokens - seq.num_computed_tokens == 1:
                drafts = drafts[: self._max_draft_tokens(seq, token_budget)]
                if drafts:
                    # the lookahead slots get KV blocks with the pending token's
                    num_new_tokens += len(drafts)
                    spec_decode_tokens[seq.seq_id] = drafts
            while True:
                new_block_ids = self._allocate_with_lookahead(seq, num_new_tokens, speculate)
                if new_block_ids is not None:
                    break
                # a request with a batch in flight keeps its blocks: that batch writes them
                victim = max((r for r in self.running if r.seq_id not in self._in_flight), key=self._order_key)
                if victim is seq and len(self.running) == 1:
                    self._finish_unfittable(seq)
                    break
                if victim is seq and any(r.seq_id in self._in_flight for r in self.running):
                    # only requests in flight could give blocks back: wait for their results
                    new_block_ids = None
                    break
                preempted_this_step = True
                if victim.seq_id in num_scheduled_tokens:
                    # already scheduled this step: take its tokens back
                    token_budget += num_scheduled_tokens.pop(victim.seq_id)
                    del new_block_ids_by_seq[victim.seq_id]
                    spec_decode_tokens.pop(victim.seq_id, None)
                self._preempt(victim)
                if victim is seq:
                    break
            if new_block_ids is None:
                spec_decode_tokens.pop(seq.seq_id, None)
                continue
            num_scheduled_tokens[seq.seq_id] = num_new_tokens
            new_block_ids_by_seq[seq.seq_id] = new_block_ids
            token_budget -= num_new_tokens

        cached_reqs = [
            CachedRequestData(
                req_id=seq_id,
                new_block_ids=block_ids,
                num_computed_tokens=self.sequences[seq_id].num_computed_tokens,
                new_token_ids=self._step_token_ids(seq_id, num_scheduled_tokens, spec_decode_tokens),
            )
            for seq_id, block_ids in new_block_ids_by_seq.items()
        ]
        # after a preemption memory is short: admitting more would only preempt again
        new_reqs = [] if preempted_this_step else self._schedule_waiting(token_budget, num_scheduled_tokens, speculate)

        kv_connector_metadata = None
        if self.kv_connector is not None:
            for seq_id, num_tokens in num_scheduled_tokens.items():
                self.kv_connector.request_scheduled(self.sequences[seq_id], num_tokens)
            kv_connector_metadata = self.kv_connector.build_connector_meta(len(self._loading))
        finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, set()
        preempted_seq_ids, self._preempted_seq_ids = self._preempted_seq_ids, set()
        for seq_id in num_scheduled_tokens:
            self._in_flight[seq_id] = self.sequences[seq_id]
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            finished_req_ids=finished_seq_ids,
            preempted_req_ids=preempted_seq_ids & finished_seq_ids,
            scheduled_spec_decode_tokens=spec_decode_tokens,
            propose_drafts=speculate,
            kv_connector_metadata=kv_connector_metadata,
        )

    def _step_token_ids(
        self, seq_id: str, num_scheduled_tokens: dict[str, int], spec_decode_tokens: dict[str, list[int]]
    ) -> list[int]:
        if not self.send_token_ids:
            return []
        seq = self.sequences[seq_id]
        start = seq.num_computed_tokens
        end = start + num_scheduled_tokens[seq_id] - len(spec_decode_tokens.get(seq_id, ()))
        return seq.all_token_ids[start:end]

    @property
    def num_sequences_in_flight(self) -> int:
        """Requests scheduled in batches whose results are not applied yet."""
        return len(self._in_flight)

    def _speculation_on(self) -> bool:
        """Speculate unless more requests are queued than ``disable_by_batch_size``: a full
        batch already keeps the machine busy and drafts only add work."""
        if self.speculative is None:
            return False
        limit = self.speculative.disable_by_batch_size
        return limit is None or len(self.running) + len(self.waiting) <= limit

    def _max_draft_tokens(self, seq: EngineSequence, token_budget: int) -> int:
        """Drafts worth verifying for a decoding request: within the step's token budget (after
        its pending token), and no more than its output may still grow (max_tokens, the
        model's context: a draft's position must stay inside it)."""
        limit = min(token_budget - 1, self.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - seq.num_output_tokens - 1)
        return max(0, limit)

    def _num_running_tokens_to_schedule(self, seq: EngineSequence, token_budget: int) -> int:
        num_uncomputed = seq.num_tokens - seq.num_computed_tokens
        if not self.enable_chunked_prefill:
            return num_uncomputed if num_uncomputed <= token_budget else 0
        num_new_tokens = min(num_uncomputed, token_budget)
        if self.long_prefill_token_threshold:
            num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
        return num_new_tokens

    def _allocate_with_lookahead(
        self, seq: EngineSequence, num_new_tokens: int, speculate: bool, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """``allocate_slots`` for the scheduled tokens plus the lookahead slots while
        speculating; when the lookahead does not fit, the scheduled tokens alone (the proposer
        then drafts fewer tokens: it never writes past the block table it is given)."""
        if speculate and self.num_lookahead_tokens:
            new_block_ids = self.block_manager.allocate_slots(
                seq, num_new_tokens + self.num_lookahead_tokens, computed_blocks
            )
            if new_block_ids is not None:
                return new_block_ids
        return self.block_manager.allocate_slots(seq, num_new_tokens, computed_blocks)

    def _schedule_waiting(
        self, token_budget: int, num_scheduled_tokens: dict[str, int], speculate: bool = False
    ) -> list[NewRequestData]:
        """Admit waiting requests in order; the head blocks the rest so nothing starves."""
        new_reqs: list[NewRequestData] = []
        num_partial_prefills = 0
        if self.enable_chunked_prefill and len(self.waiting):
            # a running request is mid-prefill when more than its one pending token is uncomputed
            num_partial_prefills = sum(
                1
                for r in self.running
                if r.num_tokens - r.num_computed_tokens - num_scheduled_tokens.get(r.seq_id, 0) > 1
            )
        now = time.monotonic()
        running_loras = self.running_lora_ids()
        while len(self.waiting) and token_budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if seq.seq_id in self._in_flight or seq.seq_id in self._loading:
                break  # its id's aborted predecessor has a batch or a load in flight: after that
            lora_id = None if seq.lora_request is None else seq.lora_request.lora_int_id
            if (
                lora_id is not None
                and self.max_loras is not None
                and lora_id not in running_loras
                and len(running_loras) >= self.max_loras
            ):
                # every adapter slot is taken by running requests: it waits (and, so nothing
                # starves, so do the requests behind it) until one of those adapters is done
                break
            computed_blocks, num_cached_tokens = None, 0
            if seq.seq_id in self._loaded_ids:
                num_cached_tokens = seq.num_computed_tokens  # its local hit and loaded blocks
            # a prefix hit would skip the prompt positions whose logprobs were asked for (or
            # the hidden states a pooling request pools)
            elif (
                self.block_manager.enable_prefix_caching
                and seq.sampling_params.prompt_logprobs is None
                and seq.pooling_params is None
            ):
                computed_blocks, num_cached_tokens = self.block_manager.get_computed_blocks(seq)
            kv_connector = None if seq.seq_id in self._loaded_ids else self.kv_connector
            num_external_tokens = 0
            if kv_connector is not None:
                num_external_tokens = kv_connector.get_num_new_matched_tokens(seq, num_cached_tokens)
            if kv_connector is not None and num_external_tokens:
                # blocks for the tokens the connector holds; the request waits for their load
                if self.block_manager.allocate_slots(seq, num_external_tokens, computed_blocks) is None:
                    break
                self.waiting.pop()
                seq.num_computed_tokens = num_cached_tokens
                kv_connector.update_state_after_alloc(seq, num_cached_tokens, num_external_tokens)
                self._loading[seq.seq_id] = seq
                continue
            num_uncomputed = seq.num_tokens - num_cached_tokens
            # a pooling request pools its whole prompt in one step: never chunked
            if self.enable_chunked_prefill and seq.pooling_params is None:
                num_new_tokens = min(num_uncomputed, token_budget)
                if self.long_prefill_token_threshold:
                    num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
                if num_new_tokens < num_uncomputed and num_partial_prefills >= self.max_num_partial_prefills:
                    break
            elif num_uncomputed <= token_budget:
                num_new_tokens = num_uncomputed
            elif num_uncomputed > self.max_num_batched_tokens and not num_scheduled_tokens:
                num_new_tokens = num_uncomputed  # can never fit the budget: runs whole, alone
            else:
                break
            new_block_ids = self._allocate_with_lookahead(seq, num_new_tokens, speculate, computed_blocks)
            if new_block_ids is None:
                break
            self.waiting.pop()
            if kv_connector is not None:
                kv_connector.update_state_after_alloc(seq, num_cached_tokens, 0)
            self._loaded_ids.discard(seq.seq_id)
            if num_new_tokens < num_uncomputed:
                num_partial_prefills += 1
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_tokens = num_cached_tokens
            self.running.append(seq)
            if lora_id is not None:
                running_loras.add(lora_id)
            num_scheduled_tokens[seq.seq_id] = num_new_tokens
            token_budget -= num_new_tokens
            new_reqs.append(
                NewRequestData(
                    req_id=seq.seq_id,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=list(seq.output_token_ids),
                    sampling_params=seq.sampling_params,
                    block_ids=self.block_manager.get_block_table(seq.seq_id),
                    num_computed_tokens=num_cached_tokens,
                    pooling_params=seq.pooling_params,
                    lora_request=seq.lora_request,
                    mm_items=seq.mm_items,
                )
            )
        return new_reqs

    def running_lora_ids(self) -> set[int]:
        """The ids of the LoRA adapters of the running requests."""
        return {seq.lora_request.lora_int_id for seq in self.running if seq.lora_request is not None}

    def waiting_lora_ids(self) -> set[int]:
        """The ids of the LoRA adapters of the waiting requests."""
        return {
            seq.lora_request.lora_int_id
            for seq in self.sequences.values()
            if seq.lora_request is not None and seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        }

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineSequence]:
        """Apply one step's results: advance computed tokens, append sampled tokens and
        logprobs, check token-level stops, free what finished.

        :returns: the requests that got tokens or finished, for the engine to detokenize.
        """
        changed, self._finished_in_schedule = self._finished_in_schedule, []
        if model_runner_output.kv_connector_output is not None:
            self._finish_loads(model_runner_output.kv_connector_output)
        errors = model_runner_output.errors
        now = time.monotonic()
        any_finished = False
        for seq_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            scheduled = self._in_flight.pop(seq_id, None)
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING or seq_id in errors:
                continue  # finished or aborted since schedule(); errors are handled below
            if scheduled is not None and scheduled is not seq:
                continue  # a new request reusing the id of one aborted while in flight
            if seq.num_output_tokens == 0 and seq_id in model_runner_output.prompt_logprobs:
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = []
                seq.prompt_logprobs.extend(model_runner_output.prompt_logprobs[seq_id])
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(seq_id)
            num_rejected = 0
            if drafts:
                # the worker returns the accepted drafts plus one token: the rejected drafts'
                # positions count as uncomputed, so the next step overwrites their KV slots
                num_accepted = max(0, len(model_runner_output.sampled_token_ids.get(seq_id) or [1]) - 1)
                num_rejected = len(drafts) - num_accepted
                if self.spec_decoding_stats is not None:
                    self.spec_decoding_stats.observe(len(drafts), num_accepted)
            seq.num_computed_tokens += num_tokens - num_rejected
            if seq.pooling_params is not None:
                self._finish_pooled(seq, model_runner_output)
                any_finished = True
                changed.append(seq)
                continue
            sampled_token_ids = model_runner_output.sampled_token_ids.get(seq_id)
            # a chunk that leaves prompt tokens uncomputed samples nothing
            if not sampled_token_ids or seq.num_computed_tokens < seq.num_tokens:
                continue
            token_logprobs = model_runner_output.logprobs.get(seq_id) or []
            for position, token_id in enumerate(sampled_token_ids):
                seq.output_token_ids.append(token_id)
                if position < len(token_logprobs):
                    if seq.logprobs is None:
                        seq.logprobs = []
                    seq.logprobs.append(token_logprobs[position])
                if self._check_stop(seq, token_id):
                    # a stop before the last verified token leaves fewer tokens than were
                    # computed; blocks are cached only over real tokens
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                    self._finish(seq, seq.status)
                    any_finished = True
                    break
            if not seq.finished:
                seq.draft_token_ids = list(model_runner_output.draft_token_ids.get(seq_id, ()))
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            changed.append(seq)
        for seq_id in errors:
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue
            logger.warning("request %s failed in the worker: %s", seq_id, errors[seq_id])
            if seq.status is not SequenceStatus.RUNNING:
                self.waiting.remove_ids({seq_id})
            self._finish(seq, SequenceStatus.FINISHED_ERROR)
            any_finished = True
            changed.append(seq)
        if any_finished:
            self.running = [r for r in self.running if not r.finished]
        return changed

    def _finish_loads(self, output: KVConnectorOutput) -> None:
        """Requests whose connector loads ended go back to the head of the waiting queue, their
        loaded blocks counted as computed (a short load leaves the rest to compute)."""
        assert self.kv_connector is not None  # only a connector's worker reports loads
        self.kv_connector.stats.add(output)
        for seq_id, num_blocks in output.finished_loads.items():
            seq = self._loading.pop(seq_id, None)
            if seq is None:
                continue
            if seq.finished:  # aborted while loading: its blocks were kept for the loader until now
                self.block_manager.free(seq)
                continue
            seq.num_computed_tokens += num_blocks * self.block_manager.block_size
            self._loaded_ids.add(seq_id)
            self.waiting.push_front(seq, self._order_key(seq))

    def _check_stop(self, seq: EngineSequence, token_id: int) -> bool:
        """Token-level stops, in order: stop_token_ids, EOS, max_tokens, max_model_len."""
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in (params.stop_token_ids or ()):
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token_id
                return True
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = None
                return True
        if (
            params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH
            return True
        return False

    # ---- finishing and preemption --------------------------------------------------------------

    def finish_sequences(self, seq_ids: str | Iterable[str], status: SequenceStatus) -> list[EngineSequence]:
        """Finish requests from outside (abort, stop string): they leave the queues and free
        their blocks now. Unknown or already finished ids are ignored.

        :returns: the requests finished by this call.
        """
        if not status.finished:
            raise InvalidRequestError(f"finish_sequences needs a FINISHED_* status, got {status.name}", param="status")
        if isinstance(seq_ids, str):
            seq_ids = (seq_ids,)
        known_ids = {seq_id for seq_id in seq_ids if seq_id in self.sequences}
        if not known_ids:
            return []
        self.running = [r for r in self.running if r.seq_id not in known_ids]
        self.waiting.remove_ids(known_ids)
        finished = [self.sequences[seq_id] for seq_id in known_ids]
        for seq in finished:
            self._finish(seq, status)
        return finished

    def _finish(self, seq: EngineSequence, status: SequenceStatus) -> None:
        """Release a request that has already left (or is about to leave) the queues."""
        seq.status = status
        if self._loading.get(seq.seq_id) is not seq:  # a loading request's blocks wait for its loader
            self.block_manager.free(seq)
        self._loaded_ids.discard(seq.seq_id)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(seq.seq_id)
        del self.sequences[seq.seq_id]
        del self._admission_seq[seq.seq_id]
        self._finished_seq_ids.add(seq.seq_id)
        self._preempted_seq_ids.discard(seq.seq_id)

    def _finish_pooled(self, seq: EngineSequence, model_runner_output: ModelRunnerOutput) -> None:
        """A pooling request ends in the step that computed its prompt, freeing its blocks."""
        if seq.seq_id in model_runner_output.pooled:
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            return
        seq.stop_reason = "the model runner returned no pooled output for this prompt"
        self._finish(seq, SequenceStatus.FINISHED_ERROR)

    def _finish_unfittable(self, seq: EngineSequence) -> None:
        logger.warning(
            "request %s needs more KV-cache blocks than the whole cache holds (%d blocks of %d "
            "tokens) after %d tokens; finishing it with reason 'length'",
            seq.seq_id,
            self.block_manager.num_blocks,
            self.block_manager.block_size,
            seq.num_tokens,
        )
        self.running.remove(seq)
        self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        self._finished_in_schedule.append(seq)

    def _preempt(self, seq: EngineSequence) -> None:
        """Free a running request's blocks and queue it to be recomputed from scratch.

        Its computed full blocks stay in the prefix cache, so on resumption it usually hits
        them instead of recomputing everything.
        """
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        if seq.num_output_tokens == 0 and seq.prompt_logprobs:
            seq.prompt_logprobs = []  # the prompt is recomputed from its first position
        self.num_preemptions += 1
        self._finished_seq_ids.add(seq.seq_id)
        self._preempted_seq_ids.add(seq.seq_id)
        self.waiting.push_front(seq, self._order_key(seq))
        logger.warning(
            "request %s preempted (KV cache full, %d preemptions so far); it will be recomputed. "
            "More KV-cache memory or a lower --max-num-seqs avoids this.",
            seq.seq_id,
            self.num_preemptions,
        )

    def _order_key(self, seq: EngineSequence) -> OrderKey:
        """Lower runs first; the highest running key is preempted first."""
        admission_seq = self._admission_seq[seq.seq_id]
        if self.use_priority:
            return (seq.priority, seq.arrival_time, admission_seq)
        return (admission_seq,)

    # ---- introspection -----------------------------------------------------------------------

    def has_unfinished_sequences(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self._loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._loading)

    def get_sequence(self, seq_id: str) -> EngineSequence | None:
        return self.sequences.get(seq_id)

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        prefix_stats = self.block_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            prefix_cache_queries=prefix_stats.queries,
            prefix_cache_hits=prefix_stats.hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=self.spec_decoding_stats.copy() if self.spec_decoding_stats is not None else None,
            kv_connector=dataclasses.replace(self.kv_connector.stats) if self.kv_connector is not None else None,
        )
