"""A GGUF file's 256-token prefill and its decode step at BATCH rows in the offline engine:
median milliseconds of a lone 256-token prompt's first step (the prefill, TTFT without the
server), then of the decode steps once BATCH such prompts run, and with ``--profile`` the
operators that took the prefill's time (torch.profiler, self CPU time).

  python benchmarks/prefill_and_step.py /work/peer/models/smollm2-1.7b-Q4_K_M.gguf [--batch 8]
      [--prefills 3] [--profile] [--cpu-time]

With ``--cpu-time`` (torch held to one thread, OMP_NUM_THREADS=1) the figures are the calling
thread's CPU time, which runs the whole step (the offline engine's one in-process worker): a
loaded machine stretches it far less than wall time. For an A/B of a kernel switch
(TOKENLOOM_CPU_AMX=0), alternate runs.

Random prompt tokens, greedy, ignore_eos; noisy on a shared machine (say so with the figures).
"""

import argparse
import random
import time

import torch

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu_native

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("model", help="a GGUF file")
parser.add_argument("--batch", type=int, default=8, help="rows of the decode steps timed")
parser.add_argument("--prompt-tokens", type=int, default=256)
parser.add_argument("--prefills", type=int, default=3, help="lone prefills timed (median)")
parser.add_argument("--profile", action="store_true", help="profile one more prefill, print its top operators")
parser.add_argument("--cpu-time", action="store_true", help="time the calling thread's CPU time (one torch thread)")
options = parser.parse_args()
if options.cpu_time and torch.get_num_threads() != 1:
    parser.error("--cpu-time measures one thread: run with OMP_NUM_THREADS=1")
clock = time.thread_time if options.cpu_time else time.perf_counter

started = time.perf_counter()
engine = LLM(model=options.model, max_model_len=1024).engine
print(f"kernel level {cpu_native.selected_level().name}, load {time.perf_counter() - started:.1f} s", flush=True)
random.seed(0)


def prompt() -> dict:
    return {"prompt_token_ids": [random.randint(100, 40000) for _ in range(options.prompt_tokens)]}


def prefill_ms(name: str) -> float:
    engine.add_request(name, prompt(), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    begun = clock()
    engine.step()
    spent = (clock() - begun) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return spent


prefill_ms("warm-up")
prefills = sorted(prefill_ms(f"prefill-{index}") for index in range(options.prefills))
print(f"{options.prompt_tokens}-token prefill: median {prefills[len(prefills) // 2]:.0f} ms {prefills}", flush=True)
if options.profile:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        prefill_ms("profiled")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
for index in range(options.batch):
    engine.add_request(f"row-{index}", prompt(), params)
steps = []
while engine.has_unfinished_requests():
    begun = clock()
    engine.step()
    steps.append((clock() - begun) * 1e3)
decode = sorted(steps[-16:])  # past the prefills: BATCH rows a step
print(f"decode step at {options.batch} rows: median {decode[len(decode) // 2]:.1f} ms of the last {len(decode)}")
