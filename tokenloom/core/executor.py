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

    def check_health(self) -> None:
        """Raise when a worker has died."""

    def shutdown(self) -> None:
        """Stop the workers and free their memory; idempotent."""
