"""A worker: the platform, the model runner and its KV cache, built from plain data (a
:class:`~tokenloom.core.executor.WorkerSpec`). Executors own one or more workers; a worker
never runs plugin discovery. ``parallel`` is its place among the engine's workers and its
communicators (one worker alone when omitted); ``num_local_workers`` how many workers share
this machine's cores (each takes its share of the threads). With ``--kv-transfer-config`` it
also runs the worker side of the KV connector around each step: loads started before the
forward, the step's computed blocks handed to the saver after it."""

from __future__ import annotations

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.distributed import ParallelState
from tokenloom.core.executor import WorkerSpec
from tokenloom.core.kv_connector import KVConnectorWorker, build_kv_connector
from tokenloom.plugins.manager import PluginSet


class Worker:
    def __init__(self, spec: WorkerSpec, parallel: ParallelState | None = None, num_local_workers: int = 1):
        from tokenloom.core.model_runner import ModelRunner

        plugins = PluginSet.from_plain(spec.plugin_tables)
        self.spec = spec
        self.plugins = plugins
        self.kv_connector: KVConnectorWorker | None = None
        self.platform = plugins.registry("platform").get(spec.platform)()
        if num_local_workers > 1:
            self.platform.configure_threads(num_local_workers=num_local_workers)
        else:  # a platform plugin written before workers shared a machine takes no argument
            self.platform.configure_threads()
        self.runner = ModelRunner(
            spec.config, spec.model_info, plugins, self.platform, parallel, profile_mm_items=spec.profile_mm_items
        )

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        if self.spec.config.kv_transfer is not None:
            connector = build_kv_connector(self.spec.config, self.spec.model_info, self.plugins)
            self.kv_connector = KVConnectorWorker(connector, self.runner.kv_caches)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output; None on a pipeline stage before the last (it samples nothing)."""
        kv_connector = self.kv_connector
        if kv_connector is None:
            return self.runner.execute(scheduler_output)
        metadata = scheduler_output.kv_connector_metadata
        if metadata is not None:
            self.runner.note_blocks_written([block_id for blocks in metadata.loads.values() for block_id, _ in blocks])
        kv_connector.start_load_kv(metadata)
        output = self.runner.execute(scheduler_output)
        kv_connector.save_kv(metadata)  # the forward has written the step's blocks
        if output is not None:
            output.kv_connector_output = kv_connector.get_finished(wait=scheduler_output.is_empty)
        return output
