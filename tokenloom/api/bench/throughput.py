"""``tokenloom bench throughput``: offline throughput, in this process, over many prompts
submitted at once (vLLM's ``bench throughput``: its flags, its printout and its JSON keys
``elapsed_time``, ``num_requests``, ``total_num_tokens``, ``requests_per_second``,
``tokens_per_second``, plus the output-token figures)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from tokenloom.api.bench.common import BenchParser, non_negative_int, positive_int, ratio, write_json
from tokenloom.api.bench.datasets import SampleRequest, allowed_token_ids, random_token_requests, sharegpt_requests
from tokenloom.api.bench.engine_flags import ENGINE_FLAGS_HELP, parse_engine_flags, print_help
from tokenloom.api.serve_help import help_request
from tokenloom.errors import ConfigError

COMMAND = "throughput"


def build_parser() -> BenchParser:
    parser = BenchParser(
        prog="tokenloom bench throughput",
        description=("Benchmark offline throughput: every prompt is submitted at once and the engine batches them."),
        epilog=ENGINE_FLAGS_HELP.format(command=COMMAND),
    )
    parser.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt"),
        default=None,
        help="random token-id prompts, or a ShareGPT-format JSON file (--dataset-path); unset: "
        "sharegpt with --dataset-path, else random",
    )
    parser.add_argument(
        "--dataset-path", "--dataset", dest="dataset_path", default=None, help="path to a ShareGPT-format JSON file"
    )
    parser.add_argument(
        "--input-len", type=positive_int, default=None, help="prompt tokens per request (random dataset: required)"
    )
    parser.add_argument(
        "--output-len",
        type=positive_int,
        default=None,
        help="generated tokens per request (random: default 128; sharegpt: overrides the reply length)",
    )
    parser.add_argument("--n", type=positive_int, default=1, help="number of generated sequences per prompt")
    parser.add_argument("--num-prompts", type=positive_int, default=1000, help="number of prompts to process")
    parser.add_argument(
        "--prefix-len",
        type=non_negative_int,
        default=0,
        help="random dataset: a shared random prefix of this many tokens before each prompt",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=ratio,
        default=0.0,
        help="random dataset: draw lengths uniformly from [len*(1-r), len*(1+r)]",
    )
    parser.add_argument("--output-json", default=None, help="path to save the throughput results in JSON format")
    parser.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="do not detokenize responses (leave detokenization out of the measured time)",
    )
    return parser


@dataclass
class ThroughputResult:
    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "elapsed_time": self.elapsed_time,
            "num_requests": self.num_requests,
            "total_num_tokens": self.total_num_tokens,
            "requests_per_second": self.num_requests / self.elapsed_time,
            "tokens_per_second": self.total_num_tokens / self.elapsed_time,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "output_tokens_per_second": self.total_output_tokens / self.elapsed_time,
        }


def run(argv: list[str]) -> int:
    parser = build_parser()
    request = help_request(argv)
    if request is not None:
        return print_help(COMMAND, parser, request)
    options, rest = parser.parse_known_args(argv)
    dataset_name = options.dataset_name or ("sharegpt" if options.dataset_path else "random")
    if dataset_name == "random" and options.input_len is None:
        raise ConfigError(
            "the random dataset needs --input-len (and optionally --output-len, default 128)", param="input-len"
        )
    if dataset_name == "sharegpt" and not options.dataset_path:
        raise ConfigError(
            "--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)", param="dataset-path"
        )
    engine = parse_engine_flags(rest, COMMAND, parser)
    for warning in engine.warnings:
        print(f"tokenloom bench throughput: warning: {warning}", file=sys.stderr)

    import numpy as np

    from tokenloom import LLM

    llm = LLM(plugins=engine.plugins, **engine.engine_kwargs)
    rng = np.random.default_rng(engine.engine_kwargs.get("seed", 0))
    max_model_len = llm.engine.max_model_len
    if dataset_name == "random":
        output_len = options.output_len or 128
        longest = (
            options.prefix_len
            + int(np.ceil(options.input_len * (1 + options.random_range_ratio)))
            + int(np.ceil(output_len * (1 + options.random_range_ratio)))
        )
        if longest > max_model_len:
            raise ConfigError(
                f"requests of up to {longest} tokens (prefix, input and output) do not fit the context "
                f"length {max_model_len}; shorten them or raise --max-model-len",
                param="input-len",
            )
        allowed = allowed_token_ids(llm.get_tokenizer(), llm.engine.model_info.vocab_size)
        requests = random_token_requests(
            rng,
            options.num_prompts,
            options.input_len,
            output_len,
            allowed,
            range_ratio=options.random_range_ratio,
            prefix_len=options.prefix_len,
        )
    else:
        if llm.get_tokenizer() is None:
            raise ConfigError(
                "the sharegpt dataset needs the tokenizer: remove --skip-tokenizer-init", param="skip-tokenizer-init"
            )
        requests = sharegpt_requests(
            rng,
            options.dataset_path,
            llm.get_tokenizer(),
            options.num_prompts,
            output_len=options.output_len,
            max_model_len=max_model_len,
        )
    result = measure_throughput(llm, requests, n=options.n, detokenize=not options.disable_detokenize)
    print_result(result)
    if options.output_json:
        write_json(options.output_json, result.to_json())
    return 0


def measure_throughput(
    llm: Any, requests: list[SampleRequest], *, n: int = 1, detokenize: bool = True, use_tqdm: bool = True
) -> ThroughputResult:
    """Generate every request at once (vLLM's sampling settings: temperature 1, ignore_eos) and
    count the tokens the engine actually took in and produced."""
    from tokenloom import SamplingParams

    prompts = [
        {"prompt_token_ids": request.prompt} if isinstance(request.prompt, list) else request.prompt
        for request in requests
    ]
    params = [
        SamplingParams(
            n=n,
            temperature=1.0,
            top_p=1.0,
            ignore_eos=True,
            max_tokens=request.expected_output_len,
            detokenize=detokenize,
        )
        for request in requests
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - started
    return ThroughputResult(
        elapsed_time=elapsed,
        num_requests=len(outputs),
        total_prompt_tokens=sum(len(output.prompt_token_ids) for output in outputs),
        total_output_tokens=sum(len(completion.token_ids) for output in outputs for completion in output.outputs),
    )


def print_result(result: ThroughputResult) -> None:
    figures = result.to_json()
    print(
        f"Throughput: {figures['requests_per_second']:.2f} requests/s, {figures['tokens_per_second']:.2f} total "
        f"tokens/s, {figures['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result.total_prompt_tokens}")
    print(f"Total num output tokens:  {result.total_output_tokens}")
