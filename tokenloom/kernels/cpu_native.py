"""tokenloom's own CPU operators (``csrc/*.cpp``): one library per ISA level, chosen at run time.

The same sources are compiled once per level the host can run (:data:`LEVELS`: ``avx512``,
``avx2``, ``generic``), each into its own torch op namespace (``torch.ops.tokenloom_cpu_avx512``,
...; see csrc/cpu_namespace.h), so several levels load in one process: the tests run every
level the host can. A process uses the best level the CPU has (``/proc/cpuinfo`` flags), or the
one ``TOKENLOOM_CPU_ISA`` names (a lower level, for tests and benchmarks; one the CPU cannot run
is an error). Builds are cached per source, torch, Python, CPU and level in
``$TOKENLOOM_CACHE_DIR`` (default ``~/.cache/tokenloom``)/``kernels`` and load in milliseconds on
later starts; ``make install`` (``python -m tokenloom.kernels.cpu_native``) builds every level the
host can run, side by side, so a first start does not pay the compile. A level is one
translation unit that includes every source: torch's headers, most of a source's compile time,
are parsed once per level instead of once per source. So no two sources may define the same
helper (a compile error at the levels whose branch defines it): one that several sources use
lives in csrc/cpu_common.h, and a new source only needs its entry in :data:`SOURCES`.

:func:`load` returns the operator namespace of the selected level, or None when the operators
cannot be had (no C++ compiler, a build error, or ``TOKENLOOM_CPU_KERNELS=0``); callers then keep
their torch path, and the reason is logged once as a warning. ``TOKENLOOM_CPU_KERNELS=require``
(what ``make test`` sets) makes that fatal instead. :func:`report` says which path each operator
takes (``tokenloom env``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloom.errors import ConfigError

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "cpu_attention.cpp",
        "cpu_layers.cpp",
        "cpu_qlinear.cpp",
        "cpu_kquant.cpp",
        "cpu_lowbit.cpp",
        "cpu_decoder.cpp",
        "cpu_lora.cpp",
        "cpu_moe.cpp",
        "cpu_w8a16.cpp",
        "cpu_gguf_pack.cpp",
        "cpu_w8a8.cpp",
    )
)
# -ffast-math vectorises exp and the reductions (the kernels keep every value finite); -fopenmp
# makes at::parallel_for parallel, on torch's own OpenMP pool (the same libgomp.so.1, already loaded)
COMMON_CFLAGS = ("-O3", "-ffast-math", "-fopenmp")
ENV_SWITCH = "TOKENLOOM_CPU_KERNELS"
ENV_LEVEL = "TOKENLOOM_CPU_ISA"
NAMESPACE_PREFIX = "tokenloom_cpu_"

# the operators each level's library registers, and the torch path a layer takes without them
OPERATORS = {
    "int4_linear": "torch's weight-only int4 matmul (aten._weight_int4pack_mm_for_cpu) or a dense copy",
    "int8_linear": "a dense LM head (oneDNN matmul) and dense Q8_0 linear layers",
    "int5_linear": "dense Q5_0, Q5_1 and Q5_K linear layers (dequantized at load)",
    "int6_linear": "dense Q6_K linear layers (dequantized at load)",
    "int4_linear_bf16": "int4_linear (8-bit activations) for prompt rows too",
    "int5_linear_bf16": "int5_linear (8-bit activations) for prompt rows too",
    "int6_linear_bf16": "int6_linear (8-bit activations) for prompt rows too",
    "int3_linear": "dense Q3_K linear layers (dequantized at load)",
    "int2_linear": "dense Q2_K linear layers (dequantized at load)",
    "w8a16_linear": "compressed-tensors FP8 and W8A16 layers dequantized from their 8-bit codes at every call",
    "w8a8_linear": "compressed-tensors W8A8 int8 layers: the int8 codes scaled to float and a torch matmul at every call",
    "decode_layer": "the layer's Python path",
    "decode_layer_lora": "the layer's Python path (with its LoRA deltas)",
    "decode_layers": "each layer's own call (decode_layer, or its Python path)",
    "moe_experts": "a torch loop over the experts a batch routes to",
    "lora_bgmv_": "the torch LoRA delta (every used slot's columns, masked, as two matmuls)",
    "paged_decode_attention": "the torch paged attention (gathered keys and values, SDPA)",
    "write_kv_cache": "the torch paged attention (index_put)",
    "rms_norm": "the torch RMSNorm chain",
    "rotary_embedding_": "the torch rotary chain",
    "act_and_mul": "the torch activation chain",
    "causal_softmax_": "torch softmax",
    "gguf_pack_int4": "the torch repacking of Q4_0/Q4_1/Q4_K blocks at load (slower start-up)",
    "gguf_pack_int6": "dense Q6_K linear layers and experts (dequantized at load)",
}

_X86 = ("x86_64", "amd64", "i686", "i386")


@dataclass(frozen=True)
class IsaLevel:
    """One build of the operators: the CPU flags it needs and the compiler flags it takes."""

    name: str
    description: str
    machines: tuple[str, ...]  # platform.machine() values it applies to (lower case); () for any
    required_flags: tuple[str, ...]  # /proc/cpuinfo flags the host must have
    cflags: tuple[str, ...]
    # host flags that add a compiler flag when present (the kernels have a branch for them)
    optional_flags: tuple[tuple[str, str], ...] = ()

    @property
    def namespace(self) -> str:
        return NAMESPACE_PREFIX + self.name

    @property
    def library_name(self) -> str:
        return f"tokenloom_cpu_ops_{self.name}"


_V3_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")  # abm: lzcnt
# Best first. VNNI is part of the avx512 level (every AVX-512 CPU since Cascade Lake has it, and
# the integer kernels are built on it; an AVX-512 CPU without it takes avx2); BF16 is an extension
# inside the level, and AVX-VNNI (the 256-bit vpdpbusd of Intel's AVX2 CPUs since Alder Lake) one
# inside avx2: used where the host has it (the kernels keep a branch without it and their results
# do not depend on it), not a level of its own: a level is a whole compile of the sources.
# ARM would add a level here (machines=("aarch64", "arm64"), NEON/SVE flags) beside generic.
LEVELS = (
    IsaLevel(
        "avx512",
        "x86-64-v4 (AVX-512 F/BW/VL/DQ/CD) + AVX512-VNNI",
        _X86,
        _V3_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"),
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"),
        (("avx512_bf16", "-mavx512bf16"),),
    ),
    IsaLevel(
        "avx2",
        "x86-64-v3 (AVX2 + FMA + F16C)",
        _X86,
        _V3_FLAGS,
        ("-march=x86-64-v3", "-mtune=native"),
        (("avx_vnni", "-mavxvnni"),),
    ),
    IsaLevel("generic", "the compiler's baseline for this machine, no explicit vector code", (), (), ()),
)
LEVELS_BY_NAME = {level.name: level for level in LEVELS}

_lock = threading.Lock()
# one per level, so that several levels build at once (main); a level builds once per process
_level_locks = {level.name: threading.Lock() for level in LEVELS}
_loaded: dict[str, Any] = {}  # level name -> its ops namespace, or None when it failed
_failures: dict[str, str] = {}  # level name -> why it did not load
_selection: dict[str, Any] = {}  # "level": the selected IsaLevel; "ops": its namespace (hot path)
_UNSET = object()


def mode() -> str:
    """``off``, ``on`` (use the operators when they load) or ``require`` (fatal when they do not)."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value == "require":
        return "require"
    return "on"


def enabled() -> bool:
    return mode() != "off"


def _cpuinfo_field(*names: str) -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags as /proc/cpuinfo names them (empty where it has none)."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def _runs_here(level: IsaLevel, flags: frozenset[str], machine: str) -> bool:
    return (not level.machines or machine in level.machines) and all(flag in flags for flag in level.required_flags)


def host_levels() -> list[IsaLevel]:
    """The levels this CPU can run, best first (``generic`` always last)."""
    flags, machine = cpu_flags(), platform.machine().lower()
    return [level for level in LEVELS if _runs_here(level, flags, machine)]


def selected_level() -> IsaLevel:
    """``TOKENLOOM_CPU_ISA`` when set (a :class:`ConfigError` when the CPU cannot run it), else
    the best level the CPU runs."""
    levels = host_levels()
    forced = os.environ.get(ENV_LEVEL, "").strip().lower()
    if not forced or forced == "auto":
        return levels[0]
    runnable = ", ".join(level.name for level in levels)
    if forced not in LEVELS_BY_NAME:
        raise ConfigError(f"{ENV_LEVEL}={forced!r} is not a kernel level: use one of {runnable} (or auto)")
    if all(level.name != forced for level in levels):
        raise ConfigError(
            f"{ENV_LEVEL}={forced}: this CPU cannot run the {forced} kernels "
            f"({LEVELS_BY_NAME[forced].description}); it runs {runnable}"
        )
    return LEVELS_BY_NAME[forced]


def compiler_flags(level: IsaLevel) -> list[str]:
    flags = cpu_flags()
    extra = [cflag for flag, cflag in level.optional_flags if flag in flags]
    return [*COMMON_CFLAGS, *level.cflags, *extra, f"-DTOKENLOOM_CPU_NAMESPACE={level.namespace}"]


def build_directory(level: IsaLevel | None = None) -> Path:
    """Where this source, torch, Python, CPU and level's build lives (one directory each)."""
    import torch

    level = level or selected_level()
    digest = hashlib.sha256()
    for source in sorted(SOURCES[0].parent.iterdir()):  # the sources and the headers they share
        digest.update(source.name.encode() + source.read_bytes())
    cpu = " ".join(sorted(cpu_flags())) + _cpuinfo_field("model name") or platform.machine()
    for part in (torch.__version__, sys.version, cpu, level.name, " ".join(compiler_flags(level))):
        digest.update(part.encode())
    root = Path(os.environ.get("TOKENLOOM_CACHE_DIR") or Path.home() / ".cache" / "tokenloom")
    return root / "kernels" / f"{level.name}-{digest.hexdigest()[:16]}"


def load_level(level: IsaLevel) -> Any:
    """``level``'s operator namespace, building its library first when it is not cached; None
    when it cannot be built or loaded (the reason in :func:`failure`)."""
    with _level_locks[level.name]:
        if level.name not in _loaded:
            try:
                _loaded[level.name] = _load_or_build(level)
            except Exception as error:  # noqa: BLE001 - any build failure means "use the torch path"
                lines = str(error).strip().splitlines()
                _failures[level.name] = f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
                _loaded[level.name] = None
        return _loaded[level.name]


def failure(level: IsaLevel) -> str | None:
    """Why ``level``'s library did not load (None when it did, or was not tried)."""
    return _failures.get(level.name)


def load() -> Any:
    """The selected level's operator namespace; None when disabled or unavailable (said once, as
    a warning; fatal under ``TOKENLOOM_CPU_KERNELS=require``)."""
    if not enabled():
        if not _selection.get("announced_off"):
            _selection["announced_off"] = True
            logger.info("tokenloom CPU kernels: off (%s=0): every operator takes its torch path", ENV_SWITCH)
        return None
    ops = _selection.get("ops", _UNSET)
    if ops is _UNSET:
        level = selected_level()
        ops = load_level(level)
        with _lock:
            first = "ops" not in _selection
            _selection["level"], _selection["ops"] = level, ops
        if first:
            _announce(level, ops)
    if ops is None and mode() == "require":
        level = _selection["level"]
        raise RuntimeError(
            f"tokenloom CPU kernels ({level.name}) unavailable: {failure(level)}; {ENV_SWITCH}=require makes this fatal"
        )
    return ops


def _announce(level: IsaLevel, ops: Any) -> None:
    if ops is not None:
        logger.info(
            "tokenloom CPU kernels: %s level (%s), torch.ops.%s", level.name, level.description, level.namespace
        )
    elif failure(level) is not None:
        logger.warning(
            "tokenloom CPU kernels unavailable (%s level: %s): the slower torch paths run; "
            "`tokenloom env` shows each operator's path",
            level.name,
            failure(level),
        )


def ops_for(tensor: Any) -> Any:
    """The operators when they can run on ``tensor`` (a CPU tensor, operators loaded), else None:
    the layers' switch between a fused operator and their torch code. A GPU tensor gets the
    same operators as Triton kernels (:mod:`tokenloom.kernels.triton.layers`) when triton is
    installed."""
    if tensor.device.type == "cuda":
        return _triton_ops()
    ops = _selection.get("ops", _UNSET)
    if ops is _UNSET:
        ops = load()
    return ops if ops is not None and tensor.device.type == "cpu" else None


@functools.cache
def _triton_ops() -> Any:
    if importlib.util.find_spec("triton") is None:
        return None
    from tokenloom.kernels.triton import layers

    return layers


@contextlib.contextmanager
def using_level(name: str) -> Iterator[Any]:
    """Within the block the process selects level ``name`` (loading it; ConfigError when the host
    cannot run it): what the tests use to run every level the host can. Yields its namespace."""
    previous = os.environ.get(ENV_LEVEL)
    saved = dict(_selection)
    os.environ[ENV_LEVEL] = name
    _selection.clear()
    try:
        selected_level()  # raises for a level the host cannot run
        yield load()
    finally:
        if previous is None:
            os.environ.pop(ENV_LEVEL, None)
        else:
            os.environ[ENV_LEVEL] = previous
        _selection.clear()
        _selection.update(saved)


def _load_or_build(level: IsaLevel) -> Any:
    import torch

    directory = build_directory(level)
    library = directory / f"{level.library_name}.so"
    if not library.exists():
        _build(level, directory)
    torch.ops.load_library(str(library))
    return getattr(torch.ops, level.namespace)


def _build(level: IsaLevel, directory: Path) -> None:
    import time

    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building tokenloom CPU kernels (%s) in %s (once per source, torch and CPU)", level.name, directory)
    started = time.perf_counter()
    # the level's one translation unit (see the module's docstring)
    unit = directory / f"{level.library_name}.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in SOURCES))
    cpp_extension.load(
        name=level.library_name,
        sources=[str(unit)],
        extra_cflags=compiler_flags(level),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    logger.info("built tokenloom CPU kernels (%s) in %.1f s", level.name, time.perf_counter() - started)


def status() -> dict[str, Any]:
    """What this process uses: the CPU, the levels it runs, the selected level (loading it) or why
    there is none, and per operator the level that runs it or the torch path it falls back to."""
    levels, flags = host_levels(), cpu_flags()
    info: dict[str, Any] = {
        "cpu": _cpuinfo_field("model name") or platform.processor() or platform.machine(),
        "levels": [level.name for level in levels],
        # the optional instructions the host's levels are built with (avx512_bf16, avx_vnni)
        "extensions": [flag for level in levels for flag, _ in level.optional_flags if flag in flags],
        "mode": mode(),
        "level": None,
        "forced": False,
        "namespace": None,
        "build_directory": None,
        "problem": None,
        "amx_int8": None,  # whether w8a8_linear and int4_linear take AMX-INT8, and from how many rows
        "amx_bf16": None,  # whether the *_linear_bf16 prompt-row kernels can run (AMX-BF16)
    }
    ops = None
    if not enabled():
        info["problem"] = f"switched off ({ENV_SWITCH}=0)"
    else:
        try:
            level = selected_level()
        except ConfigError as error:
            info["problem"] = str(error)
        else:
            ops = load_level(level)
            info["level"], info["namespace"] = level.name, level.namespace
            info["forced"] = os.environ.get(ENV_LEVEL, "").strip().lower() not in ("", "auto")
            info["build_directory"] = str(build_directory(level))
            if ops is None:
                info["problem"] = f"the {level.name} library did not build or load: {failure(level)}"
            else:
                info["amx_int8"] = _amx_state(ops, level)
                info["amx_bf16"] = _amx_bf16_state(ops, level)
    info["operators"] = {
        name: info["level"] if ops is not None and hasattr(ops, name) else f"torch: {fallback}"
        for name, fallback in OPERATORS.items()
    }
    return info


def _amx_state(ops: Any, level: IsaLevel) -> str:
    """Whether ``level``'s w8a8_linear and int4_linear take their AMX-INT8 paths here, and from
    how many rows."""
    from tokenloom.kernels import w8a8_matmul

    if not (hasattr(ops, "w8a8_amx_available") and ops.w8a8_amx_available()):
        reason = "the CPU has no amx_int8" if "amx_int8" not in cpu_flags() else f"not in the {level.name} build"
        return f"not used ({reason})"
    rows = w8a8_matmul.amx_min_rows()
    if not rows:
        return f"off ({w8a8_matmul.ENV_AMX}=0)"
    # (the kernel reads TOKENLOOM_CPU_AMX itself at each call: 0 there too)
    int4_rows = int(ops.quantized_amx_min_rows(4))
    return f"w8a8_linear from {rows} rows, int4_linear (and the 4-bit MoE experts) from {int4_rows} rows"


def _amx_bf16_state(ops: Any, level: IsaLevel) -> str:
    """Whether ``level``'s AMX-BF16 prompt-row kernels (int4/int5/int6_linear_bf16) can run here."""
    if ops.bf16_amx_available():
        return "int4_linear_bf16, int5_linear_bf16 and int6_linear_bf16 available (prompt rows)"
    flags = cpu_flags()
    if level.name != "avx512":
        return f"not used (not in the {level.name} build)"
    if not {"amx_bf16", "amx_tile", "avx512_bf16", "avx512vbmi"} <= flags:
        return "not used (the CPU has no amx_bf16, avx512_bf16 or avx512vbmi)"
    return "off (TOKENLOOM_CPU_AMX=0)"


def report() -> list[str]:
    """:func:`status` as lines of text."""
    info = status()
    lines = [
        f"CPU: {info['cpu']}",
        f"kernel levels this CPU runs: {', '.join(info['levels'])}"
        + (f" (with {', '.join(info['extensions'])})" if info["extensions"] else ""),
    ]
    if info["problem"] is None:
        level = LEVELS_BY_NAME[info["level"]]
        lines.append(
            f"tokenloom CPU kernels: {level.name} level{f' (forced by {ENV_LEVEL})' if info['forced'] else ''}"
            f", {level.description}: torch.ops.{level.namespace}, built in {info['build_directory']}"
        )
    else:
        lines.append(f"tokenloom CPU kernels: unavailable, {info['problem']}")
    if info["amx_int8"] is not None:
        lines.append(f"AMX-INT8: {info['amx_int8']}")
    if info["amx_bf16"] is not None:
        lines.append(f"AMX-BF16: {info['amx_bf16']}")
    lines.append("operators:")
    lines.extend(f"  {name}: {path}" for name, path in info["operators"].items())
    return lines


def env_main(argv: list[str]) -> int:
    """``tokenloom env``: the CPU, its kernel levels, and the path each operator takes."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="tokenloom env",
        description="Show the CPU kernel level tokenloom uses "
        f"and the path each operator takes ({ENV_LEVEL} forces a lower level, "
        f"{ENV_SWITCH}=0 turns the kernels off, =require makes a missing one fatal).",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    options = parser.parse_args(argv)
    if options.json:
        print(json.dumps(status(), indent=2))
    else:
        print("\n".join(report()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Build (or find cached) every level the host can run, all at once (a level is one compiler
    process); exit 1 when one fails."""
    from concurrent.futures import ThreadPoolExecutor

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not enabled():
        print(f"tokenloom CPU kernels: off ({ENV_SWITCH}=0)")
        return 0
    status = 0
    levels = host_levels()
    with ThreadPoolExecutor(max_workers=len(levels)) as pool:
        loaded = list(pool.map(load_level, levels))
    for level, ops in zip(levels, loaded):
        if ops is None:
            print(f"tokenloom CPU kernels ({level.name}): not available ({failure(level)})")
            status = 1
        else:
            print(f"tokenloom CPU kernels ({level.name}): ready in {build_directory(level)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
