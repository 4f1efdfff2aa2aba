"""Where n-gram speculation's time goes on the rewrite workload (issue 23), in the offline engine
at c=1, greedy, with the requests ``tokenloom bench serve`` sends for it (benchmarks/s10_sitting.sh):
the same four prompts in the same order (``--seed 0``), raw to /v1/completions (no chat
template), max_tokens = the reference answer's length, stopping at EOS; the first prompt runs
twice before them (the bench's test request and ``--num-warmups 1``), which matters: with prefix
caching its third run's greedy text differs (the cached prompt's last token is computed alone).
Per request: decode steps (one row) and verify steps (k + 1 rows), tokens accepted per verify;
then the median time per step kind and the workload's mean TPOT (as the bench averages it).
    python benchmarks/spec_rewrite_steps.py [SPECULATIVE_CONFIG_JSON ...]
(default: plain, then the n-gram settings of benchmarks/s10_sitting.sh)
"""

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from step_rows import record_step_rows

from tokenloom import LLM, SamplingParams
from tokenloom.api.bench.datasets import sharegpt_requests

DATASET = str(Path(__file__).parent / "spec_decode_rewrite.json")
configs = [json.loads(arg) for arg in sys.argv[1:]] or [
    None,
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
]


def measure(speculative_config) -> None:
    label = "plain" if speculative_config is None else json.dumps(speculative_config)
    extra = {} if speculative_config is None else {"speculative_config": speculative_config}
    llm = LLM(model="smollm2", **extra)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    runner = engine.executor.worker.runner
    rows_seen = record_step_rows(runner)
    requests = sharegpt_requests(np.random.default_rng(0), DATASET, tokenizer, 4)
    total_tokens = 0
    total_time = 0.0
    tpots: list[float] = []
    step_times: dict[str, list[float]] = {"decode": [], "verify": []}
    accepted: list[int] = []
    # the bench's test request and warm-up (not measured), then the four measured ones
    for index, request in enumerate([requests[0], requests[0], *requests]):
        measured = index >= 2
        engine.add_request(
            f"r{index}", request.prompt, SamplingParams(temperature=0, max_tokens=request.expected_output_len)
        )
        counts = {"decode": 0, "verify": 0}
        accepted_here: list[int] = []
        num_tokens = 0
        first_token_at = None
        while engine.has_unfinished_requests():
            rows_seen.clear()
            started = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - started
            new_tokens = 0
            for output in outputs:
                new_tokens = len(output.outputs[0].token_ids) - num_tokens
                num_tokens = len(output.outputs[0].token_ids)
            if first_token_at is None:
                first_token_at = time.perf_counter()
                continue  # the prefill
            if not rows_seen:
                continue
            kind = "decode" if rows_seen[0] == 1 else "verify"
            counts[kind] += 1
            if measured:
                step_times[kind].append(elapsed)
            if kind == "verify":
                accepted_here.append(new_tokens - 1)
        decode_time = time.perf_counter() - first_token_at
        if measured:
            total_tokens += num_tokens - 1
            total_time += decode_time
            tpots.append(decode_time / max(num_tokens - 1, 1))
            accepted.extend(accepted_here)
            print(
                f"  request {index - 2}: {num_tokens} tokens, {counts['decode']} decode + {counts['verify']} verify steps, "
                f"accepted per verify {accepted_here}, TPOT {decode_time / max(num_tokens - 1, 1) * 1000:.2f} ms"
            )
    parts = ", ".join(
        f"{kind} x{len(times)} median {statistics.median(times) * 1000:.1f} ms"
        for kind, times in step_times.items()
        if times
    )
    mean_accepted = f", {statistics.mean(accepted):.2f} accepted per verify" if accepted else ""
    print(
        f"{label}: mean TPOT {statistics.mean(tpots) * 1000:.2f} ms ({total_tokens} tokens in "
        f"{total_time:.2f} s after the first); {parts}{mean_accepted}"
    )
    del llm


for config in configs:
    measure(config)
