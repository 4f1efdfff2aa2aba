"""Continuous batching: each step decides which sequences run and how many tokens each
computes, under a token budget and a sequence cap, with chunked prefill, prefix-cache hits,
preemption by recompute, and FCFS or priority order; then applies the step's results. The
queues it moves sequences between, and their invariants, are its base class's
(:class:`~tokenloom.core.scheduler_queues.SchedulerQueues`); how many tokens a request
computes is :mod:`tokenloom.core.step_budget`'s.

With pipeline parallelism the engine keeps several batches in flight (vLLM V1's batch
queue): ``schedule()`` may run again before the previous batch's ``update_from_output``, and a
sequence with a batch in flight is never scheduled again (nor preempted) until its result is
applied, so a sequence is in at most one batch and every batch sees its latest tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tokenloom.core.batch import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenloom.core.block_manager import BlockManager
from tokenloom.core.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.kv_connector import KVConnector, KVConnectorScheduler
from tokenloom.core.scheduler_queues import SchedulerQueues
from tokenloom.core.scheduler_stats import SchedulerStats, SpecDecodingStats
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.core.step_budget import PrefillChunking, check_items_fit_a_step, keep_items_whole, max_draft_tokens
from tokenloom.errors import ConfigError

logger = logging.getLogger(__name__)


class Scheduler(SchedulerQueues):
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
        block_manager = BlockManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        max_waiting = scheduler_config.max_waiting_requests
        super().__init__(
            block_manager,
            max_model_len,
            use_priority=scheduler_config.scheduling_policy == "priority",
            # 0 or less (or None) lifts the limit
            max_waiting_requests=max_waiting if max_waiting is not None and max_waiting > 0 else None,
            kv_connector=KVConnectorScheduler(kv_connector, block_manager) if kv_connector else None,
        )
        self.chunking = PrefillChunking.from_config(scheduler_config, max_model_len)
        self.max_num_seqs = scheduler_config.max_num_seqs
        # LoRA adapters the worker holds slots for: at most this many distinct ones run at once
        # (None: the engine serves no adapters)
        self.max_loras = max_loras
        self.num_preemptions = 0
        self.send_token_ids = send_token_ids
        self.speculative = speculative
        self.spec_decoding_stats = SpecDecodingStats(speculative.num_speculative_tokens) if speculative else None
        # slots past a request's scheduled tokens, allocated while speculating, where the
        # proposer writes its drafts' KV right after the step (a draft model: k)
        self.num_lookahead_tokens = num_lookahead_tokens if speculative else 0

    @property
    def max_num_batched_tokens(self) -> int:
        return self.chunking.max_num_batched_tokens

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.chunking.enable_chunked_prefill

    def add_sequences(self, sequences: list[EngineSequence]) -> None:
        """:meth:`SchedulerQueues.add_sequences`, refusing first an image that attends both ways
        and can never fit one step's chunk."""
        for seq in sequences:
            check_items_fit_a_step(seq, self.chunking)
        super().add_sequences(sequences)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first (a decode token or the next prompt chunk
        each, in admission order), then waiting ones in policy order, all within the token
        budget and the sequence cap."""
        token_budget = self.chunking.max_num_batched_tokens
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
            num_new_tokens = self.chunking.running_chunk(seq.num_tokens - seq.num_computed_tokens, token_budget)
            num_new_tokens = keep_items_whole(seq.mm_items, seq.num_computed_tokens, num_new_tokens)
            if num_new_tokens == 0:
                continue
            # drafts are verified in this step or never: the next step brings new ones
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            if speculate and drafts and seq.num_tokens - seq.num_computed_tokens == 1:
                drafts = drafts[: max_draft_tokens(seq, token_budget, self.max_model_len)]
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

    def _speculation_on(self) -> bool:
        """Speculate unless more requests are queued than ``disable_by_batch_size``: a full
        batch already keeps the machine busy and drafts only add work."""
        if self.speculative is None:
            return False
        limit = self.speculative.disable_by_batch_size
        return limit is None or len(self.running) + len(self.waiting) <= limit

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
        if self.chunking.enable_chunked_prefill and len(self.waiting):
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
            num_new_tokens = self.chunking.waiting_chunk(
                num_uncomputed,
                token_budget,
                # a pooling request pools its whole prompt in one step: never chunked
                chunkable=seq.pooling_params is None,
                num_partial_prefills=num_partial_prefills,
                step_is_empty=not num_scheduled_tokens,
            )
            if num_new_tokens is not None:
                num_new_tokens = keep_items_whole(seq.mm_items, num_cached_tokens, num_new_tokens) or None
            if num_new_tokens is None:
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

    # ---- the step's results ------------------------------------------------------------------

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
