"""``tokenloom bench latency | throughput | serve``: the benchmark commands, shaped like
``vllm bench`` (its flags, printed summaries and JSON keys). One module per command; this
package's root only dispatches, so ``tokenloom bench --help`` imports nothing heavy.
"""

from __future__ import annotations

import importlib
import sys

from tokenloom.errors import ConfigError, TokenloomError

# command -> (module, summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "latency": ("tokenloom.api.bench.latency", "the latency of one batch, in this process (vLLM's `bench latency`)"),
    "throughput": (
        "tokenloom.api.bench.throughput",
        "offline throughput over many prompts, in this process (vLLM's `bench throughput`)",
    ),
    "serve": (
        "tokenloom.api.bench.serve",
        "TTFT, TPOT, ITL and throughput of any OpenAI-compatible server (vLLM's `bench serve`)",
    ),
}
EXIT_FAILED = 1


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    return "\n".join(
        [
            "usage: tokenloom bench {latency,throughput,serve} [flags]",
            "",
            "Benchmarks with vLLM's flags, summaries and JSON result keys.",
            "",
            "commands:",
            *(f"  {name:<{width}}{summary}" for name, (_, summary) in COMMANDS.items()),
            "",
            "Run `tokenloom bench <command> --help` for a command's flags; docs/benchmarking.md compares",
            "tokenloom with vLLM side by side.",
        ]
    )


def run(argv: list[str]) -> int:
    """``tokenloom bench COMMAND [flags]`` -> exit code. Flag errors raise ConfigError (the CLI
    prints them and exits 2); an engine or model error is printed here and exits 1."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        raise ConfigError(f"unknown bench command {name!r}; choose one of: {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[name][0])
    try:
        exit_code: int = module.run(rest)  # every bench module's run(argv) -> exit code
        return exit_code
    except ConfigError:
        raise
    except TokenloomError as exc:
        print(f"tokenloom bench {name}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
