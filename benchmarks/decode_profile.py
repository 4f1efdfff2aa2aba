"""Where a decode step of a GGUF file goes, against the memory-bandwidth floor.

Runs the offline engine on FILE (REQUESTS random 256-token prompts, default one, greedy,
ignore_eos, TOKENS decode steps) and splits the median step into: the model's forward (the fused decode layers),
the LM head, sampling and output assembly, and the engine's Python before and after the model
call (scheduling, input preparation, detokenizing). Then it times every packed weight of the
layers alone on REQUESTS rows, in layer order, so that each weight comes from memory as in a step
(the model is far larger than the last-level cache), and reports each kernel kind's time, the
bytes it read and the rate against the read bandwidth measured here (memory_bandwidth.py's
method), plus the head and the attention operator.

    python benchmarks/decode_profile.py FILE [--tokens 64] [--passes 5] [--requests 8]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch
from memory_bandwidth import read_bandwidth

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu_native


def clock() -> float:
    """Seconds for the kernel timings: the thread's CPU time when torch runs one thread (a loaded
    machine's other processes stretch it less than wall time), else wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


KIND_NAMES = {400: "int4 (Q4_K)", 600: "int6 (Q6_K)", 800: "int8 (Q8_0)"}


def step_split(llm: LLM, tokens: int, requests: int = 1) -> dict[str, float]:
    """Median ms per decode step of each part, over the steps after the first 8: the step, the
    model's forward, the head, the rest of the runner's call (input preparation, sampling,
    outputs), and the gap from the end of one step's head to the start of the next forward (all
    the Python between two model calls: sampling, outputs, detokenizing, scheduling, inputs), in
    wall time and in the engine thread's CPU time ("gap cpu": the gap without other processes)."""
    engine = llm.engine
    runner = engine.executor.worker.runner
    spent: dict[str, list[float]] = collections.defaultdict(list)
    marks: list[tuple[str, float]] = []

    def marked(name: str, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            marks.append((name + " start", started, time.thread_time()))
            try:
                return function(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                marks.append((name + " end", ended, time.thread_time()))
                spent[name].append(ended - started)

        return wrapper

    runner.model.forward = marked("forward", runner.model.forward)
    runner.model.compute_logits = marked("head", runner.model.compute_logits)
    runner.execute = marked("execute", runner.execute)
    random.seed(0)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for index in range(requests):
        prompt = [random.randint(100, 40000) for _ in range(256)]
        engine.add_request(f"p{index}", {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    skip = 8  # the prefill steps and the first decode steps
    head_ends = [(wall, cpu) for name, wall, cpu in marks if name == "head end"]
    forward_starts = [(wall, cpu) for name, wall, cpu in marks if name == "forward start"]
    pairs = range(skip, min(len(head_ends), len(forward_starts) - 1))
    median = {name: statistics.median(values[skip:]) * 1e3 for name, values in spent.items()}
    median["step"] = statistics.median(steps[skip:]) * 1e3
    median["gap"] = statistics.median(forward_starts[i + 1][0] - head_ends[i][0] for i in pairs) * 1e3
    # the same in the engine thread's CPU time: what the gap costs on an idle machine
    median["gap cpu"] = statistics.median(forward_starts[i + 1][1] - head_ends[i][1] for i in pairs) * 1e3
    return median


def layer_weights(llm: LLM) -> list[tuple[torch.Tensor, int]]:
    """Every packed weight of every fused layer, in the order a step reads them."""
    model = llm.engine.executor.worker.runner.model
    found = []
    for module in model.modules():
        fused = getattr(module, "fused_decode", None)
        arguments = getattr(fused, "_arguments", None)
        if isinstance(arguments, tuple):
            weights, kinds, _ = arguments[4]
            found.extend(zip(weights, kinds))
    return found


def kernel_split(llm: LLM, passes: int, bandwidth: float, rows: int = 1) -> None:
    ops = cpu_native.load()
    weights = layer_weights(llm)
    if not weights:
        print("no fused decode layers found")
        return
    per_kind: dict[int, list[float]] = collections.defaultdict(lambda: [0.0] * passes)
    bytes_per_kind: dict[int, int] = collections.Counter()
    by_shape: dict[tuple[int, tuple[int, ...]], list[float]] = collections.defaultdict(lambda: [0.0] * passes)
    inputs = {}
    for weight, kind in weights:
        bytes_per_kind[kind] += weight.numel()
    for p in range(passes):
        for weight, kind in weights:
            k = weight_in_features(weight, kind)
            x = inputs.setdefault(k, torch.randn(rows, k, dtype=torch.bfloat16))
            started = clock()
            if kind // 100 == 4:
                ops.int4_linear(x, weight)
            elif kind // 100 == 6:
                ops.int6_linear(x, weight)
            elif kind // 100 == 5:
                ops.int5_linear(x, weight, kind % 100)
            else:
                ops.int8_linear(x, weight)
            took = clock() - started
            per_kind[kind][p] += took
            by_shape[(kind, (weight.shape[0] * 16, k))][p] += took
    total = 0.0
    for kind, times in per_kind.items():
        best = min(times) * 1e3
        total += best
        gbs = bytes_per_kind[kind] / (best / 1e3) / 1e9
        floor = bytes_per_kind[kind] / bandwidth * 1e3
        print(
            f"  {KIND_NAMES.get(kind, kind)}: {best:.1f} ms for {bytes_per_kind[kind] / 1e6:.0f} MB "
            f"= {gbs:.1f} GB/s (floor {floor:.1f} ms, {best / floor:.2f}x)"
        )
    for (kind, shape), times in sorted(by_shape.items()):
        print(f"    {KIND_NAMES.get(kind, kind)} {shape[0]}x{shape[1]}: {min(times) * 1e3:.2f} ms in all layers")
    print(f"  layer matmuls together: {total:.1f} ms")


def weight_in_features(weight: torch.Tensor, kind: int) -> int:
    bits = kind // 100
    per_group = {4: 320, 8: 576}.get(bits)
    if per_group is not None:  # [N / 16, G * group bytes] in pairs: row bytes are G * group bytes
        return weight.shape[1] // per_group * 32
    header = 32 if bits == 6 else 64
    groups = 8 if bits == 6 else kind % 100
    superblock = header + groups * (256 + (bits - 4) * 64 + 32)
    return weight.shape[1] // superblock * groups * 32


def head_split(llm: LLM, passes: int, bandwidth: float, rows: int = 1) -> None:
    model = llm.engine.executor.worker.runner.model
    head = model.lm_head
    weight = getattr(head.kernel_weight, "packed", None)
    hidden = torch.randn(rows, model.config.hidden_size, dtype=torch.bfloat16)
    times = []
    for _ in range(passes):
        torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)  # the head out of the cache
        started = clock()
        model.compute_logits(hidden)
        times.append(clock() - started)
    best = min(times) * 1e3
    if weight is not None:
        floor = weight.numel() / bandwidth * 1e3
        print(
            f"  LM head: {best:.2f} ms for {weight.numel() / 1e6:.0f} MB = {weight.numel() / best / 1e6:.1f} GB/s "
            f"(floor {floor:.2f} ms, {best / floor:.2f}x)"
        )
    else:
        print(f"  LM head: {best:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument(
        "--requests",
        type=int,
        default=1,
        help="concurrent requests: the decode steps' rows, and the rows each kernel is timed on",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the engine's, one per core)")
    args = parser.parse_args()
    llm = LLM(model=args.file, max_model_len=1024)
    if args.threads:  # after the engine: its platform sets the threads to the cores
        torch.set_num_threads(args.threads)
    buffer = torch.ones(2**30 // 4, dtype=torch.float32)
    bandwidth = read_bandwidth(buffer, 5) * 1e9
    del buffer
    print(f"read bandwidth ({torch.get_num_threads()} threads): {bandwidth / 1e9:.1f} GB/s")
    split = step_split(llm, args.tokens, args.requests)
    other = split["execute"] - split["forward"] - split["head"]
    print(
        f"step {split['step']:.1f} ms = forward {split['forward']:.1f} + head {split['head']:.1f} "
        f"+ the runner's inputs/sampling/outputs {other:.1f} + the engine's Python {split['step'] - split['execute']:.1f}; "
        f"from one step's head to the next forward {split['gap']:.2f} ms ({split['gap cpu']:.2f} ms CPU time)"
    )
    kernel_split(llm, args.passes, bandwidth, args.requests)
    head_split(llm, args.passes, bandwidth, args.requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
