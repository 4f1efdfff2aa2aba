"""The 5- and 6-bit kernels (csrc/cpu_kquant.cpp) against the dense path the same GGUF layers took
before (Q6_K / Q5_K dequantized at load into the model dtype, oneDNN-packed), on the decode shapes
of a 1.7B model ([2048 -> 8192] gate/up, [8192 -> 2048] down, [2048 -> 2048] q/o, and with
``--shapes head`` its tied [2048 -> 49152] LM head, Q6_K in a Q4_K_M file), per batch size, with the
4- and 8-bit kernels beside them for scale. Random codes; median milliseconds per
matmul, each layer in several copies (more bytes than the caches hold) taken in turn, so the
weights come from memory as in a real step.

  int6   Q6_K through int6_linear          int5  Q5_K through int5_linear
  int4   Q4_K-like codes through int4_linear   int8  Q8_0 through int8_linear
  fp8    compressed-tensors FP8 (e4m3 codes, channel scales) through w8a16_linear
  w8a16  compressed-tensors W8A16 int8 (channel scales) through w8a16_linear
  dense  the dequantized weight in --dtype, oneDNN-packed (what Q6_K/Q5_K layers ran before)
  PATH:vnni  PATH with TOKENLOOM_CPU_AMX=0 during its calls: on a CPU with AMX-INT8, int4:vnni
             beside int4 is an A/B of int4_linear's AMX tile (from its row threshold) against
             its VNNI tile, alternated
  int4bf16, int6bf16, int5bf16  the same weights as int4 / int6 / int5 through the AMX-BF16
             prompt path (int4_linear_bf16, kquant_linear_bf16: bfloat16 panels, float32 sums;
             where bf16_amx_available())

  python benchmarks/kquant_layers.py 1,2,4,8,16,32 [--paths int6,int5,int4,int8,fp8,w8a16,dense,int4:vnni]
      [--shapes layers,head] [--rounds 15] [--copies 4]

The prompt path against the int8 one, on a 1.7B model's prefill shapes ([2048 -> 2048] q/o,
[2048 -> 16384] gate and up together, [8192 -> 2048] down), one thread's CPU time:

  python benchmarks/kquant_layers.py 16,64,256,2048 --paths int4,int4bf16,int6,int6bf16 \
      --shapes prefill --threads 1 --rounds 5 --copies 1

TOKENLOOM_CPU_ISA=avx2 (or benchmarks/avx2_host.sh) measures a lower kernel level. The paths are
measured alternately (one pass of each per round): the machine's drift hits them all alike.
"""

import argparse
import os
import time

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import int4_linear, int4_linear_bf16, pack_int4
from tokenloom.kernels.int8_matmul import int8_linear, pack_int8
from tokenloom.kernels.kquant_matmul import (
    dequantize_int6,
    kquant_linear,
    kquant_linear_bf16,
    pack_int5,
    pack_int6,
)
from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear
from tokenloom.kernels.w8a16_matmul import pack_w8, w8a16_linear

SHAPES = {  # (out, in)
    "layers": [(8192, 2048), (2048, 8192), (2048, 2048)],
    "head": [(49152, 2048)],
    "prefill": [(2048, 2048), (16384, 2048), (2048, 8192)],
}

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("rows", help="comma-separated batch sizes")
parser.add_argument("--paths", default="int6,int5,int4,int8,dense")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
parser.add_argument(
    "--shapes",
    default="layers",
    help="comma-separated: layers (the decoder's), head (the LM head), prefill (q/o, gate+up, down)",
)
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument(
    "--threads",
    type=int,
    default=0,
    help="torch threads (0: torch's default); 1 times the calling thread's CPU time, which a loaded machine disturbs less",
)
parser.add_argument("--copies", type=int, default=4, help="copies of each layer, taken in turn")
options = parser.parse_args()
dtype = getattr(torch, options.dtype)
paths = options.paths.split(",")
torch.manual_seed(0)
if options.threads:
    torch.set_num_threads(options.threads)
clock = time.thread_time if options.threads == 1 else time.perf_counter


def build(path: str, out_features: int, in_features: int):
    if path.endswith(":vnni"):
        matmul = build(path.removesuffix(":vnni"), out_features, in_features)
        return lambda x: without_amx(matmul, x)
    groups = in_features // 32
    prompt_path = path.endswith("bf16")
    path = path.removesuffix("bf16")
    if path == "int6" or path == "dense":
        codes = torch.randint(0, 64, (out_features, in_features), dtype=torch.uint8)
        scales = torch.randint(-128, 128, (out_features, in_features // 16)).to(torch.int8)
        d = (torch.rand(out_features, in_features // 256) * 0.001).half()
        if path == "dense":
            weight = dequantize_int6(codes, scales, d).to(dtype)
            packed = pack_weight(weight) if packable(weight) else weight
            return lambda x: packed_linear(x, packed) if packed.is_mkldnn else torch.nn.functional.linear(x, packed)
        weight = pack_int6(codes, scales, d)
        return (lambda x: kquant_linear_bf16(x, weight)) if prompt_path else (lambda x: kquant_linear(x, weight))
    if path == "int5":
        codes = torch.randint(0, 32, (out_features, in_features), dtype=torch.uint8)
        scales, mins = (torch.randint(0, 64, (out_features, groups), dtype=torch.uint8) for _ in "ab")
        d, dmin = ((torch.rand(out_features, groups // 8) * 0.001).half() for _ in "ab")
        weight = pack_int5(codes, scales, mins, d, dmin, 8)
        return (lambda x: kquant_linear_bf16(x, weight)) if prompt_path else (lambda x: kquant_linear(x, weight))
    if path in ("fp8", "w8a16"):
        if path == "fp8":
            codes = (torch.randn(out_features, in_features) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
        weight8 = pack_w8(codes, torch.rand(out_features, 1) * 0.01)
        return lambda x: w8a16_linear(x, weight8).to(x.dtype)
    if path == "int4":
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
        scales = (torch.rand(out_features, groups) * 0.02).half().float()
        weight = pack_int4(codes, scales, 8 * scales, torch.bfloat16)
        return (lambda x: int4_linear_bf16(x, weight)) if prompt_path else (lambda x: int4_linear(x, weight))
    codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    weight = pack_int8(codes, torch.rand(out_features, groups) * 0.01)
    return lambda x: int8_linear(x, weight).to(x.dtype)


def without_amx(matmul, x: torch.Tensor) -> torch.Tensor:
    previous = os.environ.get("TOKENLOOM_CPU_AMX")
    os.environ["TOKENLOOM_CPU_AMX"] = "0"
    try:
        return matmul(x)
    finally:
        if previous is None:
            del os.environ["TOKENLOOM_CPU_AMX"]
        else:
            os.environ["TOKENLOOM_CPU_AMX"] = previous


print(
    f"kernel level {cpu_native.selected_level().name}, activations {options.dtype}, {torch.get_num_threads()} threads, "
    f"median / best of {options.rounds} alternating rounds, ms per matmul "
    f"({'thread CPU time' if clock is time.thread_time else 'wall time'}; noisy: a shared machine)"
)
shapes = [shape for name in options.shapes.split(",") for shape in SHAPES[name]]
for out_features, in_features in shapes:
    layers = {path: [build(path, out_features, in_features) for _ in range(options.copies)] for path in paths}
    for rows in [int(size) for size in options.rows.split(",")]:
        x = torch.randn(rows, in_features).to(dtype)
        times: dict[str, list[float]] = {path: [] for path in paths}
        for round_index in range(options.rounds + 1):
            for path in paths:
                started = clock()
                for matmul in layers[path]:
                    matmul(x)
                if round_index:  # the first round warms up
                    times[path].append((clock() - started) / options.copies)
        ordered = {path: sorted(values) for path, values in times.items()}
        print(
            f"[{in_features:5d} -> {out_features:5d}] {rows:3d} rows: "
            + "  ".join(f"{path} {v[len(v) // 2] * 1e3:7.3f} / {v[0] * 1e3:7.3f}" for path, v in ordered.items()),
            flush=True,
        )
