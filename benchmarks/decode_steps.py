"""Decode-step timing of the offline engine: DTYPE and comma-separated batch sizes, 256-token
random prompts, greedy, median of the last 40 decode steps.  python benchmarks/decode_steps.py bfloat16 1,8,32"""

import random
import sys
import time

from tokenloom import LLM, SamplingParams

dtype = sys.argv[1]
batches = [int(b) for b in sys.argv[2].split(",")]
t0 = time.perf_counter()
llm = LLM(model="smollm2", dtype=dtype, max_model_len=1024)
print("load", round(time.perf_counter() - t0, 2))
eng = llm.engine
for batch in batches:
    random.seed(0)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"{batch}-{i}", {"prompt_token_ids": [random.randint(100, 40000) for _ in range(256)]}, params)
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    dec = sorted(times[-40:])
    print(
        f"{dtype} batch {batch}: first step {times[0] * 1000:.0f} ms, median decode {dec[len(dec) // 2] * 1000:.1f} ms -> {batch / dec[len(dec) // 2]:.0f} tok/s"
    )
