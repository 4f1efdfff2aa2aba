"""What act-order costs a GPTQ layer: SmolLM2's 30 layers of projections (qkv 960x576, o 576x576,
gate/up 3072x576, down 576x1536) as GPTQ 4-bit layers with groups of 128 (64 where 576 features
do not divide), random codes, loaded through the gptq plugin's method, per batch size: median
milliseconds of the rounds for

  sequential  g_idx in order (desc_act false): the int4 kernel on the activations as they are
  act-order   g_idx of a shuffled feature order (desc_act true): each call gathers the
              activations' columns in group order first (one index_select per layer)

  python benchmarks/grouped_int_layers.py 1,8,32 [--dtype bfloat16] [--rounds 7]

A GPTQ layer without act-order (and an AWQ layer) holds the same packed weight as a
compressed-tensors W4A16 one, so it runs at that speed (benchmarks/qlinear_layers.py). The two
variants are measured alternately, so a drift of the shared machine's speed hits both alike.
"""

import argparse
import time

import torch

from tokenloom.builtin_plugins.quantization.gptq import GPTQConfig
from tokenloom.kernels import cpu_native
from tokenloom.layers.linear import ReplicatedLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("rows", help="comma-separated batch sizes")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
parser.add_argument("--rounds", type=int, default=7)
options = parser.parse_args()
dtype = getattr(torch, options.dtype)
torch.manual_seed(0)


def gptq_layer(out_features: int, in_features: int, act_order: bool) -> ReplicatedLinear:
    group_size = 128 if in_features % 128 == 0 else 64
    groups = in_features // group_size
    config = GPTQConfig(bits=4, group_size=group_size, symmetric=False, zero_point_offset=0)
    layer = ReplicatedLinear(in_features, out_features, quant_method=config, params_dtype=dtype)
    layer._create_weights(config.get_method(layer, "layer", ("layer",)))
    g_idx = torch.arange(in_features) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features)]
    tensors = {
        "qweight": torch.randint(-(2**31), 2**31, (in_features // 8, out_features), dtype=torch.int32),
        "qzeros": torch.randint(-(2**31), 2**31, (groups, out_features // 8), dtype=torch.int32),
        "scales": (torch.rand(groups, out_features) * 0.02).half(),
        "g_idx": g_idx.to(torch.int32),
    }
    for name, tensor in tensors.items():
        layer.load_checkpoint_weight(name, tensor)
    layer.method.process_weights_after_loading(layer)
    return layer


variants = {
    name: [gptq_layer(*shape, act_order=name == "act-order") for _ in range(30) for shape in SHAPES]
    for name in ("sequential", "act-order")
}


def medians(rows: int) -> dict[str, float]:
    inputs = {features: torch.randn(rows, features).to(dtype) for features in (576, 1536)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(options.rounds + 1):
        for name, layers in variants.items():
            started = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.input_size])
            if round_index:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    return {name: sorted(values)[len(values) // 2] * 1e3 for name, values in times.items()}


print(
    f"kernel level {cpu_native.selected_level().name}, activations {options.dtype}, "
    f"{torch.get_num_threads()} threads, median of {options.rounds} alternating rounds (ms)"
)
for rows in [int(size) for size in options.rows.split(",")]:
    result = medians(rows)
    print(f"{rows:5d} rows, 30 layers: " + "  ".join(f"{name} {ms:8.2f}" for name, ms in result.items()), flush=True)
