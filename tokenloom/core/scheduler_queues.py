"""The scheduler's queues and the life of a sequence through them: admitted to the waiting
queue, running, preempted back to the waiting queue, loading its prefix through a KV
connector, finished. :class:`SchedulerQueues` keeps the invariants every step relies on: a
sequence is in exactly one of the waiting queue, the running list and the loading set; it
holds KV blocks only while running or loading; every finished or preempted id reaches the
worker once. What runs in each step is decided by its subclass,
:class:`~tokenloom.core.scheduler.Scheduler`.

With a KV connector (``--kv-transfer-config``, :mod:`tokenloom.core.kv_connector`) the third
place holds sequences: ``_loading``, requests whose prefix blocks the worker is loading. They
hold their blocks there (an aborted one until its loader is done writing them) and return to
the head of the waiting queue, still holding them, when the worker reports the load.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenloom.core.admission import check_admissible
from tokenloom.core.block_manager import BlockManager
from tokenloom.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.core.waiting_queue import FCFSQueue, OrderKey, PriorityQueue
from tokenloom.errors import InvalidRequestError, OverloadedError


class SchedulerQueues:
    """The waiting queue, the running list and the loading set, and every move between them."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_model_len: int,
        *,
        use_priority: bool,
        max_waiting_requests: int | None,
        kv_connector: KVConnectorScheduler | None,
    ):
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.use_priority = use_priority
        # None: no limit
        self.max_waiting_requests = max_waiting_requests
        self.kv_connector = kv_connector
        self.sequences: dict[str, EngineSequence] = {}
        self.waiting = PriorityQueue() if use_priority else FCFSQueue()
        self.running: list[EngineSequence] = []
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
            check_admissible(seq, self.sequences, self.max_model_len, self.block_manager)
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

    # ---- leaving the queues ------------------------------------------------------------------

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

    @property
    def num_sequences_in_flight(self) -> int:
        """Requests scheduled in batches whose results are not applied yet."""
        return len(self._in_flight)

    def get_sequence(self, seq_id: str) -> EngineSequence | None:
        return self.sequences.get(seq_id)

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

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()
