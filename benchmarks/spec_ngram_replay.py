"""n-gram proposer settings compared without timing noise (issue 23): greedy decoding's tokens
do not depend on speculation, so the steps a setting takes can be replayed from recorded
outputs. ``record`` runs the offline engine once, without speculation, on the requests
``tokenloom bench serve`` sends (benchmarks/s10_sitting.sh: the rewrite workload with its test
request and warm-up first, and with ``random`` the random 256/128 c=1 workload, prefix caching
on as in the server). ``replay`` runs the built-in proposer over them as the scheduler would
(drafts capped by max_tokens) and counts decode steps, verify steps and accepted tokens; the
speed-up assumes a verify step costs ``1 + ROW_COST * drafts`` decode steps (0.078 from a
quiet 2-thread measurement, 5 rows 19.8 ms against 15.1 ms; see spec_verify_rows.py).
    python benchmarks/spec_ngram_replay.py record OUT.json [random]
    python benchmarks/spec_ngram_replay.py replay OUT.json [ROW_COST] K,MIN,MAX [K,MIN,MAX ...]
"""

import json
import statistics
import sys
from pathlib import Path

import numpy as np


def record(path: str, with_random: bool) -> None:
    from tokenloom import LLM, SamplingParams
    from tokenloom.api.bench.datasets import random_text_requests, sharegpt_requests

    llm = LLM(model="smollm2")
    tokenizer = llm.get_tokenizer()
    dataset = str(Path(__file__).parent / "spec_decode_rewrite.json")
    workloads = {}
    rewrite = sharegpt_requests(np.random.default_rng(0), dataset, tokenizer, 4)
    # the bench's test request and warm-up first: they fill the prefix cache as in the server
    workloads["rewrite"] = ([rewrite[0], rewrite[0], *rewrite], False, 2)
    if with_random:
        random_requests = random_text_requests(np.random.default_rng(0), tokenizer, 8, 256, 128)
        workloads["random"] = ([random_requests[0], random_requests[0], *random_requests], True, 2)
    recorded = {}
    for name, (requests, ignore_eos, num_unmeasured) in workloads.items():
        recorded[name] = []
        for index, request in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=request.expected_output_len, ignore_eos=ignore_eos)
            output = llm.generate([request.prompt], params)[0]
            if index >= num_unmeasured:
                recorded[name].append(
                    {
                        "prompt_ids": list(output.prompt_token_ids),
                        "output_ids": list(output.outputs[0].token_ids),
                        "max_tokens": request.expected_output_len,
                    }
                )
    Path(path).write_text(json.dumps(recorded))


def replay(path: str, row_cost: float, settings: list[tuple[int, int, int]]) -> None:
    from tokenloom.builtin_plugins.proposers.ngram import NgramProposer
    from tokenloom.core.config import EngineArgs, SpeculativeConfig
    from tokenloom.plugin_api import ProposerSpec

    recorded = json.loads(Path(path).read_text())
    for k, min_n, max_n in settings:
        speculative = SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n
        )
        proposer = NgramProposer(ProposerSpec(speculative, EngineArgs().create_engine_config(), model_info=None))
        line = f"k={k} lookup {min_n}-{max_n}:"
        for name, requests in recorded.items():
            decode_steps = verify_steps = accepted = 0
            cost_ratios = []
            for request in requests:
                prompt, output, max_tokens = request["prompt_ids"], request["output_ids"], request["max_tokens"]
                generated, cost = 1, 0.0  # the prefill sampled the first token
                while generated < len(output):
                    draft = proposer.lookup(prompt + output[:generated], k)[: max(0, max_tokens - generated - 1)]
                    if not draft:
                        decode_steps += 1
                        cost += 1
                        generated += 1
                        continue
                    matched = 0
                    while matched < len(draft) and generated + matched < len(output):
                        if draft[matched] != output[generated + matched]:
                            break
                        matched += 1
                    verify_steps += 1
                    accepted += matched
                    cost += 1 + row_cost * len(draft)
                    generated += matched + 1
                cost_ratios.append(cost / max(len(output) - 1, 1))
            # the bench's mean TPOT averages per request
            speedup = 1 / statistics.mean(cost_ratios)
            line += (
                f"  {name}: {decode_steps} decode + {verify_steps} verify steps, {accepted} accepted,"
                f" mean TPOT {speedup:.2f}x"
            )
        print(line)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "random")
    else:
        arguments = sys.argv[3:]
        row_cost = 0.078
        if arguments and "," not in arguments[0]:
            row_cost = float(arguments.pop(0))
        replay(sys.argv[2], row_cost, [tuple(int(part) for part in setting.split(",")) for setting in arguments])
