"""The engine flags of the offline benches (``latency``, ``throughput``): every engine flag
of ``tokenloom serve`` by its vLLM name, parsed by serve's own parser so a flag means the same
in both; the HTTP server's flags are refused, since these benches run no server."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenloom.api.flags import FLAG_BY_NAME, FLAGS
from tokenloom.errors import ConfigError

SERVER_GROUP = "Frontend"
# server-group flags that still mean something to an offline bench
ACCEPTED_SERVER_FLAGS = ("config", "plugin", "disable_log_stats")


@dataclass
class EngineFlags:
    """What the engine flags of a bench command parsed into."""

    engine_kwargs: dict[str, Any]  # EngineArgs keyword arguments, ``model`` included
    plugins: list[str] = field(default_factory=list)  # --plugin modules
    warnings: list[str] = field(default_factory=list)  # flags accepted but ignored


def engine_flag_names() -> list[str]:
    return sorted(
        name
        for flag in FLAGS
        if flag.group != SERVER_GROUP or flag.key in ACCEPTED_SERVER_FLAGS
        for name in flag.option_strings
    )


def parse_engine_flags(
    tokens: Sequence[str], command: str, bench_parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
) -> EngineFlags:
    """Parse what the bench's own parser left over as engine flags; ``defaults`` are engine
    arguments the bench sets unless given (vLLM's bench latency turns prefix caching off)."""
    from tokenloom.api.cli import parse_serve_args

    _check_names(tokens, command, bench_parser)
    serve_args = parse_serve_args(list(tokens), environ={})
    engine_kwargs = {**(defaults or {}), **serve_args.engine_kwargs}
    return EngineFlags(engine_kwargs, list(serve_args.server.plugins), serve_args.warnings)


def _check_names(tokens: Sequence[str], command: str, bench_parser: argparse.ArgumentParser) -> None:
    """Unknown flags get a hint among this command's flags (not serve's), and server flags a
    clear refusal."""
    for token in tokens:
        if token == "--":
            break
        if not token.startswith("-") or _is_number(token):
            continue
        name = token.split("=", 1)[0]
        if name.startswith("--"):
            # vLLM's dotted JSON form (--hf-overrides.key) and underscored spellings
            name = name.split(".", 1)[0].replace("_", "-")
        flag = FLAG_BY_NAME.get(name)
        if flag is None:
            known = engine_flag_names() + [
                option for action in bench_parser._actions for option in action.option_strings
            ]
            hint = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            raise ConfigError(
                f"unrecognized argument: {name}"
                + (f"; did you mean {hint[0]}?" if hint else f"; see tokenloom bench {command} --help"),
                param=name.lstrip("-"),
            )
        if flag.group == SERVER_GROUP and flag.key not in ACCEPTED_SERVER_FLAGS:
            raise ConfigError(
                f"{flag.name} is a flag of the HTTP server; `tokenloom bench {command}` runs the engine "
                "in this process and takes engine flags only (use `tokenloom bench serve` against a "
                "running server)",
                param=flag.name[2:],
            )


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


ENGINE_FLAGS_HELP = (
    "Engine flags: every engine flag of `tokenloom serve`, by its vLLM name (--model, --dtype, "
    "--max-model-len, --max-num-seqs, --max-num-batched-tokens, --enable-prefix-caching, --load-format, "
    "--quantization, ...), plus --config FILE and --plugin MODULE. List them with "
    "`tokenloom bench {command} --help=GROUP` (e.g. --help=SchedulerConfig), --help=FLAG or --help=listgroup."
)


def print_help(command: str, parser: argparse.ArgumentParser, request: str) -> int:
    """``--help`` prints the bench's flags; ``--help=X`` the engine flags serve's help finds for X."""
    if request == "":
        print(parser.format_help())
        return 0
    from tokenloom.api.cli import render_serve_help

    text, found = render_serve_help(request)
    print(text)
    return 0 if found else 2
