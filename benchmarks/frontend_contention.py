"""What a server front end costs the engine's decode step, and whether a process of its own
would help: batch-1 decode steps of the offline engine (SmolLM2, 256-token prompt) while a
stand-in front end runs WORK_MS of Python (JSON encoding) every PERIOD_MS in a thread of the
engine's process (sharing the GIL), in another process (sharing only the cores), or not at all.

  python benchmarks/frontend_contention.py thread|process|none WORK_MS PERIOD_MS
"""

import json
import multiprocessing
import random
import sys
import threading
import time

from tokenloom import LLM, SamplingParams


def front_end(stop, work_ms: float, period_ms: float) -> None:
    payload = {"choices": [{"delta": {"content": "hello world"}, "index": 0}] * 20}
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < work_ms / 1000:
            json.dumps(payload)
        time.sleep(period_ms / 1000)


def main() -> None:
    mode, work_ms, period_ms = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    sys.setswitchinterval(0.0005)  # as the server sets it
    engine = LLM(model="smollm2", max_model_len=1024).engine
    context = multiprocessing.get_context("spawn")
    stop = threading.Event() if mode != "process" else context.Event()
    if mode == "thread":
        threading.Thread(target=front_end, args=(stop, work_ms, period_ms), daemon=True).start()
    elif mode == "process":
        context.Process(target=front_end, args=(stop, work_ms, period_ms), daemon=True).start()
    elif mode != "none":
        raise SystemExit(f"unknown mode {mode!r}: thread, process or none")
    random.seed(0)
    for repeat in range(3):
        engine.add_request(
            f"r{repeat}",
            {"prompt_token_ids": [random.randint(100, 40000) for _ in range(256)]},
            SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
        )
        times = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        decode = sorted(times[10:])
        print(f"{mode}: median decode step {decode[len(decode) // 2] * 1000:.2f} ms", flush=True)
    stop.set()


if __name__ == "__main__":
    main()
