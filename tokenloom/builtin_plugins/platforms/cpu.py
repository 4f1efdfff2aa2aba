"""The CPU platform: always available, float32 by default (bfloat16 for bfloat16 models when
oneDNN has fast bf16 kernels here), memory from /proc/meminfo capped by the cgroup limit,
one torch thread per core this process may run on, and paged attention by tokenloom's CPU
kernels (the torch/SDPA backend where they cannot be built)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from tokenloom.plugin_api import Platform

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 4 * 1024**3
# speculative decoding: one more verified row relative to a one-row decode step (see verify_row_cost)
AVX512_VERIFY_ROW_COST = 0.06
FLOAT32_VERIFY_ROW_COST = 0.2
# steps of this many tokens or more give their freed temporaries back to the OS (see finish_step)
TRIM_HEAP_FROM_TOKENS = 256
_CGROUP_V2_LIMIT = "/sys/fs/cgroup/memory.max"
_CGROUP_V2_USAGE = "/sys/fs/cgroup/memory.current"
_CGROUP_V1_LIMIT = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
_CGROUP_V1_USAGE = "/sys/fs/cgroup/memory/memory.usage_in_bytes"


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as bytes per field (``MemTotal``, ``MemAvailable``, ...)."""
    fields = {}
    with open(path) as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) is not a number


def cgroup_memory() -> tuple[int | None, int | None]:
    """``(limit, usage)`` in bytes of this process's memory cgroup; None where unknown or
    unlimited (v1 reports "unlimited" as a huge number, which the caller's min absorbs)."""
    limit = _read_int(_CGROUP_V2_LIMIT)
    if limit is not None:
        return limit, _read_int(_CGROUP_V2_USAGE)
    return _read_int(_CGROUP_V1_LIMIT), _read_int(_CGROUP_V1_USAGE)


def _as_torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp16": torch.float16,
        "float32": torch.float32,
        "float": torch.float32,
        "fp32": torch.float32,
    }
    return names.get(str(dtype).removeprefix("torch."), torch.float32)


class CpuPlatform(Platform):
    """Runs the model on the host CPU."""

    device_type = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def default_dtype(self, model_dtype: Any) -> Any:
        """``--dtype auto``: bfloat16 where the CPU multiplies bfloat16 natively (AVX512-BF16 or
        AMX: about 4x the float32 GEMM rate), as vLLM's CPU backend runs; otherwise bfloat16
        models stay bfloat16 where oneDNN supports it, and everything else (float16 has no fast
        CPU kernels) runs in float32."""
        import torch

        if self.native_bfloat16():
            return torch.bfloat16
        if _as_torch_dtype(model_dtype) == torch.bfloat16 and self.supports_bfloat16():
            return torch.bfloat16
        return torch.float32

    @staticmethod
    def native_bfloat16(cpuinfo: str = "/proc/cpuinfo") -> bool:
        """True when the CPU has bfloat16 dot-product instructions (avx512_bf16 or amx_bf16)."""
        try:
            with open(cpuinfo) as info:
                for line in info:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        return bool(flags & {"avx512_bf16", "amx_bf16"})
        except OSError:
            pass
        return False

    @staticmethod
    def supports_bfloat16() -> bool:
        import torch

        try:
            return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False

    def default_kv_cache_bytes(self) -> int:
        """4 GiB, the default of vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE): enough for 16k
        tokens of a 7B model, 170k of SmolLM2; --kv-cache-memory-bytes sets another size."""
        return DEFAULT_KV_CACHE_BYTES

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """Zeros the OS provides lazily: numpy's calloc maps untouched pages to the zero page, so
        a large KV cache costs neither start-up time (torch.zeros writes every byte: 29 s for
        8 GiB here) nor resident memory until a block is used. Its pages fault in as 2 MiB pages
        (kernels/huge_pages.py:advise): decode attention reads every cached key and value of a
        batch each step, 8-9 % slower on 4 KiB pages (figures: docs/design.md)."""
        import numpy as np
        import torch

        from tokenloom.kernels import huge_pages

        element_size = torch.empty((), dtype=dtype).element_size()
        storage_dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[element_size]
        # all-zero bits are 0.0 in every float format
        tensor = torch.from_numpy(np.zeros(shape, dtype=storage_dtype)).view(dtype)
        huge_pages.advise(tensor)
        return tensor

    def map_blocks(self, kv_caches: list[Any], first_block: int, end_block: int) -> bool:
        """The blocks' K and V pages faulted in with one ``MADV_POPULATE_WRITE`` each
        (kernels/page_mapping.py): on a 2-vCPU VM a 256-token prefill of a 1.7B model spent a
        fifth of its time faulting in its fresh KV pages one by one (115 of 600 ms)."""
        from tokenloom.kernels import page_mapping

        if not page_mapping.available():
            return False
        for cache in kv_caches:
            for half in range(cache.shape[0]):
                page_mapping.populate(cache[half, first_block:end_block])
        return True

    def finish_loading(self, model: Any) -> None:
        """The loading's freed temporaries given back to the OS (``page_mapping.trim_heap``:
        for a 1 GB GGUF file 91 MiB offline, ~15 MiB in the server), and the model's large tensors (weights, packed codes)
        moved onto huge pages in place: a decode step streams them, and on 4 KiB pages TLB
        misses cost a fifth of its time (kernels/huge_pages.py). The move runs in a thread of
        its own, beside start-up and the first steps: the kernel copies the pages (2.2 s for
        0.83 GiB on a 2-vCPU VM), and the model's readers see the same contents throughout."""
        from tokenloom.kernels import huge_pages, page_mapping

        page_mapping.trim_heap()

        tensors = list(huge_pages.module_tensors(model))

        def collapse() -> None:
            started = time.perf_counter()
            collapsed = huge_pages.collapse(tensors)
            if collapsed:
                elapsed = time.perf_counter() - started
                logger.info("%.2f GiB of weights on huge pages in %.2fs", collapsed / 2**30, elapsed)

        threading.Thread(target=collapse, name="tokenloom-huge-pages", daemon=True).start()

    def finish_step(self, num_tokens: int) -> None:
        """After a step of ``TRIM_HEAP_FROM_TOKENS`` tokens or more (a prompt's), the C heap's
        freed memory given back to the OS (``page_mapping.trim_heap``). Such a step's
        temporaries (tens of MiB a layer at 2048 tokens) are freed into glibc's per-thread heaps,
        which keep up to 64 MiB each at their tops and whatever the next step's different sizes
        leave unused: a served 1.7B Q4_K_M file held ~150 MiB of it after a c=32 run. Trimmed,
        the sitting's peak RSS went 5.45 -> 5.29 GiB (c=8 and c=32 throughput within 1 %). A
        decode step's few rows free little, and are not trimmed: the trim itself walks every
        heap."""
        if num_tokens >= TRIM_HEAP_FROM_TOKENS:
            from tokenloom.kernels import page_mapping

            page_mapping.trim_heap()

    def attention_backend(self) -> str:
        """The native-kernel backend when tokenloom's CPU operators load (built once, cached;
        ``TOKENLOOM_CPU_KERNELS=0`` turns them off), else the torch one."""
        from tokenloom.kernels import cpu_native

        return "cpu_native" if cpu_native.load() is not None else "torch"

    def verify_row_cost(self) -> float:
        """One more verified row relative to a one-row decode step, as measured on the native
        kernels (benchmarks/spec_verify_rows.py): about 0.06 at the avx512 level (bfloat16
        activations, the weights read once for every row), about 0.2 on the avx2 and generic
        levels and the torch path (float32 activations: 8 rows take 2.5x one row's time)."""
        from tokenloom.kernels import cpu_native

        if cpu_native.load() is not None and cpu_native.selected_level().name == "avx512":
            return AVX512_VERIFY_ROW_COST
        return FLOAT32_VERIFY_ROW_COST

    def total_memory_bytes(self) -> int:
        total = read_meminfo()["MemTotal"]
        limit, _ = cgroup_memory()
        return min(total, limit) if limit else total

    def available_memory_bytes(self) -> int:
        meminfo = read_meminfo()
        available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
        limit, usage = cgroup_memory()
        if limit and usage is not None:
            available = min(available, max(limit - usage, 0))
        return available

    def configure_threads(self, num_local_workers: int = 1) -> None:
        """Workers on one machine split its cores: more threads than cores makes OpenMP's
        busy-waiting workers steal each other's time slices."""
        import torch

        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        num_threads = max(1, num_cores // max(1, num_local_workers))
        torch.set_num_threads(num_threads)
        if num_local_workers > 1:
            logger.info(
                "CPU platform: %d torch threads (%d cores shared by %d workers)",
                num_threads,
                num_cores,
                num_local_workers,
            )
        else:
            logger.info("CPU platform: %d torch threads", num_threads)
