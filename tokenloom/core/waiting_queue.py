"""The scheduler's waiting queue, one class per ``--scheduling-policy``: arrival order
(``fcfs``) or (priority, arrival) order (``priority``), each taking a preempted request back
ahead of the requests that arrived after it."""

from __future__ import annotations

import heapq
from collections import deque

from tokenloom.core.sequence import EngineSequence

# where a request stands in the waiting order: lower runs first (see Scheduler._order_key)
OrderKey = tuple[float, ...]


class FCFSQueue:
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


class PriorityQueue:
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
