"""What a verifying step of r rows costs against a one-row decode step, measured so that a
shared machine's changing load hits every row count alike (issue 23): one greedy request whose
proposer is replaced by one that drafts 0, 1, ..., K tokens in turn (tokens that are then
rejected, so the context grows by one token a step), and the median wall time of each row count
over many interleaved steps (or their CPU time, see CLOCK). Its ratios feed the choice of num_speculative_tokens.
    python benchmarks/spec_verify_rows.py [K] [STEPS_PER_ROW_COUNT]   (default: 8 40)
"""

import itertools
import os
import statistics
import sys
import time

from step_rows import record_step_rows

from tokenloom import LLM, SamplingParams
from tokenloom.core.spec_decode.proposer import Draft

# CLOCK=cpu: the process's CPU time instead of wall time (run it pinned to one core, e.g.
# taskset -c 0, so that one torch thread does all the work and no spinning thread is counted)
clock = time.process_time if os.environ.get("CLOCK") == "cpu" else time.perf_counter
max_drafts = int(sys.argv[1]) if len(sys.argv) > 1 else 8
steps_per_count = int(sys.argv[2]) if len(sys.argv) > 2 else 40
# fixed lengths: the adaptive ones would shorten these always-rejected drafts to one token
speculative_config = {"method": "ngram", "num_speculative_tokens": max_drafts, "adaptive_num_speculative_tokens": False}
llm = LLM(model="smollm2", max_model_len=2048, speculative_config=speculative_config, enable_prefix_caching=False)
engine = llm.engine
runner = engine.executor.worker.runner
draft_lengths = itertools.cycle(range(max_drafts + 1))


def propose(requests):
    # token 0 is never the greedy continuation of this prompt: every draft is rejected
    return [Draft([0] * next(draft_lengths)) for _ in requests]


runner.proposer.propose = propose
rows_seen = record_step_rows(runner)
prompt = "Write a long story about a lighthouse keeper and the sea."
num_steps = steps_per_count * (max_drafts + 1) + 8
engine.add_request("rows", prompt, SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True))
times: dict[int, list[float]] = {}
step = 0
while engine.has_unfinished_requests():
    rows_seen.clear()
    started = clock()
    engine.step()
    elapsed = clock() - started
    step += 1
    if step > 8 and len(rows_seen) == 1:  # the prefill and a few warm-up steps left out
        times.setdefault(rows_seen[0], []).append(elapsed)
decode = statistics.median(times[1])
for rows, values in sorted(times.items()):
    median = statistics.median(values)
    print(f"{rows} rows x{len(values)}: median {median * 1000:.1f} ms = {median / decode:.2f} decode steps")
