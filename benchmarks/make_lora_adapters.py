"""Random PEFT LoRA adapters with SmolLM2-135M's shapes, for the LoRA cost benchmark
(docs/lora.md, "Measuring its cost"): rank 16 on every projection, a non-zero B.

    python benchmarks/make_lora_adapters.py /tmp/adapters 4      # -> /tmp/adapters/a1 .. a4

The base weights don't matter to the cost (PEFT only needs the module names and shapes), so the
adapters are made on a randomly initialised model of SmolLM2-135M's configuration.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers.lora_adapters import ALL_PROJECTIONS, save_random_adapter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("count", type=int)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    for index in range(1, args.count + 1):
        path = save_random_adapter(
            base,
            args.directory / f"a{index}",
            r=args.rank,
            alpha=2 * args.rank,
            targets=ALL_PROJECTIONS,
            seed=index,
            scale=0.02,
        )
        print(path)


if __name__ == "__main__":
    main()
