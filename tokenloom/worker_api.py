"""The one stable import surface for the code that hosts or runs beside a model in a worker:
executors (``register_executors``: they start the workers and drive a step on each) and
speculative-decoding proposers (``register_proposers``: they draft in the worker, and one that
runs a draft model builds it as the target is built). Internal modules may move; the names here
do not.

Such a plugin is registered from :mod:`tokenloom.plugin_api` (``@hookimpl``) and its code
imports from here. Names are imported on first access, so an executor module that needs the
:class:`Worker` (and with it torch) only inside its ``initialize`` stays cheap to import, as the
main process imports it when it checks ``--distributed-executor-backend``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and editors
    from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
    from tokenloom.core.config import EngineConfig, SpeculativeConfig
    from tokenloom.core.distributed import ParallelRank, ParallelState, import_ray, init_parallel_state
    from tokenloom.core.executor import (
        EXECUTE_MODEL_TIMEOUT_ENV,
        NODE_AUTHKEY_ENV,
        Executor,
        WorkerSpec,
        execute_model_timeout,
        is_stopped,
        node_authkey,
        wait_for_node_processes,
        worker_process,
    )
    from tokenloom.core.model_loader import ModelInfo, build_model, resolve_model
    from tokenloom.core.platform import Platform, attention_backend_target
    from tokenloom.core.spec_decode.proposer import Draft, DraftRequest, Proposer, ProposerSpec
    from tokenloom.core.step_inputs import prepare_batch
    from tokenloom.core.worker import Worker
    from tokenloom.plugins.registry import resolve_target

_LAZY = {
    # an executor: its interface, what it ships to its workers and what a step sends and returns
    "Executor": "tokenloom.core.executor",
    "WorkerSpec": "tokenloom.core.executor",
    "SchedulerOutput": "tokenloom.core.batch",
    "ModelRunnerOutput": "tokenloom.core.batch",
    # the worker an executor hosts (one per rank), and the rank's place in the tp x pp grid
    "Worker": "tokenloom.core.worker",
    "ParallelRank": "tokenloom.core.distributed",
    "ParallelState": "tokenloom.core.distributed",
    "init_parallel_state": "tokenloom.core.distributed",
    "import_ray": "tokenloom.core.distributed",
    # how long a step may take before an executor declares the engine dead, and a stopped worker
    "EXECUTE_MODEL_TIMEOUT_ENV": "tokenloom.core.executor",
    "execute_model_timeout": "tokenloom.core.executor",
    "is_stopped": "tokenloom.core.executor",
    # the secret of the control connections between nodes
    "NODE_AUTHKEY_ENV": "tokenloom.core.executor",
    "node_authkey": "tokenloom.core.executor",
    "wait_for_node_processes": "tokenloom.core.executor",
    # a worker process: forked from a forkserver that has imported torch
    "worker_process": "tokenloom.core.executor",
    # a proposer: its interface and what it is constructed with
    "Proposer": "tokenloom.core.spec_decode.proposer",
    "ProposerSpec": "tokenloom.core.spec_decode.proposer",
    "DraftRequest": "tokenloom.core.spec_decode.proposer",
    "Draft": "tokenloom.core.spec_decode.proposer",
    "EngineConfig": "tokenloom.core.config",
    "SpeculativeConfig": "tokenloom.core.config",
    # a proposer that runs a model: resolved, built and fed as the target is
    "ModelInfo": "tokenloom.core.model_loader",
    "resolve_model": "tokenloom.core.model_loader",
    "build_model": "tokenloom.core.model_loader",
    "prepare_batch": "tokenloom.core.step_inputs",
    "Platform": "tokenloom.core.platform",
    "attention_backend_target": "tokenloom.core.platform",
    "resolve_target": "tokenloom.plugins.registry",
}

# every name below, spelled out so that linters and type checkers see the re-exports
__all__ = [
    "Executor",
    "WorkerSpec",
    "SchedulerOutput",
    "ModelRunnerOutput",
    "Worker",
    "ParallelRank",
    "ParallelState",
    "init_parallel_state",
    "import_ray",
    "EXECUTE_MODEL_TIMEOUT_ENV",
    "NODE_AUTHKEY_ENV",
    "node_authkey",
    "wait_for_node_processes",
    "worker_process",
    "execute_model_timeout",
    "is_stopped",
    "Proposer",
    "ProposerSpec",
    "DraftRequest",
    "Draft",
    "EngineConfig",
    "SpeculativeConfig",
    "ModelInfo",
    "resolve_model",
    "build_model",
    "prepare_batch",
    "Platform",
    "attention_backend_target",
    "resolve_target",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenloom.worker_api' has no attribute {name!r}")
