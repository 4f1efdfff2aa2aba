"""Where a served concurrency-C run's time goes, offline: the engine fed as `vllm bench serve
--max-concurrency C` feeds a server (random prompts of INPUT tokens, OUTPUT tokens each,
ignore_eos, greedy; a new request as soon as one finishes), every step timed and split by kind.

A step is a *prefill* step if it computes any prompt tokens (chunked prefill mixes decode rows
into it), else a *decode* step. For each kind: how many, their wall time in all and per step, and
within them the model's forward, the LM head and the rest of the runner's call (inputs, sampling,
outputs); then the engine's own Python between model calls (scheduling, detokenizing), and the
output throughput over the run. Each figure also in the engine thread's CPU time (a loaded
machine stretches wall time, the thread's CPU time less so; with two torch threads a barrier wait
counts as CPU time too).

    python benchmarks/wave_profile.py MODEL [--concurrency 32] [--prompts 64] [--input 256] [--output 128]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from tokenloom import LLM, SamplingParams


def timed(spent: dict[str, list[float]], name: str, function: Any) -> Any:
    """``function`` adding its wall and CPU time to ``spent[name]`` (the current step's)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals = spent.setdefault(name, [0.0, 0.0])
            totals[0] += time.perf_counter() - wall
            totals[1] += time.thread_time() - cpu

    return wrapper


def run_wave(llm: LLM, concurrency: int, prompts: int, input_len: int, output_len: int, seed: int) -> None:
    engine = llm.engine
    runner = engine.executor.worker.runner
    spent: dict[str, list[float]] = {}  # this step's
    per_step: list[dict[str, list[float]]] = []
    originals = (runner.model.forward, runner.model.compute_logits, runner.execute)
    runner.model.forward = timed(spent, "forward", runner.model.forward)
    runner.model.compute_logits = timed(spent, "head", runner.model.compute_logits)
    runner.execute = timed(spent, "execute", runner.execute)
    original_execute = runner.execute

    def execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # a decode row schedules one token; a prompt chunk more (no speculation here)
        prompt_tokens = sum(n for n in scheduler_output.num_scheduled_tokens.values() if n > 1)
        spent["prompt tokens"] = [float(prompt_tokens), 0.0]
        return original_execute(scheduler_output, *args, **kwargs)

    runner.execute = execute
    rng = random.Random(seed)  # a new seed per run: no prefix-cache hits
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        prompt = [rng.randint(100, 40000) for _ in range(input_len)]
        engine.add_request(f"r{submitted}", {"prompt_token_ids": prompt}, params)
        submitted += 1

    while submitted < min(concurrency, prompts):
        submit()
    steps: list[tuple[float, float]] = []
    generated = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        wall, cpu = time.perf_counter(), time.thread_time()
        spent.clear()
        outputs = engine.step()
        steps.append((time.perf_counter() - wall, time.thread_time() - cpu))
        per_step.append({name: list(totals) for name, totals in spent.items()})
        for output in outputs:
            if getattr(output, "finished", False):
                generated += sum(len(completion.token_ids) for completion in output.outputs)
                if submitted < prompts:
                    submit()
    elapsed = time.perf_counter() - started
    runner.model.forward, runner.model.compute_logits, runner.execute = originals  # the next run wraps its own
    prefill_tokens = [int(step.get("prompt tokens", (0.0, 0.0))[0]) for step in per_step]
    kinds = ["prefill" if tokens else "decode" for tokens in prefill_tokens]
    print(
        f"{prompts} requests, concurrency {concurrency}: {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tok/s"
    )
    for kind in ("prefill", "decode"):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if not rows:
            continue

        parts = []
        for index, clock in ((0, "wall"), (1, "cpu")):
            step_s = sum(steps[i][index] for i in rows)
            forward, head, execute_s = (
                sum(per_step[i].get(name, (0.0, 0.0))[index] for i in rows) for name in ("forward", "head", "execute")
            )
            parts.append(
                f"{clock} {step_s:.2f} s ({step_s / len(rows) * 1e3:.1f} ms/step): forward {forward:.2f}, head {head:.2f}, "
                f"runner's rest {execute_s - forward - head:.2f}, engine's Python {step_s - execute_s:.2f}"
            )
        tokens = sum(prefill_tokens[i] for i in rows)
        print(f"  {kind:7} {len(rows):4d} steps, {tokens} prompt tokens | " + " | ".join(parts))
    between = elapsed - sum(wall for wall, _ in steps)
    print(f"  outside steps (the benchmark's own loop): {between:.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1, help="runs on the same engine (the first warms it)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the engine's, one per core)")
    args = parser.parse_args()
    llm = LLM(model=args.model)
    if args.threads:  # after the engine: its platform sets the threads to the cores
        torch.set_num_threads(args.threads)
    for run in range(args.repeat):
        run_wave(llm, args.concurrency, args.prompts, args.input, args.output, seed=run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
