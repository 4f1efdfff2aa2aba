"""The attention-backend choice: ``--attention-backend`` over TOKENLOOM_ATTENTION_BACKEND over
VLLM_ATTENTION_BACKEND over the platform's own choice; vLLM's spellings; unknown names refused
with the list of known ones, at configuration time."""

from __future__ import annotations

import pytest

from tokenloom.core.config import EngineArgs
from tokenloom.core.platform import ATTENTION_BACKENDS, Platform, attention_backend_target, check_attention_backend
from tokenloom.errors import ConfigError


class GpuLike(Platform):
    def attention_backend(self) -> str:
        return "somewhere:PlatformBackend"


@pytest.fixture(autouse=True)
def no_backend_environment(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)


def test_auto_is_the_platforms_choice():
    assert attention_backend_target("auto", GpuLike()) == "somewhere:PlatformBackend"
    assert attention_backend_target(None, GpuLike()) == "somewhere:PlatformBackend"
    check_attention_backend("auto")  # only checking the name


@pytest.mark.parametrize(
    "name, backend",
    [
        ("torch", "torch"),
        ("TORCH_SDPA", "torch"),
        ("triton", "triton"),
        ("TRITON_ATTN", "triton"),
        ("triton_attn_vllm_v1", "triton"),
        ("cpu_native", "cpu_native"),
        ("reference", "reference"),
    ],
)
def test_names_and_vllm_spellings(name, backend):
    assert attention_backend_target(name, GpuLike()) == ATTENTION_BACKENDS[backend]


def test_flag_over_tokenloom_env_over_vllm_env(monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    assert attention_backend_target("auto", GpuLike()) == ATTENTION_BACKENDS["torch"]
    monkeypatch.setenv("TOKENLOOM_ATTENTION_BACKEND", "triton")
    assert attention_backend_target("auto", GpuLike()) == ATTENTION_BACKENDS["triton"]
    assert attention_backend_target("reference", GpuLike()) == ATTENTION_BACKENDS["reference"]


def test_unknown_names_list_the_known_ones_and_say_where_they_came_from(monkeypatch):
    with pytest.raises(ConfigError, match=r"--attention-backend: no attention backend 'FLASH_ATTN'.*triton") as caught:
        attention_backend_target("FLASH_ATTN", GpuLike())
    assert caught.value.param == "attention-backend"
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    with pytest.raises(ConfigError, match="VLLM_ATTENTION_BACKEND: no attention backend 'FLASHINFER'"):
        attention_backend_target("auto", GpuLike())


def test_engine_config_checks_the_name_before_any_model_loads(monkeypatch):
    assert EngineArgs(attention_backend="triton").create_engine_config().device.attention_backend == "triton"
    with pytest.raises(ConfigError, match="no attention backend 'flash'"):
        EngineArgs(attention_backend="flash").create_engine_config()
    monkeypatch.setenv("TOKENLOOM_ATTENTION_BACKEND", "nope")
    with pytest.raises(ConfigError, match="TOKENLOOM_ATTENTION_BACKEND"):
        EngineArgs().create_engine_config()


def test_base_platform_budget_and_host_copy():
    class Fixed(GpuLike):
        def available_memory_bytes(self):
            return 1000

    import torch

    assert Fixed().kv_cache_budget_bytes(0.5) == 500
    tensor = torch.arange(3)
    assert Fixed().host_to_device(tensor) is tensor  # the CPU copy is no copy
