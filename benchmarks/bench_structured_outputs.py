"""Per-token cost of guided decoding: SmolLM2 generates the same batch with no constraint and
under one JSON schema per backend, every request running to ``--output-len`` tokens (the
schema's array is longer than that, the free run ignores EOS), so each run generates exactly
the same number of tokens in batches of the same shape. The runs take turns for ``--rounds``
rounds, each round starting with the next contender (a busy machine slows them alike), and
the median counts. Compiles are warmed up first:
the time is the per-step mask, its application and advancing the matchers.

    .venv/bin/python benchmarks/bench_structured_outputs.py [--batch-size 8] [--output-len 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenloom import LLM, SamplingParams

# every backend takes it (lm-format-enforcer included: no numbers, every property required)
SCHEMA = {"type": "array", "minItems": 60, "items": {
    "type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                                     "colour": {"enum": ["red", "green", "blue"]}, "active": {"type": "boolean"}},
    "required": ["name", "colour", "active"]}}
BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")


def prompts(batch_size: int) -> list[str]:
    return [f"<|im_start|>user\nList {60 + i} people as JSON objects with a name, a colour and whether they are "
            f"active.<|im_end|>\n<|im_start|>assistant\n" for i in range(batch_size)]


def run(llm: LLM, batch: list[str], output_len: int, backend: str | None) -> tuple[float, int]:
    """(seconds, generated tokens) of one batch."""
    constraint = None if backend is None else {"json": SCHEMA, "backend": backend}
    params = [SamplingParams(temperature=1.0, seed=index, max_tokens=output_len, ignore_eos=backend is None,
                             structured_outputs=constraint) for index in range(len(batch))]
    started = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - started
    for output in outputs:
        if output.outputs[0].finish_reason != "length":
            raise RuntimeError(f"a request ended early ({output.outputs[0].finish_reason}): the runs would differ")
    return elapsed, sum(len(output.outputs[0].token_ids) for output in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM("smollm2", max_model_len=1024)
    batch = prompts(args.batch_size)
    contenders = [None, *BACKENDS]
    for backend in contenders:  # warm-up: compiles, vocabulary tables, first-step costs
        run(llm, batch[:2], 8, backend)
    times: dict[str | None, list[float]] = {backend: [] for backend in contenders}
    num_tokens = 0
    for round_index in range(args.rounds):
        # each round starts with another contender, so a drifting machine load favours none
        for backend in contenders[round_index % len(contenders):] + contenders[:round_index % len(contenders)]:
            elapsed, num_tokens = run(llm, batch, args.output_len, backend)
            times[backend].append(elapsed)
    free = statistics.median(times[None])
    print(f"batch {args.batch_size} x {args.output_len} tokens = {num_tokens} tokens per run, "
          f"median of {args.rounds} rounds")
    print("| backend | tokens/s | ms per step | overhead per token (ms) | slowdown |")
    print("| --- | --- | --- | --- | --- |")
    for backend in contenders:
        elapsed = statistics.median(times[backend])
        overhead = (elapsed - free) / num_tokens * 1000
        print(f"| {backend or 'none (no constraint)'} | {num_tokens / elapsed:.1f} | "
              f"{elapsed / args.output_len * 1000:.1f} | {overhead:+.2f} | {elapsed / free:.2f}x |")


if __name__ == "__main__":
    main()
