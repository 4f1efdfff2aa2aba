"""Quantized checkpoints against transformers: a tiny random Llama to quantize, greedy tokens
with top-5 logprobs from transformers (on the weights dequantized) and from tokenloom, and
vLLM's ``check_logprobs_close`` comparison of the two."""

from __future__ import annotations

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
TOP_LOGPROBS = 5


def transformers_greedy(reference_dir: str):
    """Per prompt: (greedy tokens, per position {token: logprob} of the top 5), float32."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    model = LlamaForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    results = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        tops = []
        for scores in out.scores:
            logprobs = torch.log_softmax(scores[0].float(), dim=-1)
            values, indices = logprobs.topk(TOP_LOGPROBS)
            tops.append(dict(zip(indices.tolist(), values.tolist())))
        results.append((tokens, tops))
    return results


def tokenloom_greedy(llm):
    """The same from tokenloom's offline LLM."""
    from tokenloom import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP_LOGPROBS))
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tops = [{token: entry.logprob for token, entry in position.items()} for position in completion.logprobs]
        results.append((list(completion.token_ids), tops))
    return results


def check_logprobs_close(expected, actual):
    """vLLM's check: the greedy tokens agree until the first difference, where each side's token
    is among the other's top logprobs; after it the sequences may part."""
    for (tokens_a, tops_a), (tokens_b, tops_b) in zip(expected, actual):
        for position, (token_a, token_b) in enumerate(zip(tokens_a, tokens_b)):
            if token_a != token_b:
                assert token_a in tops_b[position] and token_b in tops_a[position], (position, tokens_a, tokens_b)
                break
