"""The CPU platform: availability, dtype choice, memory from /proc/meminfo and cgroups,
thread count, its attention backend and its registration."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tokenloom.builtin_plugins import platforms
from tokenloom.builtin_plugins.platforms import cpu
from tokenloom.builtin_plugins.platforms.cpu import CpuPlatform, read_meminfo

MEMINFO = (
    "MemTotal:       16000000 kB\nMemFree:         2000000 kB\nMemAvailable:    8000000 kB\nHugePages_Total:       0\n"
)


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    monkeypatch.setattr(cpu, "read_meminfo", lambda path=str(meminfo): read_meminfo(path))
    for name in ("_CGROUP_V2_LIMIT", "_CGROUP_V2_USAGE", "_CGROUP_V1_LIMIT", "_CGROUP_V1_USAGE"):
        monkeypatch.setattr(cpu, name, str(tmp_path / name))
    return tmp_path


def test_read_meminfo_converts_kilobytes(fake_host):
    fields = cpu.read_meminfo()
    assert fields["MemTotal"] == 16000000 * 1024
    assert fields["HugePages_Total"] == 0


def test_memory_without_cgroup_limit(fake_host):
    (fake_host / "_CGROUP_V2_LIMIT").write_text("max\n")
    platform = CpuPlatform()
    assert platform.total_memory_bytes() == 16000000 * 1024
    assert platform.available_memory_bytes() == 8000000 * 1024


def test_cgroup_limit_caps_memory(fake_host):
    (fake_host / "_CGROUP_V2_LIMIT").write_text(str(4 * 2**30))
    (fake_host / "_CGROUP_V2_USAGE").write_text(str(3 * 2**30))
    platform = CpuPlatform()
    assert platform.total_memory_bytes() == 4 * 2**30
    assert platform.available_memory_bytes() == 2**30


def test_cgroup_v1_limit(fake_host):
    (fake_host / "_CGROUP_V1_LIMIT").write_text(str(6 * 2**30))
    (fake_host / "_CGROUP_V1_USAGE").write_text(str(2**30))
    assert CpuPlatform().available_memory_bytes() == 5 * 2**30


def test_real_host_memory_is_plausible():
    platform = CpuPlatform()
    assert 0 < platform.available_memory_bytes() <= platform.total_memory_bytes()


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16, "float16", "torch.float32"])
def test_without_native_bfloat16_other_models_run_in_float32(model_dtype, monkeypatch):
    monkeypatch.setattr(CpuPlatform, "native_bfloat16", staticmethod(lambda: False))
    assert CpuPlatform().default_dtype(model_dtype) == torch.float32


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_bfloat16_cpus_run_every_model_in_bfloat16(model_dtype, monkeypatch):
    monkeypatch.setattr(CpuPlatform, "native_bfloat16", staticmethod(lambda: True))
    assert CpuPlatform().default_dtype(model_dtype) == torch.bfloat16


def test_bfloat16_models_follow_onednn_support(monkeypatch):
    platform = CpuPlatform()
    monkeypatch.setattr(CpuPlatform, "native_bfloat16", staticmethod(lambda: False))
    monkeypatch.setattr(CpuPlatform, "supports_bfloat16", staticmethod(lambda: True))
    assert platform.default_dtype(torch.bfloat16) == torch.bfloat16
    assert platform.default_dtype("bfloat16") == torch.bfloat16
    monkeypatch.setattr(CpuPlatform, "supports_bfloat16", staticmethod(lambda: False))
    assert platform.default_dtype(torch.bfloat16) == torch.float32


@pytest.mark.parametrize(
    "flags, expected", [("fpu avx512f avx512_bf16 sse", True), ("fpu amx_bf16", True), ("fpu avx512f avx512bw", False)]
)
def test_native_bfloat16_reads_the_cpu_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert CpuPlatform.native_bfloat16(str(cpuinfo)) is expected


def test_configure_threads_uses_the_affinity_mask():
    previous = torch.get_num_threads()
    try:
        CpuPlatform().configure_threads()
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.hook("register_attention_backends")
def test_the_cpu_platforms_attention_backends_are_registered_and_build():
    registered = {}
    platforms.register_attention_backends(
        lambda name, target, **options: registered.setdefault(name, (target, options))
    )
    assert set(registered) == {"torch", "cpu_native", "reference", "triton"}
    assert registered["torch"][1] == {"aliases": ("torch_sdpa",)}
    assert CpuPlatform().attention_backend() in registered  # the platform names a registered one
    for name, (target, _) in registered.items():
        if name == "triton":
            continue  # its module needs triton, the gpu extra (tests/kernels/triton test it)
        module_name, _, class_name = target.partition(":")
        backend = getattr(importlib.import_module(module_name), class_name)()
        assert callable(backend.forward)


def test_platform_basics_and_registration():
    assert CpuPlatform.is_available()
    assert CpuPlatform().torch_device() == torch.device("cpu")
    registered = {}
    platforms.register_platforms(lambda name, target: registered.setdefault(name, target))
    assert registered["cpu"] == "tokenloom.builtin_plugins.platforms.cpu:CpuPlatform"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_are_zero_and_writable(dtype):
    cache = CpuPlatform().zeros((2, 8, 4, 2, 16), dtype)
    assert cache.dtype == dtype and cache.shape == (2, 8, 4, 2, 16) and cache.is_contiguous()
    assert not cache.any()
    cache[1, 3] = 1.5
    assert cache.sum().item() == 1.5 * 4 * 2 * 16


def test_default_kv_cache_is_capped_like_vllm_cpu():
    assert CpuPlatform().default_kv_cache_bytes() == 4 * 1024**3


@pytest.mark.parametrize("num_local_workers", [2, 3, 64])
def test_workers_on_one_machine_share_its_cores(num_local_workers):
    previous = torch.get_num_threads()
    try:
        CpuPlatform().configure_threads(num_local_workers=num_local_workers)
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // num_local_workers)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("kernels_load", "level", "row_cost"),
    [
        (True, "avx512", cpu.AVX512_VERIFY_ROW_COST),
        (True, "avx2", cpu.FLOAT32_VERIFY_ROW_COST),
        (True, "generic", cpu.FLOAT32_VERIFY_ROW_COST),
        (False, "avx512", cpu.FLOAT32_VERIFY_ROW_COST),  # no native kernels: the torch path
    ],
)
def test_verify_row_cost_follows_the_kernel_level(kernels_load, level, row_cost, monkeypatch):
    from tokenloom.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "load", lambda: object() if kernels_load else None)
    monkeypatch.setattr(cpu_native, "selected_level", lambda: cpu_native.LEVELS_BY_NAME[level])
    assert CpuPlatform().verify_row_cost() == row_cost


def test_a_prompts_step_trims_the_c_heap_and_a_decode_step_does_not(monkeypatch):
    """finish_step gives the C heap's free memory back after a step of TRIM_HEAP_FROM_TOKENS
    tokens or more, and leaves a smaller one's alone."""
    from tokenloom.kernels import page_mapping

    trims = []
    monkeypatch.setattr(page_mapping, "trim_heap", lambda: trims.append(True) or True)
    platform = CpuPlatform()
    platform.finish_step(cpu.TRIM_HEAP_FROM_TOKENS - 1)
    platform.finish_step(1)
    assert trims == []
    platform.finish_step(cpu.TRIM_HEAP_FROM_TOKENS)
    platform.finish_step(2048)
    assert trims == [True, True]
