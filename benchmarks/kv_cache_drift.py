"""Greedy drift of an fp8 KV cache from the 16-bit one, on SmolLM2-135M-Instruct (the served model):
each prompt's greedy continuation (chat template, temperature 0, ignore_eos) under every
--kv-cache-dtype given, compared token by token with the first one (the 16-bit cache).

Reports, per cache type: the fraction of generated tokens equal to the 16-bit run at the same
position, how many prompts never diverge, and where the others first diverge (the tokens after a
divergence follow a different text, so the first position is the figure that says most).

    python benchmarks/kv_cache_drift.py [--prompts 32] [--tokens 128] [--caches auto,fp8,fp8_e5m2,fp8+calc]

``+calc`` adds --calculate-kv-scales. The figures are in docs/design.md ("An 8-bit KV cache").
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

from tokenloom import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What is 17 times 23? Show your work.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "What are the health benefits of regular exercise?",
    "Describe how a rainbow forms.",
    "Translate 'Good morning, how are you?' into Spanish and French.",
    "List five animals that live in the Arctic and one fact about each.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "How does a bicycle stay upright when it moves?",
    "Suggest a name for a coffee shop and explain why.",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat who loves to code.",
    "Explain what a black hole is in simple terms.",
    "Give a recipe for a simple tomato pasta sauce.",
    "How do vaccines work?",
    "What is machine learning? Answer in three sentences.",
    "Describe the water cycle step by step.",
    "Write a short story opening about a lighthouse keeper.",
    "What are prime numbers? Give the first ten.",
    "How can I improve my sleep?",
    "Explain the rules of chess for the knight piece.",
    "What was the Renaissance?",
    "Write a thank-you note to a teacher.",
    "Compare cats and dogs as pets.",
    "How does the internet work, briefly?",
    "What should I pack for a weekend hiking trip?",
]


def greedy(cache: str, prompts: list[str], num_tokens: int) -> list[list[int]]:
    cache_dtype, _, calculate = cache.partition("+")
    llm = LLM(model="smollm2", max_model_len=1024, cache_dtype=cache_dtype, calculate_kv_scales=calculate == "calc")
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": prompt}] for prompt in prompts], params, use_tqdm=False)
    print(f"{cache}: generated in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    tokens = [output.outputs[0].token_ids for output in outputs]
    del llm
    gc.collect()
    return tokens


def first_divergence(tokens: list[int], baseline: list[int]) -> int | None:
    return next((position for position, (a, b) in enumerate(zip(tokens, baseline)) if a != b), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of the built-in prompts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--caches", default="auto,fp8,fp8_e5m2,fp8+calc,fp8_e5m2+calc")
    args = parser.parse_args()
    caches = args.caches.split(",")
    prompts = PROMPTS[: args.prompts]
    runs = {cache: greedy(cache, prompts, args.tokens) for cache in caches}
    baseline = runs[caches[0]]
    print(f"{len(prompts)} prompts x {args.tokens} greedy tokens, against --kv-cache-dtype {caches[0]}")
    for cache in caches[1:]:
        same = sum(a == b for run, base in zip(runs[cache], baseline) for a, b in zip(run, base))
        divergences = [first_divergence(run, base) for run, base in zip(runs[cache], baseline)]
        diverged = sorted(position for position in divergences if position is not None)
        summary = (
            f"where they diverge: first at token {diverged[0]}, median {statistics.median(diverged):g}"
            if diverged
            else "no divergence"
        )
        print(
            f"{cache:>16}: {same / (len(prompts) * args.tokens):6.1%} identical tokens, "
            f"{len(prompts) - len(diverged)}/{len(prompts)} prompts identical throughout; {summary}"
        )


if __name__ == "__main__":
    main()
