"""The attention-backend choice from the ``attention_backend`` registry: ``--attention-backend``
over TOKENLOOM_ATTENTION_BACKEND over VLLM_ATTENTION_BACKEND over the platform's own choice;
vLLM's spellings as registered aliases; unknown names refused with the list of known ones when
the engine starts, before any model loads."""

from __future__ import annotations

import pytest

from tokenloom.core.platform import Platform, attention_backend_target, check_attention_backend
from tokenloom.errors import ConfigError
from tokenloom.plugins.manager import load_plugins
from tokenloom.plugins.registry import Registry

BACKENDS = load_plugins().registry("attention_backend")


def target_of(name: str) -> str:
    return BACKENDS.entry(name).target_path


class GpuLike(Platform):
    def attention_backend(self) -> str:
        return "triton"


@pytest.fixture(autouse=True)
def no_backend_environment(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)


def test_the_built_in_backends_are_registered_by_the_platform_plugins():
    assert set(BACKENDS.names()) >= {"torch", "cpu_native", "reference", "triton"}
    assert BACKENDS.entry("torch").plugin_name == "builtin_platforms"
    assert BACKENDS.entry("triton").plugin_name == "builtin_platforms"


def test_auto_is_the_platforms_choice():
    assert attention_backend_target("auto", GpuLike(), BACKENDS) == target_of("triton")
    assert attention_backend_target(None, GpuLike(), BACKENDS) == target_of("triton")
    check_attention_backend("auto", BACKENDS)  # only checking the name


def test_a_platform_naming_an_unregistered_backend_is_an_error_naming_the_platform():
    class Broken(Platform):
        def attention_backend(self) -> str:
            return "flash"

    with pytest.raises(ConfigError, match="the Broken's attention backend: no attention backend 'flash'"):
        attention_backend_target("auto", Broken(), BACKENDS)


@pytest.mark.parametrize(
    "name, backend",
    [
        ("torch", "torch"),
        ("TORCH_SDPA", "torch"),
        ("triton", "triton"),
        ("TRITON_ATTN", "triton"),
        ("triton_attn_vllm_v1", "triton"),
        ("cpu_native", "cpu_native"),
        ("CPU_ATTN", "cpu_native"),
        ("reference", "reference"),
    ],
)
def test_names_and_vllm_spellings(name, backend):
    assert attention_backend_target(name, GpuLike(), BACKENDS) == target_of(backend)


def test_flag_over_tokenloom_env_over_vllm_env(monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    assert attention_backend_target("auto", GpuLike(), BACKENDS) == target_of("torch")
    monkeypatch.setenv("TOKENLOOM_ATTENTION_BACKEND", "triton")
    assert attention_backend_target("auto", GpuLike(), BACKENDS) == target_of("triton")
    assert attention_backend_target("reference", GpuLike(), BACKENDS) == target_of("reference")


def test_unknown_names_list_the_known_ones_and_say_where_they_came_from(monkeypatch):
    with pytest.raises(ConfigError, match=r"--attention-backend: no attention backend 'FLASH_ATTN'.*triton") as caught:
        attention_backend_target("FLASH_ATTN", GpuLike(), BACKENDS)
    assert caught.value.param == "attention-backend"
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    with pytest.raises(ConfigError, match="VLLM_ATTENTION_BACKEND: no attention backend 'FLASHINFER'"):
        attention_backend_target("auto", GpuLike(), BACKENDS)


def test_a_plugin_backend_is_chosen_by_its_name_or_alias():
    backends = Registry("attention_backend", "--attention-backend")
    backends.register("flash", "my_plugin.attention:Flash", plugin_name="my-plugin", aliases=("FLASH_ATTN",))
    assert attention_backend_target("flash_attn", GpuLike(), backends) == "my_plugin.attention:Flash"
    with pytest.raises(ConfigError, match="choose one of auto, flash"):
        check_attention_backend("torch", backends)


def test_the_engine_checks_the_name_before_any_model_loads(monkeypatch):
    from tokenloom.core.config import EngineArgs
    from tokenloom.core.engine.llm_engine import LLMEngine

    def engine_with(**kwargs):
        return LLMEngine(EngineArgs(model="/no/such/model", **kwargs).create_engine_config(), load_plugins())

    with pytest.raises(ConfigError, match="no attention backend 'flash'"):
        engine_with(attention_backend="flash")
    monkeypatch.setenv("TOKENLOOM_ATTENTION_BACKEND", "nope")
    with pytest.raises(ConfigError, match="TOKENLOOM_ATTENTION_BACKEND"):
        engine_with()


def test_base_platform_budget_and_host_copy():
    class Fixed(GpuLike):
        def available_memory_bytes(self):
            return 1000

    import torch

    assert Fixed().kv_cache_budget_bytes(0.5) == 500
    tensor = torch.arange(3)
    assert Fixed().host_to_device(tensor) is tensor  # the CPU copy is no copy
