"""Per-token cost of guided decoding: SmolLM2 generates the same batch with no constraint and
under one JSON schema per backend, every request running to ``--output-len`` tokens (the
schema's array is longer than that, the free run ignores EOS), so each run generates exactly
the same number of tokens in batches of the same shape. Compiles are warmed up first.

Two numbers per backend: tokens/s of the whole run (best of ``--rounds`` rounds, the runs
taking turns, each round starting with the next contender, since a busy machine only ever
slows a run down), and the guided-decoding time itself per generated token (filling the
masks, advancing the matchers, unpacking the masks in the sampler), timed inside the run.

    .venv/bin/python benchmarks/bench_structured_outputs.py [--batch-size 8] [--output-len 96] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import tokenloom.core.sampler as sampler_module
from tokenloom import LLM, SamplingParams

# every backend takes it (lm-format-enforcer included: no numbers, every property required)
SCHEMA = {
    "type": "array",
    "minItems": 60,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
            "colour": {"enum": ["red", "green", "blue"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "colour", "active"],
    },
}
BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")


class GuidedTimer:
    """Seconds spent in the guided-decoding calls of the engine and the sampler."""

    def __init__(self, llm: LLM):
        self.seconds = 0.0
        manager = llm.engine.structured_outputs
        for owner, name in ((manager, "grammar_bitmask"), (manager, "advance"), (sampler_module, "unpack_bitmask")):
            setattr(owner, name, self.timed(getattr(owner, name)))

    def timed(self, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return wrapper


def prompts(batch_size: int) -> list[str]:
    return [
        f"<|im_start|>user\nList {60 + i} people as JSON objects with a name, a colour and whether they are "
        f"active.<|im_end|>\n<|im_start|>assistant\n"
        for i in range(batch_size)
    ]


def run(llm: LLM, timer: GuidedTimer, batch: list[str], output_len: int, backend: str | None):
    """(seconds, guided-decoding seconds, generated tokens) of one batch."""
    constraint = None if backend is None else {"json": SCHEMA, "backend": backend}
    params = [
        SamplingParams(
            temperature=1.0,
            seed=index,
            max_tokens=output_len,
            ignore_eos=backend is None,
            structured_outputs=constraint,
        )
        for index in range(len(batch))
    ]
    guided_before = timer.seconds
    started = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - started
    for output in outputs:
        if output.outputs[0].finish_reason != "length":
            raise RuntimeError(f"a request ended early ({output.outputs[0].finish_reason}): the runs would differ")
    return elapsed, timer.seconds - guided_before, sum(len(output.outputs[0].token_ids) for output in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    llm = LLM("smollm2", max_model_len=1024)
    timer = GuidedTimer(llm)
    batch = prompts(args.batch_size)
    contenders = [None, *BACKENDS]
    for backend in contenders:  # warm-up: compiles, vocabulary tables, first-step costs
        run(llm, timer, batch[:2], 8, backend)
    best: dict[str | None, float] = defaultdict(lambda: float("inf"))
    guided: dict[str | None, float] = defaultdict(lambda: float("inf"))
    num_tokens = 0
    for round_index in range(args.rounds):
        shift = round_index % len(contenders)
        for backend in contenders[shift:] + contenders[:shift]:
            elapsed, guided_seconds, num_tokens = run(llm, timer, batch, args.output_len, backend)
            best[backend] = min(best[backend], elapsed)
            guided[backend] = min(guided[backend], guided_seconds)
    print(
        f"batch {args.batch_size} x {args.output_len} tokens = {num_tokens} tokens per run, "
        f"best of {args.rounds} rounds"
    )
    print("| backend | tokens/s | slowdown | guided-decoding time per token (ms) |")
    print("| --- | --- | --- | --- |")
    for backend in contenders:
        print(
            f"| {backend or 'none (no constraint)'} | {num_tokens / best[backend]:.1f} | "
            f"{best[backend] / best[None]:.2f}x | {guided[backend] / num_tokens * 1000:.3f} |"
        )


if __name__ == "__main__":
    main()
