"""The ``uni`` executor: one worker in the engine's own process (the default for one worker)."""

from __future__ import annotations

from tokenloom.worker_api import Executor, ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def initialize(self) -> int:
        from tokenloom.worker_api import Worker

        self.worker = Worker(self.spec)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.allocate_kv_cache(num_blocks)
        return num_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    def prefault_kv_cache(self, max_bytes: int) -> int:
        return self.worker.runner.prefault_kv_cache(max_bytes)

    def shutdown(self) -> None:
        self.worker = None
