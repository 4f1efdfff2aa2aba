"""LoRA on the token embedding and the LM head (PEFT's ``lora_embedding_A/B`` and a linear
``lm_head`` target) on the tiny random Llama, whose head is tied to its embedding: tokenloom's
greedy ids equal transformers + PEFT's, beside the weights and merged into them (merged into
an untied copy: merging into a tied weight would change both modules, and an adapter on one
must change that one only), and a batch mixing the base model and the adapters gives each
request what it gets alone."""

from __future__ import annotations

import pytest
import torch
from helpers.lora_adapters import peft_greedy, save_random_adapter

from tokenloom import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
MAX_TOKENS = 10

ADAPTERS = {
    # name: (rank, alpha, targets)
    "embed": (8, 16, ["embed_tokens"]),
    "head": (4, 8, ["lm_head"]),
    "embed-head-attn": (8, 8, ["embed_tokens", "lm_head", "q_proj", "v_proj"]),
}


def load_base(directory, *, untied=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if untied:
        # the head gets its own copy of the weight: merging into the embedding leaves it alone
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding-adapters")
    return {
        name: save_random_adapter(
            load_base(tiny_llama_dir), root / name, r=rank, alpha=alpha, targets=targets, seed=seed
        )
        for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=11)
    }


def greedy(llm, prompts, lora_request=None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    return [output.outputs[0].token_ids for output in llm.generate(inputs, params, lora_request=lora_request)]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, prompt_ids, lora_requests):
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    results = {None: greedy(llm, prompt_ids)}
    for name, request in lora_requests.items():
        results[name] = greedy(llm, prompt_ids, request)
    return results


def test_the_adapter_files_hold_embedding_and_head_weights(adapter_dirs):
    from safetensors.torch import load_file

    keys = set(load_file(f"{adapter_dirs['embed-head-attn']}/adapter_model.safetensors"))
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in keys
    assert "base_model.model.lm_head.lora_B.weight" in keys
    assert "base_model.model.model.embed_tokens.base_layer.weight" in keys  # PEFT saves the base too


@pytest.mark.parametrize("name", list(ADAPTERS))
@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_greedy_ids_equal_transformers_peft(tiny_llama_dir, adapter_dirs, prompt_ids, alone, name, merged):
    expected = peft_greedy(
        lambda: load_base(tiny_llama_dir, untied=merged), adapter_dirs[name], prompt_ids, MAX_TOKENS, merged=merged
    )
    assert alone[name] == expected
    assert alone[name] != alone[None]  # the adapter changes the output: the test can fail


def test_an_adapter_on_the_embedding_leaves_the_tied_head_alone(tiny_llama_dir, adapter_dirs, prompt_ids, alone):
    """Merged into the tied weight, the embedding's adapter would change the head as well: that
    model's ids differ from the ones tokenloom (and PEFT unmerged) give."""
    tied_merge = peft_greedy(
        lambda: load_base(tiny_llama_dir), adapter_dirs["embed"], prompt_ids, MAX_TOKENS, merged=True
    )
    assert tied_merge != alone["embed"]


@pytest.mark.parametrize(
    "engine_args", [{"max_loras": 3}, {"max_loras": 2, "max_num_batched_tokens": 8, "block_size": 4}]
)
def test_mixed_batch_gives_each_request_what_it_gets_alone(
    tiny_llama_dir, prompt_ids, lora_requests, alone, engine_args
):
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, **engine_args)
    prompts, requests, keys = [], [], []
    for index, ids in enumerate(prompt_ids):
        for name in [None, *lora_requests]:
            prompts.append(ids)
            requests.append(None if name is None else lora_requests[name])
            keys.append((name, index))
    for (name, index), got in zip(keys, greedy(llm, prompts, requests)):
        assert got == alone[name][index], (name, index)


def test_prompt_logprobs_use_the_adapters_head(tiny_llama_dir, lora_requests, prompt_ids):
    """Prompt logprobs go through the LM head too: the head adapter changes them, and they
    equal what transformers + PEFT compute."""
    from peft import PeftModel

    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": prompt_ids[0]}]
    request = lora_requests["head"]
    got = llm.generate(inputs, params, lora_request=request)[0].prompt_logprobs
    base = llm.generate(inputs, params)[0].prompt_logprobs
    model = PeftModel.from_pretrained(load_base(tiny_llama_dir), request.lora_path).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt_ids[0]])).logits[0].float(), dim=-1)
    ids = prompt_ids[0]
    for position in range(1, len(ids)):
        expected = logprobs[position - 1, ids[position]].item()
        assert got[position][ids[position]].logprob == pytest.approx(expected, abs=1e-4)
    assert got[1][ids[1]].logprob != pytest.approx(base[1][ids[1]].logprob, abs=1e-4)
