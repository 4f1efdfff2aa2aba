"""Triton kernels for GPU platforms, each tested against its torch reference under Triton's
interpreter (``TRITON_INTERPRET=1``) on the CPU. Nothing on the CPU path imports this package's
modules: they import triton, which is the ``gpu`` extra."""

from __future__ import annotations

import importlib
import os
from typing import Any

from tokenloom.errors import ConfigError


def interpreted() -> bool:
    """True when triton runs kernels in its interpreter (read, as triton does, when a module of
    kernels is first imported: set it before that)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def import_kernels(module: str) -> Any:
    """``tokenloom.kernels.triton.<module>``, imported on first use; ConfigError saying what to
    install when triton is absent."""
    try:
        return importlib.import_module(f"tokenloom.kernels.triton.{module}")
    except ImportError as error:
        if getattr(error, "name", None) != "triton" and "triton" not in str(error):
            raise
        raise ConfigError(
            "the Triton kernels need the triton package: pip install 'tokenloom[gpu]' "
            f"(or choose another --attention-backend): {error}"
        ) from error


def check_can_run(device: Any) -> None:
    """ConfigError unless Triton kernels can run on ``device``: a GPU, or the CPU under the
    interpreter."""
    if getattr(device, "type", device) == "cpu" and not interpreted():
        raise ConfigError(
            "Triton kernels run on a GPU; on the CPU only under its interpreter: set TRITON_INTERPRET=1 "
            "(slow, for testing) or choose another --attention-backend",
            param="attention-backend",
        )
