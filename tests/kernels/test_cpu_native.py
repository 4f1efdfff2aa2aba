"""The CPU kernels' levels and dispatch: which levels a CPU runs, the TOKENLOOM_CPU_ISA override,
several levels loaded side by side, the start-up line, TOKENLOOM_CPU_KERNELS=require, the
per-operator report of ``tokenloom env``, and how ``make install`` builds the levels (at once,
each one translation unit)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch

from tokenloom.api.cli import main as cli_main
from tokenloom.errors import ConfigError
from tokenloom.kernels import cpu_native

V3 = "avx avx2 fma f16c bmi1 bmi2 movbe abm"
V4 = V3 + " avx512f avx512bw avx512vl avx512dq avx512cd"


def levels_of(monkeypatch, flags: str, machine: str = "x86_64") -> list[str]:
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: machine)
    return [level.name for level in cpu_native.host_levels()]


@pytest.fixture
def fresh_state(monkeypatch):
    """A process that has loaded no level yet (the real libraries stay loaded in torch)."""
    for name in ("_loaded", "_failures", "_selection"):
        monkeypatch.setattr(cpu_native, name, {})
    monkeypatch.delenv(cpu_native.ENV_LEVEL, raising=False)
    monkeypatch.delenv(cpu_native.ENV_SWITCH, raising=False)


def test_each_cpu_runs_the_levels_its_flags_allow(monkeypatch):
    assert levels_of(monkeypatch, V4 + " avx512_vnni avx512_bf16") == ["avx512", "avx2", "generic"]
    assert levels_of(monkeypatch, V4 + " avx512_vnni") == ["avx512", "avx2", "generic"]
    # AVX-512 without VNNI (Skylake-X): the integer kernels are built on VNNI, so avx2
    assert levels_of(monkeypatch, V4) == ["avx2", "generic"]
    assert levels_of(monkeypatch, V3) == ["avx2", "generic"]  # the AMD EPYC of issue 17
    assert levels_of(monkeypatch, "avx avx2 sse4_2") == ["generic"]  # no FMA/F16C: not x86-64-v3
    assert levels_of(monkeypatch, "fp asimd asimddp", machine="aarch64") == ["generic"]
    assert levels_of(monkeypatch, V4 + " avx512_vnni", machine="aarch64") == ["generic"]


def test_bf16_is_a_compiler_flag_inside_the_avx512_level(monkeypatch):
    avx512 = cpu_native.LEVELS_BY_NAME["avx512"]
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset((V4 + " avx512_vnni avx512_bf16").split()))
    assert "-mavx512bf16" in cpu_native.compiler_flags(avx512)
    assert "-DTOKENLOOM_CPU_NAMESPACE=tokenloom_cpu_avx512" in cpu_native.compiler_flags(avx512)
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset((V4 + " avx512_vnni").split()))
    assert "-mavx512bf16" not in cpu_native.compiler_flags(avx512)
    assert "-march=x86-64-v3" in cpu_native.compiler_flags(cpu_native.LEVELS_BY_NAME["avx2"])


def test_avx_vnni_is_a_compiler_flag_inside_the_avx2_level(monkeypatch):
    """An AVX2 CPU with AVX-VNNI (Intel's since Alder Lake) builds the avx2 level's
    integer dot products on ``vpdpbusd``; one without it keeps ``vpmaddubsw``: the same integers."""
    avx2 = cpu_native.LEVELS_BY_NAME["avx2"]
    assert levels_of(monkeypatch, V3 + " avx_vnni") == ["avx2", "generic"]  # not a level of its own
    assert "-mavxvnni" in cpu_native.compiler_flags(avx2)
    assert levels_of(monkeypatch, V3) == ["avx2", "generic"]
    assert "-mavxvnni" not in cpu_native.compiler_flags(avx2)


def test_the_best_level_is_selected_unless_a_lower_one_is_forced(monkeypatch, fresh_state):
    levels_of(monkeypatch, V3)
    assert cpu_native.selected_level().name == "avx2"
    monkeypatch.setenv(cpu_native.ENV_LEVEL, "generic")
    assert cpu_native.selected_level().name == "generic"
    monkeypatch.setenv(cpu_native.ENV_LEVEL, "auto")
    assert cpu_native.selected_level().name == "avx2"


def test_a_level_the_cpu_cannot_run_is_an_error_that_names_the_ones_it_can(monkeypatch, fresh_state):
    levels_of(monkeypatch, V3)
    monkeypatch.setenv(cpu_native.ENV_LEVEL, "avx512")
    with pytest.raises(ConfigError, match="cannot run the avx512 kernels.*it runs avx2, generic"):
        cpu_native.selected_level()
    with pytest.raises(ConfigError, match="cannot run the avx512"):
        cpu_native.load()
    monkeypatch.setenv(cpu_native.ENV_LEVEL, "avx9000")
    with pytest.raises(ConfigError, match="'avx9000' is not a kernel level: use one of avx2, generic"):
        cpu_native.selected_level()


def test_every_level_the_host_runs_loads_side_by_side_in_its_own_namespace():
    namespaces = {}
    for level in cpu_native.host_levels():
        ops = cpu_native.load_level(level)
        assert ops is not None, cpu_native.failure(level)
        namespaces[level.name] = ops
        assert ops is getattr(torch.ops, f"tokenloom_cpu_{level.name}")
        for name in cpu_native.OPERATORS:  # every level has every operator
            assert hasattr(ops, name), (level.name, name)
    x, weight = torch.randn(3, 40), torch.randn(40)
    results = [ops.rms_norm(x, None, weight, 1e-6, False)[0] for ops in namespaces.values()]
    for result in results[1:]:
        torch.testing.assert_close(result, results[0])


def test_using_level_switches_the_operators_and_restores_them():
    before = cpu_native.load()
    for level in cpu_native.host_levels():
        with cpu_native.using_level(level.name) as ops:
            assert ops is cpu_native.load() is cpu_native.ops_for(torch.zeros(1))
            assert ops is getattr(torch.ops, level.namespace)
    assert cpu_native.load() is before


def test_the_level_in_use_is_said_once_at_start(fresh_state, caplog):
    with caplog.at_level(logging.INFO, logger=cpu_native.__name__):
        ops = cpu_native.load()
        cpu_native.load()
    level = cpu_native.host_levels()[0]
    lines = [record.getMessage() for record in caplog.records]
    assert ops is not None
    assert lines == [f"tokenloom CPU kernels: {level.name} level ({level.description}), torch.ops.{level.namespace}"]


def failing_build(monkeypatch):
    def fail(level):
        raise RuntimeError("Error building extension 'tokenloom_cpu_ops'\nc++: not found")

    monkeypatch.setattr(cpu_native, "_load_or_build", fail)


def test_missing_kernels_are_a_warning_with_the_reason_and_the_torch_paths_run(monkeypatch, fresh_state, caplog):
    failing_build(monkeypatch)
    with caplog.at_level(logging.INFO, logger=cpu_native.__name__):
        assert cpu_native.load() is None
        assert cpu_native.ops_for(torch.zeros(1)) is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "unavailable" in record.getMessage() and "c++: not found" in record.getMessage()
    assert "torch paths run" in record.getMessage()


def test_require_makes_missing_kernels_fatal(monkeypatch, fresh_state):
    failing_build(monkeypatch)
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "require")
    with pytest.raises(RuntimeError, match="unavailable: RuntimeError: c\\+\\+: not found.*=require makes this fatal"):
        cpu_native.load()


def test_kernels_switched_off_load_nothing(monkeypatch, fresh_state):
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    assert cpu_native.mode() == "off" and cpu_native.load() is None
    info = cpu_native.status()
    assert info["level"] is None and "switched off" in info["problem"]
    assert all(path.startswith("torch: ") for path in info["operators"].values())


def test_tokenloom_env_reports_each_operators_path(capsys, monkeypatch, fresh_state):
    monkeypatch.setenv(cpu_native.ENV_LEVEL, "avx2")
    assert cli_main(["env"]) == 0
    text = capsys.readouterr().out
    assert "tokenloom CPU kernels: avx2 level (forced by TOKENLOOM_CPU_ISA), x86-64-v3" in text
    assert "  int4_linear: avx2\n" in text and "  decode_layer: avx2\n" in text
    assert cli_main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["level"] == "avx2" and info["forced"] and info["namespace"] == "tokenloom_cpu_avx2"
    assert set(info["operators"].values()) == {"avx2"} and "avx2" in info["levels"]
    assert info["amx_int8"].startswith("not used (")  # the avx2 build has no AMX path
    assert info["amx_bf16"] == "not used (not in the avx2 build)"


def test_tokenloom_env_says_whether_w8a8_and_int4_take_amx(capsys, monkeypatch, fresh_state):
    from tokenloom.kernels import w8a8_matmul

    ops = cpu_native.load()
    if ops is None:
        pytest.skip("tokenloom's CPU kernels are switched off or did not build")
    assert cli_main(["env"]) == 0
    text = capsys.readouterr().out
    if not w8a8_matmul.amx_available():
        assert "AMX-INT8: not used (" in text
        return
    int4_rows = ops.quantized_amx_min_rows(4)
    assert int4_rows > 0
    assert (
        f"AMX-INT8: w8a8_linear from {w8a8_matmul.AMX_MIN_ROWS} rows, "
        f"int4_linear (and the 4-bit MoE experts) from {int4_rows} rows\n"
    ) in text
    monkeypatch.setenv(w8a8_matmul.ENV_AMX, "0")
    assert cpu_native.status()["amx_int8"] == "off (TOKENLOOM_CPU_AMX=0)"


def test_tokenloom_env_says_whether_the_bf16_prompt_kernels_run(capsys, monkeypatch, fresh_state):
    ops = cpu_native.load()
    if ops is None:
        pytest.skip("tokenloom's CPU kernels are switched off or did not build")
    monkeypatch.delenv("TOKENLOOM_CPU_AMX", raising=False)
    assert cli_main(["env"]) == 0
    text = capsys.readouterr().out
    if not ops.bf16_amx_available():
        assert "AMX-BF16: not used (" in text
        return
    assert "AMX-BF16: int4_linear_bf16, int5_linear_bf16 and int6_linear_bf16 available (prompt rows)\n" in text
    monkeypatch.setenv("TOKENLOOM_CPU_AMX", "0")
    assert cpu_native.status()["amx_bf16"] == "off (TOKENLOOM_CPU_AMX=0)"


def test_tokenloom_env_shows_the_torch_paths_when_the_kernels_are_missing(capsys, monkeypatch, fresh_state):
    failing_build(monkeypatch)
    assert cli_main(["env"]) == 0
    text = capsys.readouterr().out
    assert "tokenloom CPU kernels: unavailable, the" in text and "c++: not found" in text
    assert "  int4_linear: torch: torch's weight-only int4 matmul" in text


def test_make_install_builds_every_level_at_once(monkeypatch, fresh_state, capsys):
    """`python -m tokenloom.kernels.cpu_native` compiles the levels side by side: each build
    here waits until every level's has begun (one at a time, the first would wait for ever)."""
    levels = cpu_native.host_levels()
    all_started = threading.Barrier(len(levels), timeout=30)

    def build(level):
        all_started.wait()
        return f"ops of {level.name}"

    monkeypatch.setattr(cpu_native, "_load_or_build", build)
    assert cpu_native.main([]) == 0
    assert [cpu_native._loaded[level.name] for level in levels] == [f"ops of {level.name}" for level in levels]
    assert capsys.readouterr().out.count(": ready in ") == len(levels)


def test_a_level_compiles_as_one_translation_unit_of_every_source(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    compiled = {}
    monkeypatch.setattr(cpp_extension, "load", lambda **options: compiled.update(options))
    level = cpu_native.LEVELS_BY_NAME["generic"]
    cpu_native._build(level, tmp_path / "build")
    [unit] = compiled["sources"]
    assert open(unit).read().splitlines() == [f'#include "{source}"' for source in cpu_native.SOURCES]
    assert compiled["name"] == level.library_name and compiled["build_directory"] == str(tmp_path / "build")
