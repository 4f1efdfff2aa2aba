"""Where a decode step of the offline engine goes: the model's forward, its LM head
(compute_logits) and the rest of the step (scheduling, sampling, detokenizing), mean over 40
steps after BATCH random 256-token prompts.  python benchmarks/decode_breakdown.py auto 1"""

import random
import sys
import time

from step_rows import time_forward_and_logits

from tokenloom import LLM, SamplingParams

dtype, batch = sys.argv[1], int(sys.argv[2])
engine = LLM(model="smollm2", dtype=dtype, max_model_len=1024).engine
runner = engine.executor.worker.runner
spent = time_forward_and_logits(runner)
random.seed(0)
params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
for i in range(batch):
    engine.add_request(f"r{i}", {"prompt_token_ids": [random.randint(100, 40000) for _ in range(256)]}, params)
for _ in range(10):
    engine.step()
spent.update(forward=0.0, logits=0.0)
steps = 40
started = time.perf_counter()
for _ in range(steps):
    engine.step()
total = (time.perf_counter() - started) / steps * 1e3
forward, logits = spent["forward"] / steps * 1e3, spent["logits"] / steps * 1e3
print(
    f"{dtype} batch {batch}: step {total:.1f} ms = forward {forward:.1f} "
    f"+ LM head {logits:.1f} + the rest {total - forward - logits:.1f}"
)
