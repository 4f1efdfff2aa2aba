"""What a verifying step costs against a decode step (issue 23), in the offline engine at c=1:
the rewrite prompt of spec_decode_rewrite.json, greedy, once without speculation and once per
NUM_SPECULATIVE_TOKENS with n-gram speculation. Per step kind (decode: one row; verify: a
request's k+1 rows): median step time and its parts (the model's forward, the LM head, the
rest: scheduling, sampling or rejection sampling, proposing, detokenizing).
    python benchmarks/spec_verify_steps.py [DTYPE] [K,K,...] [prefill]   (default: auto 4,8)
"prefill" also measures the verifying steps as they ran before issue 23's fix: the k + 1 rows as a
prefill chunk (the layers' Python path and prefill attention) instead of k + 1 decode rows.
"""

import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

from step_rows import record_step_rows, time_forward_and_logits

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import paged_attention

dtype = sys.argv[1] if len(sys.argv) > 1 else "auto"
ks = [int(k) for k in (sys.argv[2] if len(sys.argv) > 2 else "4,8").split(",")]
as_prefill = len(sys.argv) > 3 and sys.argv[3] == "prefill"
rewrite = json.loads((Path(__file__).parent / "spec_decode_rewrite.json").read_text())[0]
prompt = rewrite["conversations"][0]["value"]


def measure(label: str, **engine_args) -> None:
    llm = LLM(model="smollm2", dtype=dtype, max_model_len=1024, **engine_args)
    engine = llm.engine
    runner = engine.executor.worker.runner
    spent = time_forward_and_logits(runner)
    rows_seen = record_step_rows(runner)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    by_rows: dict[int, list[tuple[float, float, float]]] = {}
    tokens = 0
    for repeat in range(2):  # the first is the warm-up
        engine.add_request(f"{label}-{repeat}", prompt, params)
        steps = []
        while engine.has_unfinished_requests():
            spent.update(forward=0.0, logits=0.0)
            rows_seen.clear()
            started = time.perf_counter()
            for output in engine.step():
                if output.finished:
                    tokens = len(output.outputs[0].token_ids)
            total = time.perf_counter() - started
            if rows_seen:
                steps.append((rows_seen[0], total, spent["forward"], spent["logits"]))
        decode_time = sum(total for _, total, _, _ in steps[1:])
    for rows, total, forward, logits in steps[1:]:  # the prefill left out
        by_rows.setdefault(rows, []).append((total, forward, logits))
    print(
        f"{label}: {tokens} tokens, {len(steps) - 1} steps after the prefill, {decode_time / tokens * 1000:.2f} ms per token"
    )
    for rows, times in sorted(by_rows.items()):
        total, forward, logits = (statistics.median(column) * 1000 for column in zip(*times))
        print(
            f"  {rows} rows x{len(times)}: step {total:.1f} ms = forward {forward:.1f} + "
            f"lm head {logits:.1f} + rest {total - forward - logits:.1f}"
        )
    del llm


measure("plain")
for k in ks:
    speculative_config = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        # k drafts whenever lookup finds them: the step kinds stay those of a fixed k
        "adaptive_num_speculative_tokens": False,
    }
    measure(f"ngram k={k}", speculative_config=speculative_config)
    if as_prefill:
        with mock.patch.object(
            paged_attention,
            "_decode_like_seqs",
            lambda metadata: [index for index, query_len in enumerate(metadata.query_lens_cpu) if query_len == 1],
        ):
            measure(f"ngram k={k}, verified as a prefill", speculative_config=speculative_config)
