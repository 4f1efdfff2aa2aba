"""Relative cost of LoRA in decode steps, offline (no server): SmolLM2-135M Q4_1 GGUF at
--dtype auto on this host's CPU kernel level, an --enable-lora engine with rank-16 adapters on
every projection. Decode time per step is the difference between generating ``--tokens`` and
1 token (the prefill cancels out), for the base model and with adapters, at c=1 and c=32.

    python benchmarks/make_lora_adapters.py /tmp/adapters 4
    python benchmarks/lora_decode_steps.py /tmp/adapters [--repeats 3]

A microbenchmark for ratios (base vs adapters in the same process, interleaved); the serving
figures come from benchmarks/lora_and_spec_sitting.sh.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", type=pathlib.Path)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    from tokenloom import LLM, LoRARequest, SamplingParams
    from tokenloom.kernels import cpu_native

    llm = LLM(model="smollm2", max_model_len=512, enable_lora=True, max_loras=4, max_lora_rank=16)
    adapters = [LoRARequest(f"a{index}", index, str(args.adapters / f"a{index}")) for index in range(1, 5)]
    prompt = list(range(1000, 1064))  # 64 tokens, different per row below

    def step_time(concurrency: int, loras: list) -> float:
        prompts = [{"prompt_token_ids": [token + row for token in prompt]} for row in range(concurrency)]
        requests = [loras[row % len(loras)] if loras else None for row in range(concurrency)]

        def run(max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
            return time.perf_counter() - start

        return (run(args.tokens) - run(1)) / (args.tokens - 1)

    print(f"CPU kernel level: {cpu_native.selected_level().name}")
    for concurrency in args.concurrency:
        cases = {"base": [], "1 adapter": adapters[:1], "4 adapters": adapters}
        step_time(concurrency, adapters)  # warm: adapters loaded into their slots
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, loras in cases.items():
                times[name].append(step_time(concurrency, loras))
        base = statistics.median(times["base"])
        for name, values in times.items():
            step = statistics.median(values)
            print(
                f"c={concurrency:<3} {name:<11} step {step * 1e3:7.2f} ms  {concurrency / step:7.1f} tok/s  "
                f"x{step / base:.2f} of base"
            )


if __name__ == "__main__":
    main()
