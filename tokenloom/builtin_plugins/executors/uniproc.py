"""The ``uni`` executor: one worker in the engine's own process (the default for one worker);
this module's hook also registers the ``mp`` and ``ray`` executors."""

from __future__ import annotations

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.executor import Executor
from tokenloom.plugin_api import hookimpl


class UniProcExecutor(Executor):
    def initialize(self) -> int:
        from tokenloom.core.worker import Worker

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


@hookimpl
def register_executors(register):
    # the built-in executors, registered together under the one entry point executors have had
    # (targets are imported on first use: ``ray`` needs the optional extra only when chosen)
    register("uni", "tokenloom.builtin_plugins.executors.uniproc:UniProcExecutor")
    register("mp", "tokenloom.builtin_plugins.executors.multiproc:MultiprocExecutor")
    register("ray", "tokenloom.builtin_plugins.executors.ray_executor:RayExecutor")
