"""SmolLM2's 30 layers of projections (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536)
with random 4-bit weights, as one decode or prefill step multiplies them, per batch size: median
milliseconds of the rounds, weights read from memory as in a real step. The paths:

  tokenloom  tokenloom's int4 kernel at the selected CPU kernel level (TOKENLOOM_CPU_ISA=avx2
             forces the AVX2 build on an AVX-512 host)
  torch      torch's weight-only int4 kernel (aten._weight_int4pack_mm_for_cpu), what a layer
             falls back to without tokenloom's kernels
  dense      the dequantized weight, oneDNN-packed, in --dtype (the other fallback)

With --head, also SmolLM2's 49152x576 Q8_0 LM head: tokenloom's int8 kernel against the float16
copy a float32 head keeps for small batches (torch.nn.functional.linear) and the packed dense head.

  python benchmarks/qlinear_layers.py 1,8,32,256 [--paths tokenloom,torch,dense] [--dtype float32]
                                                 [--rounds 7] [--head]

The paths are measured alternately (one pass of each per round), so a drift of the shared
machine's speed hits them all alike. For an A/B of two versions of the kernel, run it alternately
from each checkout (PYTHONPATH=CHECKOUT), a few times.
"""

import argparse
import time
from unittest import mock

import torch

from tokenloom.kernels import cpu_native, int4_matmul
from tokenloom.kernels.int4_matmul import dequantize_int4, int4_linear, pack_int4
from tokenloom.kernels.int8_matmul import dequantize_int8, int8_linear, pack_int8
from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("rows", help="comma-separated batch sizes")
parser.add_argument("--paths", default="tokenloom,torch,dense")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
parser.add_argument("--rounds", type=int, default=7)
parser.add_argument("--head", action="store_true")
options = parser.parse_args()
dtype = getattr(torch, options.dtype)
paths = options.paths.split(",")
torch.manual_seed(0)


def dense_matmul(weight: torch.Tensor):
    if packable(weight):
        packed = pack_weight(weight)
        return lambda x: packed_linear(x, packed)
    return lambda x: torch.nn.functional.linear(x, weight)


layers = {path: [] for path in paths}
for _ in range(30):
    for out_features, in_features in SHAPES:
        groups = in_features // 32
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
        scales = (torch.rand(out_features, groups) * 0.02).half().float()
        zeros = (torch.randn(out_features, groups) * 0.05).half().float() + 8 * scales
        if "tokenloom" in paths:
            weight = pack_int4(codes, scales, zeros, torch.bfloat16)
            assert weight.kernel is not None, "tokenloom's kernels did not load"
            layers["tokenloom"].append((in_features, lambda x, weight=weight: int4_linear(x, weight)))
        if "torch" in paths:
            with mock.patch.object(int4_matmul, "_native_kernel", lambda: None):
                weight = pack_int4(codes, scales, zeros, torch.bfloat16)
            layers["torch"].append((in_features, lambda x, weight=weight: int4_linear(x, weight)))
        if "dense" in paths:
            layers["dense"].append((in_features, dense_matmul(dequantize_int4(codes, scales, zeros).to(dtype))))

heads = {}
if options.head:
    codes = torch.randint(-128, 128, HEAD, dtype=torch.int8)
    scales = torch.rand(HEAD[0], HEAD[1] // 32) * 0.01
    head_weight = pack_int8(codes, scales)
    heads["int8"] = lambda x: int8_linear(x, head_weight)
    half = dequantize_int8(codes, scales).half()
    heads["float16"] = lambda x: torch.nn.functional.linear(x.half(), half).float()
    heads["dense"] = dense_matmul(dequantize_int8(codes, scales).to(dtype))


def medians(rows: int, passes: dict) -> dict[str, float]:
    inputs = {features: torch.randn(rows, features).to(dtype) for features in (576, 1536)}
    for one_pass in passes.values():  # warm-up
        one_pass(inputs)
    times = {name: [] for name in passes}
    for _ in range(options.rounds):
        for name, one_pass in passes.items():
            started = time.perf_counter()
            one_pass(inputs)
            times[name].append(time.perf_counter() - started)
    return {name: sorted(values)[len(values) // 2] * 1e3 for name, values in times.items()}


def layer_pass(path):
    def one_pass(inputs):
        for features, matmul in layers[path]:
            matmul(inputs[features])

    return one_pass


level = cpu_native.selected_level().name if "tokenloom" in paths or heads else "-"
print(
    f"kernel level {level}, activations {options.dtype}, {torch.get_num_threads()} threads, "
    f"median of {options.rounds} alternating rounds (ms)"
)
for rows in [int(size) for size in options.rows.split(",")]:
    result = medians(rows, {path: layer_pass(path) for path in paths})
    line = f"{rows:5d} rows, 30 layers: " + "  ".join(f"{path} {ms:8.2f}" for path, ms in result.items())
    if heads:
        head_result = medians(
            rows, {name: (lambda inputs, head=head: head(inputs[576])) for name, head in heads.items()}
        )
        line += "  | head: " + "  ".join(f"{name} {ms:7.2f}" for name, ms in head_result.items())
    print(line, flush=True)
