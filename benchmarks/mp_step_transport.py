"""The mp executor's per-step transport: a step pickled once and written to a spawned worker's
pipe (the worker unpickles it and answers with one sampled token per request, pickled), for
a decode step of 1 and 32 sequences and a prefill of 4 x 512 tokens: bytes and round trip.
Run: python benchmarks/mp_step_transport.py"""

import multiprocessing as mp
import pickle
import statistics
import time

from tokenloom.core.batch import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenloom.core.sampling_params import SamplingParams


def echo(conn):
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        step = pickle.loads(data)[1][0]
        out = ModelRunnerOutput(sampled_token_ids={r: [123] for r in step.num_scheduled_tokens})
        conn.send_bytes(pickle.dumps(("ok", out), protocol=5))


def decode_step(n):
    return SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData(f"req-{i}", [], 300 + i) for i in range(n)],
        num_scheduled_tokens={f"req-{i}": 1 for i in range(n)},
    )


def prefill_step(n, length):
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                f"p-{i}", list(range(length)), [], SamplingParams(temperature=0.0), list(range(length // 16 + 1)), 0
            )
            for i in range(n)
        ],
        num_scheduled_tokens={f"p-{i}": length for i in range(n)},
    )


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=echo, args=(b,), daemon=True)
    p.start()
    b.close()
    for name, step in (
        ("decode 1 seq", decode_step(1)),
        ("decode 32 seqs", decode_step(32)),
        ("prefill 4x512", prefill_step(4, 512)),
    ):
        times = []
        for _ in range(300):
            t = time.perf_counter()
            data = pickle.dumps(("execute", (step,)), protocol=5)
            a.send_bytes(data)
            pickle.loads(a.recv_bytes())
            times.append(time.perf_counter() - t)
        print(
            f"{name}: {len(data)} bytes, median {statistics.median(times) * 1e6:.0f} us, p90 {sorted(times)[270] * 1e6:.0f} us"
        )
    a.close()
    p.join()
