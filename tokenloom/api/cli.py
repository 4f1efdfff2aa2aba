"""The ``tokenloom`` command line: ``serve`` (its flags parsed in :mod:`tokenloom.api.serve_args`,
its help rendered in :mod:`tokenloom.api.serve_help`), ``bench`` (:mod:`tokenloom.api.bench`),
``plugins``, ``models``, ``chat``, ``complete`` and ``version``.

A subcommand is one function registered with :func:`subcommand`. Nothing heavy (torch,
transformers, plugin modules) is imported before a command needs it, so ``--help`` and
``version`` answer at once.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.api.serve_args import (
    API_KEY_ENV,
    DEFAULT_MODEL,
    LOGGING_LEVEL_ENV,
    ConfigErrorParser,
    ServeArgs,
    check_plugin_choices,
    parse_serve_args,
)
from tokenloom.api.serve_help import help_request, render_serve_help
from tokenloom.errors import ConfigError, PluginError, TokenloomError

# the names other modules import from here
__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MODEL",
    "EXIT_USAGE",
    "ServeArgs",
    "SUBCOMMANDS",
    "check_plugin_choices",
    "main",
    "parse_serve_args",
    "render_serve_help",
    "subcommand",
]

EXIT_USAGE = 2  # bad flags, config files, plugin files: as argparse exits
EXIT_FAILURE = 1  # anything else that stopped a command: a model that does not load, say


# -- subcommands ---------------------------------------------------------------------------


@dataclass
class Subcommand:
    name: str
    summary: str
    run: Callable[[list[str]], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(name: str, summary: str) -> Callable[[Callable[[list[str]], int]], Callable[[list[str]], int]]:
    """Register ``run(argv) -> exit code`` as ``tokenloom NAME``."""

    def decorate(run: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
        SUBCOMMANDS[name] = Subcommand(name, summary, run)
        return run

    return decorate


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0 if argv else EXIT_USAGE
    if argv[0] in ("-V", "--version"):
        return SUBCOMMANDS["version"].run([])
    name, rest = argv[0], argv[1:]
    command = SUBCOMMANDS.get(name)
    if command is None:
        hint = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        print(
            f"tokenloom: error: unknown command {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" (commands: {', '.join(SUBCOMMANDS)})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        return command.run(rest)
    except BrokenPipeError:  # `tokenloom serve --help=all | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        return _report_failure(name, exc)


def _report_failure(command: str, exc: Exception) -> int:
    """One line that says what went wrong (a tokenloom error's message already says what to
    change); the traceback only at debug level, where whoever reads it asked for it."""
    debug = os.environ.get(LOGGING_LEVEL_ENV, "").upper() == "DEBUG"
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, TokenloomError):
        message = exc.message
    else:  # not one tokenloom raises on purpose: name its type, it is all a reader has
        message = f"{type(exc).__name__}: {exc}"
    usage = isinstance(exc, (ConfigError, PluginError))  # the message names the flag or plugin
    hint = "" if debug or usage else f" (the traceback: {LOGGING_LEVEL_ENV}=DEBUG)"
    print(f"tokenloom {command}: error: {' '.join(message.split())}{hint}", file=sys.stderr)
    return EXIT_USAGE if usage else EXIT_FAILURE


def _top_level_help() -> str:
    width = max(len(name) for name in SUBCOMMANDS) + 2
    lines = [
        "usage: tokenloom <command> [flags]",
        "",
        "An LLM inference and serving engine that takes vLLM's flags; everything concrete is a plugin.",
        "",
        "commands:",
        *(f"  {command.name:<{width}}{command.summary}" for command in SUBCOMMANDS.values()),
        "",
        "Run `tokenloom <command> --help` for a command's flags.",
    ]
    return "\n".join(lines)


@subcommand("version", "print the version")
def version_command(argv: list[str]) -> int:
    from tokenloom import __version__

    print(f"tokenloom {__version__}")
    return 0


@subcommand("env", "show the CPU kernel level and the path each operator takes (torch or tokenloom's kernels)")
def env_command(argv: list[str]) -> int:
    from tokenloom.kernels.cpu_native import env_main

    return env_main(argv)


@subcommand("plugins", "list the plugins: where each comes from, what it registered, and what failed")
def plugins_command(argv: list[str]) -> int:
    parser = ConfigErrorParser(prog="tokenloom plugins", description="List the plugins tokenloom loads.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="also load this importable module as a plugin (repeatable)",
    )
    parser.add_argument(
        "--tool-parser-plugin",
        action="append",
        default=[],
        metavar="FILE",
        help="also load this .py file as a plugin (repeatable)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also import every registered target ('module:Class' strings are otherwise imported "
        "on first use); exit 1 if a plugin or a target fails",
    )
    if any(token in ("-h", "--help") for token in argv):
        print(parser.format_help())
        return 0
    options = parser.parse_args(argv)
    from tokenloom.plugins.manager import load_plugins

    # failures are printed below, in full: the manager's log line would say it twice
    with _quiet_logger("tokenloom.plugins.manager"):
        plugin_set = load_plugins(modules=options.plugin, files=options.tool_parser_plugin)
    unresolved = _resolve_every_target(plugin_set) if options.check else []
    failed = bool(plugin_set.failures or unresolved)
    if options.json:
        listing: dict[str, object] = {
            "plugins": [
                {"name": info.name, "origin": info.origin, "registered": info.registered} for info in plugin_set.plugins
            ],
            "failures": [
                {"name": failure.name, "origin": failure.origin, "cause": failure.cause}
                for failure in plugin_set.failures
            ],
        }
        if options.check:
            listing["unresolved"] = [{"kind": kind, "name": name, "cause": cause} for kind, name, cause in unresolved]
        print(json.dumps(listing, indent=2))
        return 1 if options.check and failed else 0
    print(f"{len(plugin_set.plugins)} plugins loaded, {len(plugin_set.failures)} failed")
    for info in plugin_set.plugins:
        print(f"\n{info.name}  ({info.origin})")
        for kind, names in info.registered.items():
            print(f"  {kind}: {', '.join(names)}")
        if not info.registered:
            print(f"  (registered nothing: {info.nothing_registered_reason()})")
    if plugin_set.failures:
        print("\nfailed:")
        for failure in plugin_set.failures:
            print(f"  {failure.name}  ({failure.origin}): {failure.cause}")
    if options.check:
        total = sum(len(registry) for registry in plugin_set.registries.values())
        print(f"\ncheck: {total - len(unresolved)} of {total} registered targets import")
        for kind, name, cause in unresolved:
            print(f"  {kind} {name!r}: {cause}")
        return 1 if failed else 0
    return 0


@subcommand("models", "list the model architectures tokenloom serves: runner, load formats, plugin")
def models_command(argv: list[str]) -> int:
    parser = ConfigErrorParser(
        prog="tokenloom models",
        description="List every model architecture tokenloom serves natively (built in or added by a plugin).",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON instead of text")
    output.add_argument("--markdown", action="store_true", help="print the Markdown table of docs/models.md")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="also load this importable module as a plugin (repeatable)",
    )
    if any(token in ("-h", "--help") for token in argv):
        print(parser.format_help())
        return 0
    options = parser.parse_args(argv)
    from tokenloom.api.model_catalog import architecture_rows, render_json, render_markdown, render_text
    from tokenloom.plugins.manager import load_plugins

    with _quiet_logger("tokenloom.plugins.manager"):
        plugin_set = load_plugins(modules=options.plugin)
    rows = architecture_rows(plugin_set)
    if options.json:
        print(json.dumps(render_json(rows), indent=2))
    elif options.markdown:
        sys.stdout.write(render_markdown(rows))
    else:
        print(render_text(rows))
    return 0


def _resolve_every_target(plugin_set: Any) -> list[tuple[str, str, str]]:
    """Import every registered target: ``(kind, name, cause)`` of those that fail."""
    unresolved = []
    for kind, registry in plugin_set.registries.items():
        for entry in registry.entries():
            try:
                entry.resolve()
            except Exception as exc:  # a target's module may raise anything at import
                unresolved.append((kind, entry.name, str(exc)))
    return unresolved


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@subcommand("bench", "benchmark latency, throughput (offline) or a running server, like `vllm bench`")
def bench_command(argv: list[str]) -> int:
    from tokenloom.api.bench import run

    return run(argv)


@subcommand("chat", "chat with a running server (like `vllm chat`)")
def chat_command(argv: list[str]) -> int:
    from tokenloom.api.clients import chat

    return chat(argv)


@subcommand("complete", "complete prompts with a running server (like `vllm complete`)")
def complete_command(argv: list[str]) -> int:
    from tokenloom.api.clients import complete

    return complete(argv)


@subcommand("serve", "start the OpenAI-compatible server (vLLM's `serve` flags)")
def serve_command(argv: list[str]) -> int:
    requested_help = help_request(argv)
    if requested_help is not None:
        text, found = render_serve_help(requested_help)
        print(text)
        return 0 if found else EXIT_USAGE
    serve_args = parse_serve_args(argv)
    from tokenloom.plugins.manager import load_plugins

    # run_server logs the failures (and serve_args.warnings) once its logging is set up
    started = time.perf_counter()
    with _quiet_logger("tokenloom.plugins.manager"):
        serve_args.plugins = load_plugins(
            modules=serve_args.server.plugins,
            files=serve_args.server.tool_parser_plugin,
            strict=serve_args.server.strict_plugins,
        )
    serve_args.plugins_load_seconds = time.perf_counter() - started
    check_plugin_choices(serve_args)
    from tokenloom.api.server import run_server

    run_server(serve_args)
    return 0
