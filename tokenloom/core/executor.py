"""The ``Executor`` interface: it owns the workers that hold the model and the KV cache.
The core only sends it a :class:`SchedulerOutput` per step and receives sampled tokens.
Implementations (one process, several processes, Ray) are plugins."""

from __future__ import annotations

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.config import EngineConfig


class Executor:
    """Registered with ``register_executors``; constructed once, in the main process, with
    the engine config (whose ``plugin_tables`` are the plain-data plugin registries that
    workers import from; workers never run plugin discovery)."""

    def __init__(self, config: EngineConfig):
        self.config = config

    def initialize(self) -> int:
        """Start workers, load the model, size and allocate the KV cache.

        :returns: the number of KV-cache blocks every worker allocated.
        """
        raise NotImplementedError

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers; called by the engine loop, one step at a time."""
        raise NotImplementedError

    def prefault_kv_cache(self, max_bytes: int) -> int:
        """Optional: while the engine is idle, make the workers map up to ``max_bytes`` more of
        KV-cache memory that no request has used yet (a lazily zeroed cache otherwise pays a
        page fault per page on a request's critical path). Called on the engine's thread,
        between steps, never concurrently with :meth:`execute`.

        :returns: the bytes mapped; 0 when there is nothing left to do (the default).
        """
        return 0

    def check_health(self) -> None:
        """Raise when a worker has died."""

    def shutdown(self) -> None:
        """Stop the workers and free their memory; idempotent."""
