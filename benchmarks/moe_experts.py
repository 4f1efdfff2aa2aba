"""The experts of one mixture-of-experts layer, op level: tokenloom's ``moe_experts`` operator (every
routed expert in one parallel loop, csrc/cpu_moe.cpp) against a Python loop over the experts a
batch routes to, on an OLMoE-like shape (64 experts, top-8, hidden 2048, expert intermediate 1024),
at 1 and 8 tokens: float32 experts (the loop: torch's matmuls, fused_experts_reference) and 4-bit
experts (the loop: int4_linear per expert, the same tile routine). Median of repeated calls, the
torch threads the process has; the CPU kernel level is printed (TOKENLOOM_CPU_ISA forces a lower one).

    python benchmarks/moe_experts.py
"""

from __future__ import annotations

import time

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import int4_linear, pack_int4
from tokenloom.layers.activation import SiluAndMul
from tokenloom.layers.fused_moe import fused_experts, fused_experts_reference, route

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 64, 8, 2048, 1024


def median_ms(function, *args, repeats: int = 20) -> float:
    for _ in range(3):
        function(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def random_int4(rows: int, columns: int):
    codes = torch.randint(0, 16, (rows, columns), dtype=torch.uint8)
    return codes, torch.rand(rows, columns // 32) * 0.01, torch.zeros(rows, columns // 32)


def main() -> None:
    ops = cpu_native.load()
    if ops is None:
        raise SystemExit("the CPU kernels are not available")
    level = cpu_native.selected_level()
    print(
        f"kernel level {level.name}, {torch.get_num_threads()} threads; {EXPERTS} experts, top-{TOP_K}, "
        f"hidden {HIDDEN}, expert intermediate {INTERMEDIATE}"
    )
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.02
    gate_up_int4 = [pack_int4(*random_int4(2 * INTERMEDIATE, HIDDEN), torch.bfloat16) for _ in range(EXPERTS)]
    down_int4 = [pack_int4(*random_int4(HIDDEN, INTERMEDIATE), torch.bfloat16) for _ in range(EXPERTS)]
    w13_int4 = torch.stack([weight.packed for weight in gate_up_int4])
    w2_int4 = torch.stack([weight.packed for weight in down_int4])
    act = SiluAndMul()

    def int4_loop(x, weights, ids):
        out = torch.zeros(x.shape[0], HIDDEN)
        for expert in ids.unique().tolist():
            tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
            hidden = act(int4_linear(x[tokens], gate_up_int4[expert]))
            out.index_add_(0, tokens, int4_linear(hidden, down_int4[expert]) * weights[tokens, slots].unsqueeze(-1))
        return out

    for num_tokens in (1, 8):
        x = torch.randn(num_tokens, HIDDEN)
        weights, ids = route(torch.randn(num_tokens, EXPERTS), TOP_K, renormalize=False)
        batch = (x, weights, ids)
        rows = {
            "float32": (
                lambda x, weights, ids: fused_experts(x, weights, ids, w13, w2, "silu", ops),
                lambda x, weights, ids: fused_experts_reference(x, weights, ids, w13, w2, act),
            ),
            "int4": (
                lambda x, weights, ids: fused_experts(x, weights, ids, w13_int4, w2_int4, "silu", ops),
                int4_loop,
            ),
        }
        for kind, (fused, loop) in rows.items():
            fused_ms, loop_ms = median_ms(fused, *batch), median_ms(loop, *batch)
            print(
                f"M={num_tokens} ({ids.unique().numel()} experts used), {kind}: moe_experts {fused_ms:.2f} ms, "
                f"Python loop over experts {loop_ms:.2f} ms ({loop_ms / fused_ms:.2f}x)"
            )


if __name__ == "__main__":
    main()
