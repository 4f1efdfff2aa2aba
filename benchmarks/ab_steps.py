"""A/B of one CPU optimisation inside one process: two offline engines (MODEL, default SmolLM2;
default dtype) serve the same BATCH random 256-token prompts and are stepped alternately, so both
see the same machine; prints the median decode step of each (and their first, prefill, steps).

  python benchmarks/ab_steps.py packed|attention|layer-ops|int4|stack 1,8,32 [MODEL]

MODEL is what `tokenloom serve` takes (a GGUF path: the benchmark set's 1.7B file, say).

packed: linear weights and LM head oneDNN-packed (default) vs dense F.linear; attention: the
native decode-attention backend vs the torch one; layer-ops: the fused RMSNorm / rotary /
gated-activation operators vs their torch code (both engines on native attention); int4: the
4-bit layers on tokenloom's int4 kernel vs torch's; stack: a decode step's layers in one
``decode_layers`` call vs one ``decode_layer`` call each.
"""

import contextlib
import random
import statistics
import sys
import time
from unittest import mock

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import int4_matmul
from tokenloom.kernels.paged_attention import TorchPagedAttention
from tokenloom.layers import activation, embedding, fused_decode, layernorm, quantization, rotary

variant, batches = sys.argv[1], [int(size) for size in sys.argv[2].split(",")]
model = sys.argv[3] if len(sys.argv) > 3 else "smollm2"
construction, during_steps = contextlib.nullcontext(), contextlib.nullcontext
if variant == "packed":
    construction = contextlib.ExitStack()
    for module in (quantization, embedding):
        construction.enter_context(mock.patch.object(module, "packable", lambda weight: False))
elif variant == "layer-ops":

    def during_steps():
        stack = contextlib.ExitStack()
        for module in (layernorm, activation, rotary):
            stack.enter_context(mock.patch.object(module, "ops_for", lambda tensor: None))
        return stack
elif variant == "int4":
    construction = mock.patch.object(int4_matmul, "_native_kernel", lambda: None)
elif variant == "stack":

    def during_steps():
        return mock.patch.object(fused_decode.FusedDecodeStack, "__call__", lambda *args: None)
elif variant != "attention":
    raise SystemExit(f"unknown variant {variant!r}: packed, attention, layer-ops, int4 or stack")

optimised = LLM(model=model, max_model_len=1024).engine
with construction:
    baseline = LLM(model=model, max_model_len=1024).engine
if variant == "attention":
    baseline.executor.worker.runner.attention_backend = TorchPagedAttention()
engines = {"without": (baseline, during_steps), "with": (optimised, contextlib.nullcontext)}

for batch in batches:
    decode = {name: [] for name in engines}
    first_steps = {name: 0.0 for name in engines}
    for engine, _ in engines.values():
        random.seed(0)
        for index in range(batch):
            prompt = [random.randint(100, 40000) for _ in range(256)]
            engine.add_request(
                f"{batch}-{index}",
                {"prompt_token_ids": prompt},
                SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
            )
    step = 0
    while any(engine.has_unfinished_requests() for engine, _ in engines.values()):
        for name, (engine, context) in engines.items():
            if not engine.has_unfinished_requests():
                continue
            with context():
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
            if step < 2:
                first_steps[name] += elapsed
            elif step >= 6:
                decode[name].append(elapsed)
        step += 1
    print(
        f"{variant} batch {batch}: "
        + "  ".join(
            f"{name}: decode {statistics.median(times) * 1e3:.1f} ms (first two steps {first_steps[name] * 1e3:.0f} ms)"
            for name, times in decode.items()
        )
    )
