"""Time to first token with the SharedStorageConnector (issue 39): cold, warm in RAM (the local
prefix cache) and warm from disk (a new engine on the same directory), for prompts of 1k, 4k
and 8k tokens on SmolLM2-135M (the packaged Q4_1 GGUF, float32 activations and KV cache).

    python benchmarks/kv_connector_ttft.py [--sizes 1024 4096 8000] [--store DIR] [--repeats 3]

TTFT is the wall time of ``generate`` with ``max_tokens=1`` (one request, nothing else running).
Cold runs on an engine whose store is empty; warm-in-RAM repeats the prompt on that engine;
warm-from-disk builds a second engine on the same directory (after the first one's saves are
flushed) and sends each prompt once. Prompts are random token ids, one per size, so no size
shares a prefix with another. Prints one Markdown table row per size.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import tempfile
import time

from tokenloom import LLM, SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine(store: str) -> LLM:
    return LLM(
        "smollm2",
        # the built-in connectors' module, named so that an install from before its entry point
        # finds them too (a module already loaded by its entry point is not loaded twice)
        plugins=["tokenloom.builtin_plugins.kv_connectors"],
        dtype="float32",
        max_model_len=8192,
        kv_transfer_config={
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": store},
        },
    )


def ttft(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([prompt], ONE_TOKEN)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8000])
    parser.add_argument("--store", help="the store directory (default: a new temporary one, removed after)")
    parser.add_argument("--repeats", type=int, default=3, help="warm-in-RAM runs per size (the best is kept)")
    args = parser.parse_args()
    store = args.store or tempfile.mkdtemp(prefix="tokenloom-kv-bench-")
    rng = random.Random(0)
    prompts = {size: [rng.randrange(100, 40000) for _ in range(size)] for size in args.sizes}
    try:
        writer = engine(store)
        cold = {size: ttft(writer, prompt) for size, prompt in prompts.items()}
        in_ram = {size: min(ttft(writer, prompt) for _ in range(args.repeats)) for size, prompt in prompts.items()}
        worker_connector = writer.engine.executor.worker.kv_connector
        worker_connector.wait_for_save()
        writer.engine.executor.shutdown()
        del writer
        gc.collect()
        reader = engine(store)
        from_disk = {size: ttft(reader, prompt) for size, prompt in prompts.items()}
        stats = reader.engine.stats().kv_connector
        print("| prompt tokens | cold | warm in RAM | warm from disk | from disk / cold |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for size in args.sizes:
            print(
                f"| {size} | {cold[size] * 1e3:.0f} ms | {in_ram[size] * 1e3:.0f} ms | "
                f"{from_disk[size] * 1e3:.0f} ms | {from_disk[size] / cold[size]:.2f} |"
            )
        print(
            f"\nloaded {stats.num_blocks_loaded} blocks, {stats.num_bytes_loaded / 2**20:.0f} MiB, "
            f"in {stats.load_seconds:.2f} s of loader time; {stats.num_load_failures} failures"
        )
    finally:
        if not args.store:
            shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
