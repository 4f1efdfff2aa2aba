"""Adaptive draft lengths against fixed ones (issue 23), offline, c=1, greedy: mean TPOT on the
rewrite workload (the requests of benchmarks/spec_rewrite_steps.py: the bench's raw prompts from
benchmarks/spec_decode_rewrite.json, the first run twice unmeasured before the four measured
ones) and on the random one (``tokenloom bench serve``'s random 256-token prompts, 128 tokens,
ignore_eos), for plain decoding and n-gram speculation (lookup 1-4) at k = 4, 6, 8 with
``adaptive_num_speculative_tokens`` off and on. The machine is shared and its speed drifts, so
the configurations run in rounds, alternating their order (forward, then backward), each on a
fresh engine; compare within a round.
    python benchmarks/spec_adaptive_length.py [ROUNDS] [K ...]
(TOKENLOOM_CPU_ISA=avx2 for the AVX2 path; ROUNDS 2 and K 4 6 8 by default). On a machine
others load, pin it to one core (``taskset -c 1 python ...``: the CPU platform then runs one
thread); two OpenMP threads on two busy cores wait on each other at every barrier (2.8 s a step
instead of 60 ms on 2026-11-26 at a load average of 10).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tokenloom import LLM, SamplingParams
from tokenloom.api.bench.datasets import random_text_requests, sharegpt_requests

DATASET = str(Path(__file__).parent / "spec_decode_rewrite.json")
NUM_RANDOM_PROMPTS = 4
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
ks = [int(arg) for arg in sys.argv[2:]] or [4, 6, 8]


def ngram(k: int, adaptive: bool) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "adaptive_num_speculative_tokens": adaptive,
    }


configs: list[tuple[str, dict | None]] = [("plain", None)]
for k in ks:
    configs += [(f"k{k}", ngram(k, False)), (f"k{k}-adaptive", ngram(k, True))]


def run(engine, requests, params_of, measured_from: int) -> tuple[float, int, int, int]:
    """Runs the requests one at a time; returns the measured ones' mean TPOT (s), and the
    verifying steps, draft tokens and accepted tokens they took."""
    tpots = []
    before = engine.stats().spec_decoding
    start_counts = (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens) if before else (0, 0, 0)
    for index, request in enumerate(requests):
        if index == measured_from:
            before = engine.stats().spec_decoding
            start_counts = (
                (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens) if before else (0, 0, 0)
            )
        engine.add_request(f"r{index}", request.prompt, params_of(request))
        num_tokens = 0
        first_token_at = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for output in outputs:
                num_tokens = len(output.outputs[0].token_ids)
            if first_token_at is None and num_tokens:
                first_token_at = time.perf_counter()
        if index >= measured_from:
            tpots.append((time.perf_counter() - first_token_at) / max(num_tokens - 1, 1))
    after = engine.stats().spec_decoding
    end_counts = (after.num_drafts, after.num_draft_tokens, after.num_accepted_tokens) if after else (0, 0, 0)
    verifies, drafted, accepted = (end - start for end, start in zip(end_counts, start_counts))
    return statistics.mean(tpots), verifies, drafted, accepted


def measure(label: str, speculative_config: dict | None) -> dict[str, tuple]:
    extra = {} if speculative_config is None else {"speculative_config": speculative_config}
    llm = LLM(model="smollm2", **extra)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    rewrite = sharegpt_requests(np.random.default_rng(0), DATASET, tokenizer, 4)
    results = {
        "rewrite": run(
            engine,
            [rewrite[0], rewrite[0], *rewrite],
            lambda request: SamplingParams(temperature=0, max_tokens=request.expected_output_len),
            measured_from=2,
        ),
        "random": run(
            engine,
            random_text_requests(np.random.default_rng(0), tokenizer, NUM_RANDOM_PROMPTS, 256, 128),
            lambda request: SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
            measured_from=0,
        ),
    }
    del llm
    for workload, (tpot, verifies, drafted, accepted) in results.items():
        rate = f", {drafted} drafted in {verifies} verifies, {accepted} accepted" if verifies else ""
        print(f"  {label:12s} {workload:8s} TPOT {tpot * 1000:6.2f} ms{rate}", flush=True)
    return results


table: dict[str, dict[str, list[float]]] = {}
for round_index in range(rounds):
    order = configs if round_index % 2 == 0 else configs[::-1]
    print(f"round {round_index + 1}", flush=True)
    for label, config in order:
        for workload, (tpot, *_) in measure(label, config).items():
            table.setdefault(label, {}).setdefault(workload, []).append(tpot)

print("\nmean TPOT ms per round, and the speed-up over plain in the same round")
for label, _ in configs:
    cells = []
    for workload in ("rewrite", "random"):
        tpots = table[label][workload]
        plain = table["plain"][workload]
        cells.append(
            f"{workload} " + " / ".join(f"{tpot * 1000:.2f} ({base / tpot:.2f}x)" for tpot, base in zip(tpots, plain))
        )
    print(f"{label:12s} " + "   ".join(cells))
print(json.dumps({label: {w: [round(t * 1000, 2) for t in v] for w, v in row.items()} for label, row in table.items()}))
