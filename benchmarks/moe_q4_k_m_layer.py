"""One Q4_K_M mixture-of-experts layer on an OLMoE-1B-7B shape (64 experts, top-8, hidden 2048,
expert intermediate 1024; Q4_K gate and up, Q6_K down, as llama-quantize writes half of its
layers), op level: the experts' load (the file's blocks packed by the native ``gguf_pack_int4`` vs the
torch packers), a step's experts at 1 and 8 tokens (each projection in its own packed kind vs
the dense bfloat16 experts such a layer held before), and a prefill chunk's at 256 and 2048 tokens
(process CPU time). Random blocks with small scales; median of
repeated calls, alternating, the torch threads the process has; the CPU kernel level is printed.

    python benchmarks/moe_q4_k_m_layer.py
"""

from __future__ import annotations

import time

import torch

from tokenloom.builtin_plugins.quantization.gguf_blocks import GGML_TYPES, Q4_K, Q6_K, GGUFWeight
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups, pack_native
from tokenloom.builtin_plugins.quantization.gguf_kquant import pack_kquant
from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import pack_int4
from tokenloom.layers.fused_moe import fused_experts, route

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 64, 8, 2048, 1024


def random_blocks(ggml_type: int, rows: int, columns: int) -> GGUFWeight:
    _, block_values, block_bytes = GGML_TYPES[ggml_type]
    count = rows * columns // block_values
    data = torch.randint(0, 256, (count, block_bytes), dtype=torch.uint8)
    scale = (torch.rand(count, 2) * 1e-3).half().view(torch.uint8)
    if ggml_type == Q6_K:
        data[:, -2:] = scale[:, :2]
    else:
        data[:, :4] = scale
    return GGUFWeight(data.view(rows, -1), ggml_type, torch.Size((rows, columns)))


def seconds(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def torch_pack(weight: GGUFWeight):
    return pack_int4(*int4_groups(weight), torch.bfloat16) if weight.ggml_type == Q4_K else pack_kquant([weight])


def main() -> None:
    ops = cpu_native.load()
    if ops is None:
        raise SystemExit("the CPU kernels are not available")
    print(f"kernel level {cpu_native.selected_level().name}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    gate_up = random_blocks(Q4_K, EXPERTS * 2 * INTERMEDIATE, HIDDEN)
    down = random_blocks(Q6_K, EXPERTS * HIDDEN, INTERMEDIATE)
    eight = 8 * 2 * INTERMEDIATE  # the torch packers on 8 experts' gate+up (the layer packs 8 at a time)
    part = GGUFWeight(gate_up.data[:eight], Q4_K, torch.Size((eight, HIDDEN)))
    torch_s = seconds(torch_pack, part) * EXPERTS / 8
    native_s = seconds(pack_native, [part], torch.bfloat16) * EXPERTS / 8
    print(
        f"load, one layer's Q4_K gate+up ({gate_up.data.numel() / 2**20:.0f} MiB): torch packers {torch_s:.2f} s, "
        f"gguf_pack_int4 {native_s:.2f} s"
    )
    w13 = pack_native([gate_up], torch.bfloat16).packed.view(EXPERTS, 2 * INTERMEDIATE // 16, -1)
    w2 = pack_kquant([down]).packed.view(EXPERTS, HIDDEN // 16, -1)
    dense13 = gate_up.dequantize(torch.bfloat16).view(EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    dense2 = down.dequantize(torch.bfloat16).view(EXPERTS, HIDDEN, INTERMEDIATE)
    for tokens in (1, 8):
        x = torch.randn(tokens, HIDDEN).bfloat16()
        weights, ids = route(torch.randn(tokens, EXPERTS), TOP_K, renormalize=False)
        packed_ms, dense_ms = [], []
        for _ in range(15):  # alternating
            packed_ms.append(seconds(fused_experts, x, weights, ids, w13, w2, "silu", ops, ((4, 8), (6, 8))) * 1e3)
            dense_ms.append(seconds(fused_experts, x, weights, ids, dense13, dense2, "silu", ops) * 1e3)
        packed, dense = sorted(packed_ms)[7], sorted(dense_ms)[7]
        print(f"M={tokens}: Q4_K+Q6_K packed {packed:.2f} ms, dense bfloat16 {dense:.2f} ms ({dense / packed:.2f}x)")
    for tokens in (
        256,
        2048,
    ):  # a prefill chunk: 32 and 256 rows per expert; process CPU time (the machine may be shared)
        x = torch.randn(tokens, HIDDEN).bfloat16()
        weights, ids = route(torch.randn(tokens, EXPERTS), TOP_K, renormalize=False)
        cpu_ms = []
        for _ in range(5):
            start = time.process_time()
            fused_experts(x, weights, ids, w13, w2, "silu", ops, ((4, 8), (6, 8)))
            cpu_ms.append((time.process_time() - start) * 1e3)
        print(f"M={tokens}: Q4_K+Q6_K packed, CPU time {sorted(cpu_ms)[2]:.0f} ms")


if __name__ == "__main__":
    main()
