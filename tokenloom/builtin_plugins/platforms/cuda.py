"""The CUDA platform (NVIDIA, and AMD through torch's HIP build, which answers to the same
``torch.cuda`` calls): available when torch sees a GPU, bfloat16 by default where the device
multiplies it (float16 elsewhere), the KV cache sized from a memory profile as vLLM's
``--gpu-memory-utilization`` means it, pinned-memory host-to-device copies, and paged attention
by tokenloom's Triton kernels (:mod:`tokenloom.kernels.triton`).

Nothing here has run on a GPU yet: its arithmetic is tested with the device queries faked, and
its kernels under Triton's interpreter on the CPU (see docs/design.md, "GPUs and Triton").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError
from tokenloom.plugin_api import Platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySnapshot:
    """The device's memory as the driver and torch's allocator see it, in bytes."""

    free: int  # free on the device (all processes)
    total: int
    reserved: int  # held by this process's torch caching allocator
    peak_allocated: int  # the most this process's tensors have held at once


def take_snapshot(device: Any) -> MemorySnapshot:
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(
        free=int(free),
        total=int(total),
        reserved=int(torch.cuda.memory_reserved(device)),
        peak_allocated=int(torch.cuda.max_memory_allocated(device)),
    )


def kv_cache_budget(baseline: MemorySnapshot, profiled: MemorySnapshot, utilization: float) -> int:
    """Bytes the KV cache may take, as vLLM's ``--gpu-memory-utilization`` means it: the engine
    as a whole (weights, activations, memory outside torch's allocator, KV cache) may use
    ``utilization`` of the device's *total* memory, whatever other processes hold.

    ``baseline`` is taken before the model loads, ``profiled`` after loading (and after any
    forward pass run to measure activations). What this process used is the peak torch
    allocated plus what the device lost outside torch's allocator since the baseline (CUDA
    context, cuBLAS/Triton workspaces); memory other processes took meanwhile is not ours and
    is not counted (as in vLLM, two engines may share a GPU at 0.5 each)."""
    requested = int(baseline.total * utilization)
    taken_since_baseline = baseline.free - profiled.free
    non_torch = max(0, taken_since_baseline - (profiled.reserved - baseline.reserved))
    return requested - profiled.peak_allocated - non_torch


def check_requested_memory(baseline: MemorySnapshot, utilization: float) -> None:
    """vLLM's start-up check: the device must have ``utilization`` of its memory free, or the
    engine would later run out of memory another process holds."""
    requested = baseline.total * utilization
    if baseline.free < requested:
        raise ConfigError(
            f"--gpu-memory-utilization {utilization}: the device has {baseline.free / 2**30:.2f} GiB free of "
            f"{baseline.total / 2**30:.2f} GiB, less than the {requested / 2**30:.2f} GiB requested; lower "
            "--gpu-memory-utilization or free the device (another process holds memory on it)",
            param="gpu-memory-utilization",
        )


class CudaPlatform(Platform):
    """Runs the model on a CUDA (or ROCm/HIP) GPU, device 0 of those torch sees
    (``CUDA_VISIBLE_DEVICES`` picks which one)."""

    device_type = "cuda"
    distributed_backend = "nccl"
    #: ``--device auto`` prefers a GPU whenever one is present
    auto_priority = 100
    #: the model runner runs a largest-step forward pass before the KV budget is measured
    profiles_activations = True

    def __init__(self) -> None:
        self._baseline: MemorySnapshot | None = None

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch
        except ImportError:
            return False
        try:
            return bool(torch.cuda.is_available())
        except RuntimeError:  # a broken driver install: not available, never a crash at start-up
            return False

    def torch_device(self) -> Any:
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def default_dtype(self, model_dtype: Any) -> Any:
        """``--dtype auto``: float16 models stay float16; everything else (bfloat16 and float32
        checkpoints) runs in bfloat16 where the device supports it (compute capability 8.0+,
        or ROCm), else float16. float32 is never chosen: tensor cores do not multiply it."""
        import torch

        from tokenloom.builtin_plugins.platforms.cpu import _as_torch_dtype

        if _as_torch_dtype(model_dtype) == torch.float16:
            return torch.float16
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def attention_backend(self) -> str:
        return "triton"

    def total_memory_bytes(self) -> int:
        import torch

        return int(torch.cuda.get_device_properties(self.torch_device()).total_memory)

    def available_memory_bytes(self) -> int:
        import torch

        free, _ = torch.cuda.mem_get_info(self.torch_device())
        return int(free)

    def configure_threads(self, num_local_workers: int = 1) -> None:
        """Called once in the worker before the model loads: the baseline of the memory
        profile. The torch thread count stays torch's default (the CPU only feeds the GPU)."""
        import torch

        device = self.torch_device()
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        self._baseline = take_snapshot(device)
        logger.info(
            "CUDA platform: %s, %.1f GiB free of %.1f GiB",
            torch.cuda.get_device_name(device),
            self._baseline.free / 2**30,
            self._baseline.total / 2**30,
        )

    def kv_cache_budget_bytes(self, gpu_memory_utilization: float) -> int:
        """The KV cache's share of ``gpu_memory_utilization`` of the device, after what loading
        (and profiling) the model took: see :func:`kv_cache_budget`."""
        if self._baseline is None:
            raise RuntimeError("configure_threads() takes the memory baseline: call it before loading the model")
        check_requested_memory(self._baseline, gpu_memory_utilization)
        profiled = take_snapshot(self.torch_device())
        budget = kv_cache_budget(self._baseline, profiled, gpu_memory_utilization)
        logger.info(
            "memory profile: %.2f GiB peak in torch tensors, %.2f GiB for the KV cache",
            profiled.peak_allocated / 2**30,
            budget / 2**30,
        )
        return budget

    def host_to_device(self, tensor: Any) -> Any:
        """Through pinned (page-locked) host memory, so the copy is a DMA that does not wait
        for the host and overlaps the kernels already queued on the stream."""
        return tensor.pin_memory().to(self.torch_device(), non_blocking=True)
