"""LoRA adapters through the offline API on a tiny random Llama: greedy ids equal
transformers + PEFT's (adapter beside the weights and merged into them) for adapters of
different ranks, targets and scalings (rsLoRA); a batch mixing the base model and three
adapters gives each request what it gets alone, also with fewer slots than adapters, under
prefix caching and in chunked prefill; bad adapters are refused naming what does not fit."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.lora_adapters import ALL_PROJECTIONS, peft_greedy, save_random_adapter

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.errors import InvalidRequestError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
MAX_TOKENS = 10

ADAPTERS = {
    # name: (rank, alpha, targets, rsLoRA, safetensors)
    "all-r8": (8, 16, ALL_PROJECTIONS, False, True),
    "attn-r4-rslora": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], True, True),
    "mlp-r16-bin": (16, 8, ["gate_proj", "up_proj", "down_proj"], False, False),
}


def load_base(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    base = load_base(tiny_llama_dir)
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, (rank, alpha, targets, rslora, safe)) in enumerate(ADAPTERS.items()):
        dirs[name] = save_random_adapter(
            base, root / name, r=rank, alpha=alpha, targets=targets, seed=seed + 1, use_rslora=rslora, safe=safe
        )
    return dirs


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16)


def greedy(llm, prompts, lora_request=None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    return [output.outputs[0].token_ids for output in llm.generate(inputs, params, lora_request=lora_request)]


@pytest.fixture(scope="module")
def alone(llm, prompt_ids, lora_requests):
    """Each adapter's (and the base model's) greedy ids, one adapter per generate call."""
    results = {None: greedy(llm, prompt_ids)}
    for name, request in lora_requests.items():
        results[name] = greedy(llm, prompt_ids, request)
    return results


@pytest.mark.parametrize("name", list(ADAPTERS))
@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_greedy_ids_equal_transformers_peft(tiny_llama_dir, adapter_dirs, prompt_ids, alone, name, merged):
    expected = peft_greedy(lambda: load_base(tiny_llama_dir), adapter_dirs[name], prompt_ids, MAX_TOKENS, merged=merged)
    assert alone[name] == expected
    assert alone[name] != alone[None]  # the adapter changes the output: the test can fail


def test_base_model_unchanged_by_enable_lora(tiny_llama_dir, prompt_ids, alone):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    expected = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        expected.append(out[0, len(ids) :].tolist())
    assert alone[None] == expected


def mixed_batch(prompt_ids, lora_requests):
    """Every prompt with the base model and with each adapter, interleaved in one list."""
    prompts, requests, keys = [], [], []
    for index, ids in enumerate(prompt_ids):
        for name in [None, *lora_requests]:
            prompts.append(ids)
            requests.append(None if name is None else lora_requests[name])
            keys.append((name, index))
    return prompts, requests, keys


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_loras": 4},
        # two slots for three adapters: the scheduler holds requests back, slots are reused
        {"max_loras": 2, "max_cpu_loras": 2},
        # one slot, a 4-token budget: chunked prefills of different adapters share steps with decodes
        {"max_loras": 1, "max_num_batched_tokens": 4, "block_size": 4},
        {"max_loras": 3, "enable_prefix_caching": True, "block_size": 4},
    ],
    ids=["4-slots", "2-slots", "1-slot-chunked", "prefix-caching"],
)
def test_mixed_batch_gives_each_request_what_it_gets_alone(
    tiny_llama_dir, prompt_ids, lora_requests, alone, engine_args
):
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=16, **engine_args)
    prompts, requests, keys = mixed_batch(prompt_ids, lora_requests)
    tokens = greedy(llm, prompts, requests)
    for (name, index), got in zip(keys, tokens):
        assert got == alone[name][index], (name, index)
    if engine_args.get("enable_prefix_caching"):
        # the same prompt again: hits only its own adapter's blocks, so the ids stay right
        assert greedy(llm, prompts, requests) == tokens
        assert llm.engine.stats().prefix_cache_hits > 0
    manager = llm.engine.executor.worker.runner.lora_manager
    assert len(manager.cached_lora_ids) <= max(engine_args.get("max_cpu_loras") or 0, engine_args["max_loras"])
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.num_blocks


def test_adapter_slots_follow_lru(tiny_llama_dir, prompt_ids, lora_requests, alone):
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    manager = llm.engine.executor.worker.runner.lora_manager
    names = list(lora_requests)
    for name in names:
        assert greedy(llm, prompt_ids[:1], lora_requests[name]) == alone[name][:1]
    # three adapters through two slots and a CPU cache of two: the first left both
    assert set(manager.slot_lora_ids) == {lora_requests[names[1]].lora_int_id, lora_requests[names[2]].lora_int_id}
    assert manager.cached_lora_ids == [lora_requests[names[1]].lora_int_id, lora_requests[names[2]].lora_int_id]
    assert greedy(llm, prompt_ids[:1], lora_requests[names[0]]) == alone[names[0]][:1]


def test_lora_dtype_sets_the_adapter_weights_dtype(tiny_llama_dir, prompt_ids, lora_requests, alone):
    """--lora-dtype bfloat16 over a float32 base: the adapter slots hold bfloat16, and the
    adapter still changes the output (its delta runs, in the adapter's dtype)."""
    from tokenloom.lora.layers import LinearLoRA, lora_of

    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=16, lora_dtype="bfloat16")
    model = llm.engine.executor.worker.runner.model
    # the projections' (the embedding's and head's are made when an adapter first targets them)
    loras = [lora for module in model.modules() if type(lora := lora_of(module)) is LinearLoRA]
    assert loras and {lora.lora_a.dtype for lora in loras} == {torch.bfloat16}
    assert {lora.lora_b.dtype for lora in loras} == {torch.bfloat16}
    base = greedy(llm, prompt_ids[:1])
    adapted = greedy(llm, prompt_ids[:1], lora_requests["all-r8"])
    assert base == alone[None][:1] and adapted != base


# ---- what is refused, and how ---------------------------------------------------------------


def test_lora_request_needs_enable_lora(tiny_llama_dir, lora_requests):
    llm = LLM(model=tiny_llama_dir, dtype="float32")
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        greedy(llm, [[1, 2, 3]], lora_requests["all-r8"])


def test_rank_above_max_lora_rank_is_refused(tiny_llama_dir, lora_requests):
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match=r"rank 16, more than --max-lora-rank 8"):
        greedy(llm, [[1, 2, 3]], lora_requests["mlp-r16-bin"])
    assert not llm.engine.has_unfinished_requests()


def test_adapter_of_another_base_model_is_refused(llm, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    )
    path = save_random_adapter(other, tmp_path / "other", r=4, alpha=4, targets=["q_proj"], seed=0)
    with pytest.raises(
        InvalidRequestError, match=r"layers\.0\.self_attn\.q_proj maps 32 -> 32 features.*maps 64 -> 64"
    ):
        greedy(llm, [[1, 2, 3]], LoRARequest("other", 50, path))


def test_unsupported_adapter_options_are_refused_by_name(adapter_dirs, llm, tmp_path):
    import shutil

    for option, value, message in [
        ("use_dora", True, "DoRA"),
        ("bias", "all", "trains biases"),
        ("modules_to_save", ["embed_tokens"], "modules_to_save"),
    ]:
        path = tmp_path / option
        shutil.copytree(adapter_dirs["all-r8"], path)
        config = json.loads((path / "adapter_config.json").read_text())
        config[option] = value
        (path / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(InvalidRequestError, match=message):
            greedy(llm, [[1, 2, 3]], LoRARequest(option, 60 + len(option), str(path)))


def test_missing_adapter_and_reused_id_are_refused(llm, lora_requests, tmp_path):
    with pytest.raises(InvalidRequestError, match="'nowhere': .* is not a usable adapter"):
        greedy(llm, [[1, 2, 3]], LoRARequest("nowhere", 70, str(tmp_path / "nowhere")))
    first = lora_requests["all-r8"]
    greedy(llm, [[1, 2, 3]], first)
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 already names adapter 'all-r8'"):
        greedy(llm, [[1, 2, 3]], LoRARequest("imposter", first.lora_int_id, lora_requests["mlp-r16-bin"].lora_path))


def test_adapter_paths_resolve_through_model_source_plugins(tiny_llama_dir, adapter_dirs, prompt_ids, alone):
    from tests.lora import adapter_source_plugin

    adapter_source_plugin.ADAPTER_FOLDERS["sql"] = adapter_dirs["all-r8"]
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=16,
        plugins=["tests.lora.adapter_source_plugin"],
    )
    assert greedy(llm, prompt_ids, LoRARequest("sql", 7, "test-adapters:sql")) == alone["all-r8"]
    # the source's own reason goes to the log: one answer for every path that leads nowhere
    with pytest.raises(InvalidRequestError, match="'test-adapters:nope' is not a usable adapter"):
        greedy(llm, prompt_ids, LoRARequest("nope", 8, "test-adapters:nope"))


def test_an_adapter_gone_before_its_first_step_fails_its_requests_only(
    tiny_llama_dir, adapter_dirs, prompt_ids, alone, tmp_path
):
    import shutil

    path = shutil.copytree(adapter_dirs["all-r8"], tmp_path / "vanishing")
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=2)
    request = LoRARequest("vanishing", 9, str(path))
    assert llm.engine.add_lora(request)  # checked in the engine's process...
    shutil.rmtree(path)  # ...but gone before the worker reads it
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids[:2]]
    outputs = llm.generate(inputs, params, lora_request=[request, None])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].token_ids == alone[None][1]
    assert not llm.engine.has_unfinished_requests()
