"""The ``Platform`` interface: a device (where tensors live, its default dtype, its memory,
and which attention backend runs there). Implementations are plugins."""

from __future__ import annotations

import os
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.plugins.registry import Registry, RegistryEntry

ATTENTION_BACKEND_ENV_VARS = ("TOKENLOOM_ATTENTION_BACKEND", "VLLM_ATTENTION_BACKEND")


def requested_attention_backend(flag_value: str | None) -> tuple[str, str]:
    """``(name, where it came from)``: the flag when it is not ``auto``, else the first of
    TOKENLOOM_ATTENTION_BACKEND / VLLM_ATTENTION_BACKEND that is set, else ``auto``."""
    if flag_value and flag_value != "auto":
        return flag_value, "--attention-backend"
    for variable in ATTENTION_BACKEND_ENV_VARS:
        value = os.environ.get(variable, "").strip()
        if value:
            return value, variable
    return "auto", "--attention-backend"


def find_attention_backend(backends: Registry, name: str, source: str = "--attention-backend") -> RegistryEntry:
    """The registered backend ``name`` names: its own name or one of its ``aliases`` (vLLM's
    spellings, such as ``TORCH_SDPA``), in any case. ConfigError naming ``source`` and listing
    the backends there are."""
    key = name.strip().lower()
    for entry in backends.entries():
        if key == entry.name.lower() or key in (alias.lower() for alias in entry.options.get("aliases", ())):
            return entry
    aliases = [alias for entry in backends.entries() for alias in entry.options.get("aliases", ())]
    raise ConfigError(
        f"{source}: no attention backend {name!r} in tokenloom; choose one of "
        f"{', '.join(['auto', *backends.names()])}"
        + (f" (vLLM's spellings {', '.join(alias.upper() for alias in aliases)} are accepted)" if aliases else ""),
        param="attention-backend",
    )


def check_attention_backend(flag_value: str | None, backends: Registry) -> None:
    """ConfigError now (in the main process, before any model loads) for a backend name, from
    the flag or the environment, that no plugin registered."""
    name, source = requested_attention_backend(flag_value)
    if name.strip().lower() != "auto":
        find_attention_backend(backends, name, source)


def attention_backend_target(flag_value: str | None, platform: Platform, backends: Registry) -> str:
    """``"module:Class"`` of the attention backend the flag or environment asks for, or of the
    platform's own choice for ``auto``."""
    name, source = requested_attention_backend(flag_value)
    if name.strip().lower() == "auto":
        name, source = platform.attention_backend(), f"the {type(platform).__name__}'s attention backend"
    return find_attention_backend(backends, name, source).target_path


class Platform:
    """A device platform. Registered with ``register_platforms``; one instance per engine.

    Methods are called in the worker process when it builds the model and sizes the KV cache,
    and ``is_available`` in the main process when ``--device auto`` picks a platform.
    """

    #: the torch device type, e.g. "cpu"
    device_type: str = "cpu"
    #: ``--device auto`` takes the available platform with the highest priority (ties: the
    #: first registered); accelerators rank above the CPU, which is always available
    auto_priority: int = 0
    #: True: before :meth:`kv_cache_budget_bytes` the model runner runs one forward pass of the
    #: largest step (throwaway KV cache), so a memory profile includes peak activations
    profiles_activations: bool = False
    #: the ``torch.distributed`` backend workers of one engine talk through (gloo on the CPU,
    #: nccl on NVIDIA GPUs); see :mod:`tokenloom.core.distributed`
    distributed_backend: str = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        """True when this platform can run here (checked for ``--device auto``)."""
        raise NotImplementedError

    def torch_device(self) -> Any:
        import torch

        return torch.device(self.device_type)

    def default_dtype(self, model_dtype: Any) -> Any:
        """The dtype to run a model stored in ``model_dtype`` with, for ``--dtype auto``."""
        raise NotImplementedError

    def attention_backend(self) -> str:
        """The registered name (``register_attention_backends``) of the paged attention backend
        to use on this device when ``--attention-backend`` is ``auto``."""
        raise NotImplementedError

    def total_memory_bytes(self) -> int:
        """Memory of the device (what ``--gpu-memory-utilization`` is a fraction of)."""
        raise NotImplementedError

    def available_memory_bytes(self) -> int:
        """Memory free right now, for sizing the KV cache."""
        raise NotImplementedError

    def kv_cache_budget_bytes(self, gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take when neither --kv-cache-memory-bytes nor
        --num-gpu-blocks-override is given; called once after the model is loaded. By default
        ``gpu_memory_utilization`` of the memory available now (a GPU platform subtracts what
        its memory profile measured instead)."""
        return int(gpu_memory_utilization * self.available_memory_bytes())

    def host_to_device(self, tensor: Any) -> Any:
        """A host tensor (the step's token ids, positions, block tables) on this device."""
        return tensor.to(self.torch_device())

    def default_kv_cache_bytes(self) -> int | None:
        """A cap on the KV cache when neither --kv-cache-memory-bytes nor
        --num-gpu-blocks-override is given (None: --gpu-memory-utilization alone decides)."""
        return None

    def verify_row_cost(self) -> float:
        """Speculative decoding's cost model (adaptive draft lengths): the time one more token
        row adds to a one-sequence decode step, as a fraction of that step. Called once in the
        worker when speculation is on and ``--speculative-config`` gives no
        ``verify_row_cost``. By default 0.1: a step reads its weights once for all its rows."""
        return 0.1

    def finish_loading(self, model: Any) -> None:
        """Called once in the worker when ``model``'s weights are loaded and packed, before the
        KV cache is sized: the place to settle where they live (the CPU platform moves their
        pages onto huge pages). By default nothing."""

    def finish_step(self, num_tokens: int) -> None:
        """Called in the worker after every step (``num_tokens``: the tokens it ran, all its
        requests' together), whether or not it succeeded: the place to give a large step's freed
        temporaries back (the CPU platform trims the C heap after a prompt's step). By default
        nothing."""

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A zero-filled tensor on this device (the KV cache is allocated with it)."""
        import torch

        return torch.zeros(shape, dtype=dtype, device=self.torch_device())

    def map_blocks(self, kv_caches: list[Any], first_block: int, end_block: int) -> bool:
        """Blocks ``[first_block, end_block)`` of every layer's cache (its dimension 1) are about
        to be written for the first time: a platform whose :meth:`zeros` maps memory lazily may
        map them now, all at once and without changing their contents, rather than fault after
        fault in the step. True when it does; by default False (nothing to map)."""
        return False

    def configure_threads(self, num_local_workers: int = 1) -> None:
        """Set thread counts that fit the machine (called once in the worker, before the model
        loads). ``num_local_workers``: how many of the engine's workers run on this machine,
        sharing its cores (the ``mp`` executor's ``tp * pp`` processes)."""
