"""The LoRA work of one decode step, op level: tokenloom's native BGMV (``lora_bgmv_``) against
the torch path (each used slot's tokens through its own A and B: two matmuls per slot) over SmolLM2-135M's 30 layers
of projections (rank 16, bfloat16, 4 slots), at 1 and 32 tokens, one thread.

    OMP_NUM_THREADS=1 python benchmarks/lora_bgmv_ops.py
"""

from __future__ import annotations

import time

import torch

from tokenloom.kernels import cpu_native
from tokenloom.lora.layers import LinearLoRA, LoRABatchState

NUM_LAYERS = 30
RANK = 16
# SmolLM2-135M: qkv 576 -> 576+192+192, o 576 -> 576, gate_up 576 -> 2x1536, down 1536 -> 576
PROJECTIONS = [
    (576, [(0, 576), (576, 192), (768, 192)]),
    (576, [(0, 576)]),
    (576, [(0, 1536), (1536, 1536)]),
    (1536, [(0, 576)]),
]


def median_ms(function, repeats: int = 30) -> float:
    for _ in range(5):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def measure(ops, num_tokens: int, num_adapters: int) -> None:
    state = LoRABatchState(4, RANK, torch.bfloat16)
    layers = []
    for input_size, shards in PROJECTIONS:
        output_size = sum(size for _, size in shards)
        lora = LinearLoRA(input_size, output_size, shards, state)
        for slot in range(4):
            for shard_index, (_, size) in enumerate(shards):
                lora.set_slot(slot, shard_index, torch.randn(RANK, input_size) * 0.02, torch.randn(size, RANK) * 0.02)
        x = torch.randn(num_tokens, input_size).bfloat16()
        layers.append((lora, x, torch.randn(num_tokens, output_size).bfloat16()))
    state.set_batch([token % num_adapters for token in range(num_tokens)])

    def native() -> None:
        for lora, x, output in layers:
            ops.lora_bgmv_(output, x, lora.lora_a, lora.lora_b_t, state.token_slots, lora.shard_table, RANK)

    def torch_path() -> None:
        for lora, x, output in layers:
            _ = lora.add_delta_torch(x, output)

    native_ms, torch_ms = median_ms(native) * NUM_LAYERS, median_ms(torch_path) * NUM_LAYERS
    print(
        f"tokens={num_tokens:3d} adapters={num_adapters}: LoRA work of a {NUM_LAYERS}-layer step: "
        f"native {native_ms:.2f} ms, torch {torch_ms:.2f} ms"
    )


def main() -> None:
    ops = cpu_native.load()
    if ops is None:
        raise SystemExit("tokenloom's CPU kernels are off or did not build")
    print(f"CPU kernel level: {cpu_native.selected_level().name}, {torch.get_num_threads()} thread(s)")
    for num_tokens, num_adapters in [(1, 1), (32, 1), (32, 4)]:
        measure(ops, num_tokens, num_adapters)


if __name__ == "__main__":
    main()
