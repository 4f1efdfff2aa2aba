"""How long `tokenloom --help`, `serve --help`, `serve --help=ModelConfig` and `version` take in a
fresh interpreter, from the first tokenloom import to the answer (the interpreter's own start
not counted): the CLI's target is under 1 s each, which it meets by importing no heavy module
(tests/api/test_cli.py checks that part; a time is a benchmark's business, since a loaded
machine stretches it several-fold).

  python benchmarks/cli_startup.py [--runs 5]
"""

import argparse
import json
import statistics
import subprocess
import sys

COMMANDS = (["--help"], ["serve", "--help"], ["serve", "--help=ModelConfig"], ["version"])
TARGET_SECONDS = 1.0


def seconds_to_answer(argv: list[str]) -> float:
    probe = (
        "import contextlib, io, time\n"
        "started = time.perf_counter()\n"
        "from tokenloom.api.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main({argv!r})\n"
        "print(code, time.perf_counter() - started)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    code, elapsed = result.stdout.split()
    if code != "0":
        raise SystemExit(f"tokenloom {' '.join(argv)} exited with {code}")
    return float(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per command; the median counts")
    args = parser.parse_args()
    rows = []
    for argv in COMMANDS:
        times = [seconds_to_answer(argv) for _ in range(args.runs)]
        median = statistics.median(times)
        rows.append(
            {
                "command": " ".join(["tokenloom", *argv]),
                "median_s": round(median, 3),
                "runs_s": [round(t, 3) for t in times],
                "under_target": median < TARGET_SECONDS,
            }
        )
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
