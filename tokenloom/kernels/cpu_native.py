"""tokenloom's own CPU operators (``csrc/*.cpp``, namespace ``torch.ops.tokenloom_cpu``):
compiled once per source, torch version and CPU into a cache directory, then loaded in a few
milliseconds on later starts.

:func:`load` returns the operator namespace, or None when the operators cannot be had (no C++
compiler, a build error, or ``TOKENLOOM_CPU_KERNELS=0``); callers then keep their torch path.
``make install`` builds them ahead of time (``python -m tokenloom.kernels.cpu_native``), so a
first start does not pay the ~1 minute compile. The cache lives in ``$TOKENLOOM_CACHE_DIR``
(default ``~/.cache/tokenloom``)/``kernels``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

NAMESPACE = "tokenloom_cpu"
LIBRARY_NAME = "tokenloom_cpu_ops"
SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in (
    "cpu_attention.cpp", "cpu_layers.cpp", "cpu_qlinear.cpp", "cpu_decoder.cpp"))
# -march=native: the library is built on (and keyed to) the CPU that runs it; -ffast-math
# vectorises exp and the reductions (the kernels keep every value finite); -fopenmp makes
# at::parallel_for parallel, on torch's own OpenMP pool (the same libgomp.so.1, already loaded)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
ENV_SWITCH = "TOKENLOOM_CPU_KERNELS"

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_directory() -> Path:
    """Where this source, torch, Python and CPU's build lives (one directory per combination)."""
    import torch

    digest = hashlib.sha256()
    for source in sorted(SOURCES[0].parent.iterdir()):  # the sources and the headers they share
        digest.update(source.name.encode() + source.read_bytes())
    for part in (torch.__version__, sys.version, _cpu_flags(), " ".join(CFLAGS)):
        digest.update(part.encode())
    root = Path(os.environ.get("TOKENLOOM_CACHE_DIR") or Path.home() / ".cache" / "tokenloom")
    return root / "kernels" / digest.hexdigest()[:16]


def load() -> Any:
    """The ``torch.ops.tokenloom_cpu`` namespace, building the library first when it is not
    cached; None when disabled or unavailable (the reason is logged once)."""
    if not enabled():
        return None
    with _lock:
        if "ops" not in _loaded:
            try:
                _loaded["ops"] = _load_or_build()
            except Exception as error:  # noqa: BLE001 - any build failure means "use the torch path"
                reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
                logger.warning("tokenloom CPU kernels unavailable (%s: %s); using the torch paths",
                               type(error).__name__, reason)
                _loaded["ops"] = None
        return _loaded["ops"]


def ops_for(tensor: Any) -> Any:
    """The operators when they can run on ``tensor`` (a CPU tensor, operators loaded), else None:
    the layers' switch between a fused operator and their torch code."""
    ops = _loaded.get("ops", _UNSET)
    if ops is _UNSET:
        ops = load()
    return ops if ops is not None and tensor.device.type == "cpu" else None


_UNSET = object()


def _load_or_build() -> Any:
    import torch

    directory = build_directory()
    library = directory / f"{LIBRARY_NAME}.so"
    if not library.exists():
        _build(directory)
    torch.ops.load_library(str(library))
    return getattr(torch.ops, NAMESPACE)


def _build(directory: Path) -> None:
    import time

    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building tokenloom CPU kernels in %s (once per source, torch and CPU)", directory)
    started = time.perf_counter()
    cpp_extension.load(
        name=LIBRARY_NAME,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    logger.info("built tokenloom CPU kernels in %.1f s", time.perf_counter() - started)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ops = load()
    if ops is None:
        print("tokenloom CPU kernels: not available (the torch paths will be used)")
        return 0 if not enabled() else 1
    print(f"tokenloom CPU kernels: ready in {build_directory()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
