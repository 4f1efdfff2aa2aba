"""The ``Platform`` interface: a device (where tensors live, its default dtype, its memory,
and which attention backend runs there). Implementations are plugins."""

from __future__ import annotations

from typing import Any


class Platform:
    """A device platform. Registered with ``register_platforms``; one instance per engine.

    Methods are called in the worker process when it builds the model and sizes the KV cache,
    and ``is_available`` in the main process when ``--device auto`` picks a platform.
    """

    #: the torch device type, e.g. "cpu"
    device_type: str = "cpu"

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
        """``"module:Class"`` of the paged attention backend to use on this device."""
        raise NotImplementedError

    def total_memory_bytes(self) -> int:
        """Memory of the device (what ``--gpu-memory-utilization`` is a fraction of)."""
        raise NotImplementedError

    def available_memory_bytes(self) -> int:
        """Memory free right now, for sizing the KV cache."""
        raise NotImplementedError

    def default_kv_cache_bytes(self) -> int | None:
        """A cap on the KV cache when neither --kv-cache-memory-bytes nor
        --num-gpu-blocks-override is given (None: --gpu-memory-utilization alone decides)."""
        return None

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A zero-filled tensor on this device (the KV cache is allocated with it)."""
        import torch

        return torch.zeros(shape, dtype=dtype, device=self.torch_device())

    def configure_threads(self) -> None:
        """Set thread counts that fit the machine (called once in the worker)."""
