"""Helpers the bench commands share: an argument parser that raises ConfigError, percentiles
like numpy's, and JSON result files (``--help`` is read as ``serve`` reads it: serve_help)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any, NoReturn

from tokenloom.errors import ConfigError

LATENCY_PERCENTAGES = (10, 25, 50, 75, 90, 99)  # what vLLM's bench latency reports


class BenchParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError (exit 2 with a one-line message) instead of
    printing usage and exiting, and never abbreviates flags (engine flags pass through it)."""

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def percentile(values: Sequence[float], percent: float) -> float:
    """The ``percent``-th percentile with linear interpolation (numpy's default method);
    0.0 for no values, as vLLM reports an empty metric."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * percent / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's ``np.std``)."""
    if not values:
        return 0.0
    average = mean(values)
    return math.sqrt(sum((value - average) ** 2 for value in values) / len(values))


def percentile_label(percent: float) -> str:
    """``99`` for 99.0, ``99.9`` for 99.9: the spelling in vLLM's ``p99_ttft_ms`` keys."""
    return str(int(percent)) if float(percent) == int(percent) else str(percent)


def write_json(path: str, results: dict[str, Any]) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=4)
