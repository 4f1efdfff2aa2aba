"""The CUDA platform with the device faked (there is no GPU here): its availability, ``--device
auto`` preferring it, the dtype it picks, the memory arithmetic of ``--gpu-memory-utilization``,
its attention backend and its registration."""

from __future__ import annotations

import pytest
import torch

from tokenloom.builtin_plugins import platforms
from tokenloom.builtin_plugins.platforms import cuda
from tokenloom.builtin_plugins.platforms.cuda import (
    CudaPlatform,
    MemorySnapshot,
    check_requested_memory,
    kv_cache_budget,
)
from tokenloom.core.engine.engine_setup import choose_platform
from tokenloom.errors import ConfigError
from tokenloom.plugins.manager import load_plugins

GiB = 2**30


class FakeDevice:
    """``torch.cuda``'s memory queries over a device whose state the test sets."""

    def __init__(self, total=80 * GiB, free=79 * GiB):
        self.total, self.free = total, free
        self.reserved = 0
        self.peak_allocated = 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)

        class Properties:
            total_memory = self.total

        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties)
        return self

    def load_weights(self, allocated, reserved, outside_torch=0):
        """The model loads: torch allocates ``allocated`` bytes within ``reserved``, and the
        CUDA context, cuBLAS workspaces etc. take ``outside_torch`` more."""
        self.peak_allocated += allocated
        self.free -= (reserved - self.reserved) + outside_torch
        self.reserved = reserved


@pytest.fixture
def device(monkeypatch):
    return FakeDevice().install(monkeypatch)


def test_unavailable_without_a_gpu_and_when_the_driver_is_broken(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CudaPlatform.is_available() is False

    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert CudaPlatform.is_available() is False


def test_available_with_a_gpu(device):
    assert CudaPlatform.is_available() is True
    assert CudaPlatform().torch_device() == torch.device("cuda", 0)


def test_device_auto_prefers_the_gpu_and_falls_back_to_the_cpu(monkeypatch):
    # the CPU platform is registered first, yet a GPU wins when one is there
    plugins = load_plugins(["tokenloom.builtin_plugins.platforms"], entry_points=False)
    assert plugins.registry("platform").names()[:2] == ["cpu", "cuda"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_platform("auto", plugins) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_platform("auto", plugins) == "cpu"
    assert choose_platform("cuda", plugins) == "cuda"  # named explicitly: no availability check here


@pytest.mark.parametrize(
    "model_dtype, bf16_supported, expected",
    [
        (torch.bfloat16, True, torch.bfloat16),
        (torch.float32, True, torch.bfloat16),
        ("float32", True, torch.bfloat16),
        (torch.float16, True, torch.float16),
        ("float16", True, torch.float16),
        (torch.bfloat16, False, torch.float16),  # pre-Ampere NVIDIA: no bfloat16
        (torch.float32, False, torch.float16),
    ],
)
def test_default_dtype_is_bfloat16_where_supported_else_float16(monkeypatch, model_dtype, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    assert CudaPlatform().default_dtype(model_dtype) == expected


def test_budget_is_the_utilization_of_total_memory_minus_what_the_engine_took():
    baseline = MemorySnapshot(free=70 * GiB, total=80 * GiB, reserved=0, peak_allocated=0)
    # 16 GiB of weights and activations at peak, 17 GiB reserved by torch, 1 GiB outside torch
    profiled = MemorySnapshot(free=52 * GiB, total=80 * GiB, reserved=17 * GiB, peak_allocated=16 * GiB)
    assert kv_cache_budget(baseline, profiled, 0.9) == int(80 * GiB * 0.9) - 16 * GiB - 1 * GiB
    assert kv_cache_budget(baseline, profiled, 0.5) == 40 * GiB - 17 * GiB


def test_memory_another_process_takes_meanwhile_is_not_counted_against_us():
    baseline = MemorySnapshot(free=70 * GiB, total=80 * GiB, reserved=0, peak_allocated=0)
    # we reserved 10 GiB and the device lost 10 GiB more to someone else: both are "taken"
    # since the baseline, but the peak torch allocation is what this engine used
    profiled = MemorySnapshot(free=50 * GiB, total=80 * GiB, reserved=10 * GiB, peak_allocated=9 * GiB)
    budget = kv_cache_budget(baseline, profiled, 0.9)
    assert budget == int(72 * GiB) - 9 * GiB - 10 * GiB  # the other 10 GiB look like non-torch use
    # freed memory (free grew) never makes the non-torch term negative
    profiled = MemorySnapshot(free=75 * GiB, total=80 * GiB, reserved=2 * GiB, peak_allocated=2 * GiB)
    assert kv_cache_budget(baseline, profiled, 0.9) == int(72 * GiB) - 2 * GiB


def test_too_little_free_memory_for_the_requested_utilization_is_a_config_error():
    baseline = MemorySnapshot(free=30 * GiB, total=80 * GiB, reserved=0, peak_allocated=0)
    check_requested_memory(baseline, 0.3)
    with pytest.raises(ConfigError, match="lower --gpu-memory-utilization") as caught:
        check_requested_memory(baseline, 0.9)
    assert caught.value.param == "gpu-memory-utilization"


def test_platform_profiles_from_the_baseline_it_took_before_loading(device):
    platform = CudaPlatform()
    with pytest.raises(RuntimeError, match="configure_threads"):
        platform.kv_cache_budget_bytes(0.9)
    platform.configure_threads()
    device.load_weights(allocated=6 * GiB, reserved=7 * GiB, outside_torch=GiB // 2)
    expected = int(80 * GiB * 0.9) - 6 * GiB - GiB // 2
    assert platform.kv_cache_budget_bytes(0.9) == expected
    assert platform.total_memory_bytes() == 80 * GiB
    assert platform.available_memory_bytes() == device.free


def test_platform_refuses_a_utilization_the_free_memory_cannot_meet(monkeypatch):
    device = FakeDevice(total=24 * GiB, free=12 * GiB).install(monkeypatch)
    platform = CudaPlatform()
    platform.configure_threads()
    device.load_weights(allocated=GiB, reserved=GiB)
    with pytest.raises(ConfigError, match="12.00 GiB free of 24.00 GiB"):
        platform.kv_cache_budget_bytes(0.9)
    assert platform.kv_cache_budget_bytes(0.45) == int(24 * GiB * 0.45) - GiB


def test_host_to_device_goes_through_pinned_memory(monkeypatch):
    calls = []

    class HostTensor:
        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, device, non_blocking=False):
            calls.append(("to", device, non_blocking))
            return "on device"

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert CudaPlatform().host_to_device(HostTensor()) == "on device"
    assert calls == ["pin", ("to", torch.device("cuda", 0), True)]


def test_attention_backend_is_triton_and_registration():
    assert CudaPlatform().attention_backend() == "triton"
    backends = {}
    platforms.register_attention_backends(lambda name, target, **options: backends.setdefault(name, target))
    assert backends["triton"] == "tokenloom.kernels.triton.attention:TritonPagedAttention"
    assert CudaPlatform().default_kv_cache_bytes() is None  # the profile alone sizes the cache
    registered = {}
    platforms.register_platforms(lambda name, target: registered.setdefault(name, target))
    assert registered["cuda"] == "tokenloom.builtin_plugins.platforms.cuda:CudaPlatform"
    assert cuda.CudaPlatform.auto_priority > 0
    assert cuda.CudaPlatform.profiles_activations  # the runner's largest-step pass precedes the budget
