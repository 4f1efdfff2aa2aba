"""``tokenloom bench latency``: the time to generate one batch of random prompts end to end,
over repeated iterations, in this process (vLLM's ``bench latency``: its flags, its printout
and its JSON keys ``avg_latency``, ``latencies``, ``percentiles``)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenloom.api.bench.common import (
    LATENCY_PERCENTAGES,
    BenchParser,
    mean,
    non_negative_int,
    percentile,
    positive_int,
    write_json,
)
from tokenloom.api.bench.engine_flags import ENGINE_FLAGS_HELP, parse_engine_flags, print_help
from tokenloom.api.serve_help import help_request
from tokenloom.errors import ConfigError

COMMAND = "latency"
RANDOM_TOKEN_ID_LIMIT = 10000  # vLLM draws latency prompts from the first 10,000 token ids
PROFILE_DIR_ENV = "TOKENLOOM_TORCH_PROFILER_DIR"


def build_parser() -> BenchParser:
    parser = BenchParser(
        prog="tokenloom bench latency",
        description=(
            "Benchmark the latency of a single batch of requests: random token-id prompts, generated "
            "with ignore_eos so every iteration produces the same number of tokens."
        ),
        epilog=ENGINE_FLAGS_HELP.format(command=COMMAND),
    )
    parser.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=positive_int, default=128, help="generated tokens per request")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="requests in the batch")
    parser.add_argument("--n", type=positive_int, default=1, help="number of generated sequences per prompt")
    parser.add_argument(
        "--use-beam-search", action="store_true", help="time beam search (width --n) instead of sampling"
    )
    parser.add_argument(
        "--num-iters-warmup", type=non_negative_int, default=10, help="number of iterations to run for warmup"
    )
    parser.add_argument("--num-iters", type=positive_int, default=30, help="number of iterations to run")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the generation of a single batch with the torch profiler (after the warmup) instead of timing it",
    )
    parser.add_argument(
        "--profile-result-dir",
        default=None,
        help=f"where --profile writes its Chrome trace (unset: ${PROFILE_DIR_ENV}, else ./tokenloom_profile)",
    )
    parser.add_argument("--output-json", default=None, help="path to save the latency results in JSON format")
    parser.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="do not detokenize responses (leave detokenization out of the measured time)",
    )
    return parser


@dataclass
class LatencyResult:
    latencies: list[float]  # seconds per iteration

    def to_json(self) -> dict[str, Any]:
        """vLLM's keys; percentile keys are the percentages (JSON makes them strings)."""
        return {
            "avg_latency": mean(self.latencies),
            "latencies": list(self.latencies),
            "percentiles": {percent: percentile(self.latencies, percent) for percent in LATENCY_PERCENTAGES},
        }


def run(argv: list[str]) -> int:
    parser = build_parser()
    request = help_request(argv)
    if request is not None:
        return print_help(COMMAND, parser, request)
    options, rest = parser.parse_known_args(argv)
    # repeated identical batches would otherwise be served from the prefix cache (vLLM does the same)
    engine = parse_engine_flags(rest, COMMAND, parser, defaults={"enable_prefix_caching": False})
    for warning in engine.warnings:
        print(f"tokenloom bench latency: warning: {warning}", file=sys.stderr)

    from tokenloom import LLM

    llm = LLM(plugins=engine.plugins, **engine.engine_kwargs)
    needed = options.input_len + options.output_len
    if llm.engine.max_model_len < needed:
        raise ConfigError(
            f"--input-len {options.input_len} + --output-len {options.output_len} = {needed} tokens do "
            f"not fit the context length {llm.engine.max_model_len}; shorten them or raise "
            "--max-model-len",
            param="input-len",
        )
    prompts = random_prompts(llm, options.batch_size, options.input_len, seed=engine.engine_kwargs.get("seed", 0))
    generate = batch_generator(
        llm,
        prompts,
        n=options.n,
        output_len=options.output_len,
        detokenize=not options.disable_detokenize,
        beam_search=options.use_beam_search,
    )
    print(
        f"Benchmarking {llm.engine.model_name}: batch {options.batch_size}, {options.input_len} input and "
        f"{options.output_len} output tokens, n={options.n}"
    )

    from tqdm import tqdm

    print("Warming up...")
    for _ in tqdm(range(options.num_iters_warmup), desc="Warmup iterations"):
        generate()
    if options.profile:
        profile_dir = options.profile_result_dir or os.environ.get(PROFILE_DIR_ENV) or "./tokenloom_profile"
        print(f"Profiling (results will be saved to '{profile_dir}')...")
        trace_path, table = profile_once(generate, profile_dir)
        print(table)
        print(f"Chrome trace: {trace_path} (open it in https://ui.perfetto.dev or chrome://tracing)")
        return 0
    latencies = []
    for _ in tqdm(range(options.num_iters), desc="Profiling iterations"):
        latencies.append(time_once(generate))
    result = LatencyResult(latencies)
    print_result(result)
    if options.output_json:
        write_json(options.output_json, result.to_json())
    return 0


def random_prompts(llm: Any, batch_size: int, input_len: int, seed: int | None) -> list[dict[str, list[int]]]:
    """``batch_size`` prompts of ``input_len`` random token ids, as ``{"prompt_token_ids": ...}``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    limit = min(RANDOM_TOKEN_ID_LIMIT, llm.engine.model_info.vocab_size)
    token_ids = rng.integers(0, limit, (batch_size, input_len))
    return [{"prompt_token_ids": [int(token) for token in row]} for row in token_ids]


def batch_generator(
    llm: Any, prompts: list[Any], *, n: int, output_len: int, detokenize: bool, beam_search: bool = False
) -> Callable[[], list[Any]]:
    """A function generating the whole batch once, with vLLM's latency sampling settings (or beam
    search of width ``n``, as vLLM's --use-beam-search)."""
    from tokenloom import BeamSearchParams, SamplingParams

    if beam_search:
        beam_params = BeamSearchParams(beam_width=n, max_tokens=output_len, ignore_eos=True)
        return lambda: llm.beam_search(prompts, beam_params)

    params = SamplingParams(
        n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len, detokenize=detokenize
    )
    return lambda: llm.generate(prompts, params, use_tqdm=False)


def time_once(generate: Callable[[], Any]) -> float:
    started = time.perf_counter()
    generate()
    return time.perf_counter() - started


def profile_once(generate: Callable[[], Any], profile_dir: str) -> tuple[str, str]:
    """Run ``generate`` under the torch profiler (CPU activity, shapes recorded); write a Chrome
    trace into ``profile_dir`` and return its path and the top operators by self CPU time."""
    import torch

    os.makedirs(profile_dir, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        generate()
    trace_path = os.path.join(profile_dir, f"latency-{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json")
    profiler.export_chrome_trace(trace_path)
    return trace_path, profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def print_result(result: LatencyResult) -> None:
    print(f"Avg latency: {mean(result.latencies)} seconds")
    for percent in LATENCY_PERCENTAGES:
        print(f"{percent}% percentile latency: {percentile(result.latencies, percent)} seconds")
