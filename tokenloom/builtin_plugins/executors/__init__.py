"""The built-in executors: ``uni`` (one worker in the engine's process), ``mp`` (``tp * pp``
worker processes on this machine) and ``ray`` (Ray actors, across machines)."""

from __future__ import annotations

from tokenloom.plugin_api import hookimpl


@hookimpl
def register_executors(register):
    # targets are imported on first use: ``ray`` needs the optional extra only when chosen
    register("uni", "tokenloom.builtin_plugins.executors.uniproc:UniProcExecutor")
    register("mp", "tokenloom.builtin_plugins.executors.multiproc:MultiprocExecutor")
    register("ray", "tokenloom.builtin_plugins.executors.ray_executor:RayExecutor")
