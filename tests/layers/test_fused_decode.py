"""The fused decode layer (``decode_layer``) and the whole stack of them (``decode_layers``)
against the layers' own Python path, on tiny random Llama GGUFs with Q4_1 projections (int4
weights for tokenloom's kernel), on every CPU kernel level the host runs (``isa_level``), with
16-bit and fp8 KV caches."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers.gguf_files import tiny_model_state_dict, write_model_gguf

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.platforms.cpu import CpuPlatform
from tokenloom.kernels import int4_matmul
from tokenloom.layers.fused_decode import FusedDecodeLayer, FusedDecodeStack

pytestmark = [
    pytest.mark.usefixtures("isa_level"),
    pytest.mark.skipif(
        int4_matmul._native_kernel() is None, reason="tokenloom's CPU kernels are switched off or did not build"
    ),
]

PROMPTS = [[5 + (7 * index + 3 * position) % 80 for position in range(9 + 5 * index)] for index in range(5)]


def tiny_gguf(tmp_path_factory, architecture: str, quant_type_of: dict | None = None) -> str:
    config, state_dict = tiny_model_state_dict(architecture, seed=3)
    directory = tmp_path_factory.mktemp(architecture)
    return write_model_gguf(
        str(directory / "model.gguf"),
        architecture,
        config,
        state_dict,
        quant_type=GGMLQuantizationType.Q4_1,
        quant_type_of=quant_type_of,
    )


@pytest.fixture(scope="module")
def llama_llm(tmp_path_factory, isa_level):  # one engine per level: its layers keep that level's operators
    # bfloat16 (the dtype the int4 kernel runs); no prefix cache, so a repeated prompt is
    # computed the same way twice
    return LLM(
        model=tiny_gguf(tmp_path_factory, "llama"),
        dtype="bfloat16",
        max_model_len=128,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
    )


def generate(llm, max_tokens=12, **params):
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **params)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], sampling)
    return [
        (
            output.outputs[0].token_ids,
            [{token: entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs],
        )
        for output in outputs
    ]


def count_fused_calls():
    """Patch FusedDecodeLayer.__call__ and FusedDecodeStack.__call__ to count the layers they took
    (a stack call: each of its layers) and the layer calls declined, and the row counts of each;
    returns (patch, counter), whose "stacked" counts the stack's calls taken."""
    taken = {"fused": 0, "declined": 0, "stacked": 0, "fused_rows": set(), "declined_rows": set()}
    layer_call, stack_call = FusedDecodeLayer.__call__, FusedDecodeStack.__call__

    def counting_layer(self, positions, hidden_states, *args):
        result = layer_call(self, positions, hidden_states, *args)
        taken["fused" if result is not None else "declined"] += 1
        taken["fused_rows" if result is not None else "declined_rows"].add(hidden_states.shape[0])
        return result

    def counting_stack(self, positions, hidden_states, *args):
        result = stack_call(self, positions, hidden_states, *args)
        if result is not None:
            taken["stacked"] += 1
            taken["fused"] += len(self.layers)
            taken["fused_rows"].add(hidden_states.shape[0])
        return result

    patch = contextlib.ExitStack()
    patch.enter_context(mock.patch.object(FusedDecodeLayer, "__call__", counting_layer))
    patch.enter_context(mock.patch.object(FusedDecodeStack, "__call__", counting_stack))
    return patch, taken


@contextlib.contextmanager
def unfused():
    """Every layer on its Python path: the stack and the layer operator both decline."""
    with mock.patch.object(FusedDecodeStack, "__call__", lambda *args: None):
        with mock.patch.object(FusedDecodeLayer, "__call__", lambda *args: None):
            yield


def test_decode_steps_take_the_fused_layer_and_give_the_same_bits(llama_llm):
    patch, taken = count_fused_calls()
    with patch:
        fused = generate(llama_llm)
    assert taken["fused"] > 0 and taken["declined"] > 0  # decode steps fused; prompt steps not
    with unfused():
        python_path = generate(llama_llm)
    assert fused == python_path


def test_decode_steps_run_every_layer_in_one_call_with_each_layers_bits(llama_llm):
    """The stack takes every decode step (one ``decode_layers`` call for all the layers) and
    gives the bits of the layers' own ``decode_layer`` calls."""
    patch, taken = count_fused_calls()
    with patch:
        stacked = generate(llama_llm)
    layers = len(llama_llm.engine.executor.worker.runner.model.model.layers)
    assert taken["stacked"] > 0 and taken["fused"] == taken["stacked"] * layers  # no layer alone
    patch, taken = count_fused_calls()
    with mock.patch.object(FusedDecodeStack, "__call__", lambda *args: None), patch:
        layer_by_layer = generate(llama_llm)
    assert taken["stacked"] == 0 and taken["fused"] > 0
    assert stacked == layer_by_layer


def test_a_layer_class_that_changes_forward_keeps_its_layers_out_of_the_stack(llama_llm):
    model = llama_llm.engine.executor.worker.runner.model.model
    layers = list(model.layers)
    assert FusedDecodeStack.of(layers) is not None
    original = type(layers[1])
    layers[1].__class__ = type("Changed", (original,), {"forward": lambda self, *args: None})
    try:
        assert layers[1].stacked_decode() is None and FusedDecodeStack.of(layers) is None
    finally:
        layers[1].__class__ = original
    assert layers[1].stacked_decode() is layers[1].fused_decode


def test_decode_steps_of_many_rows_are_fused_too(llama_llm):
    patch, taken = count_fused_calls()
    with patch:
        llama_llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=3, n=20, temperature=1.0, seed=1)
        )
    # the 20 sequences decode together in 20-row steps
    assert 20 in taken["fused_rows"]


def test_layers_mixing_kernels_per_projection_are_fused_and_give_the_same_bits(tmp_path_factory, isa_level):
    """As a Q4_K_M file gives v and down more bits: here a Q5_0 v beside Q4_1 q and k (one
    projection on two kernels), Q5_1 gate/up and a Q8_0 down; every decode step is fused."""
    Q = GGMLQuantizationType
    path = tiny_gguf(
        tmp_path_factory,
        "llama",
        {"attn_v.weight": Q.Q5_0, "ffn_gate.weight": Q.Q5_1, "ffn_up.weight": Q.Q5_1, "ffn_down.weight": Q.Q8_0},
    )
    llm = LLM(model=path, dtype="bfloat16", max_model_len=128, enable_prefix_caching=False, skip_tokenizer_init=True)
    layer = llm.engine.executor.worker.runner.model.model.layers[0]
    assert [type(weight).__name__ for weight in layer.self_attn.qkv_proj.native_segments] == [
        "Int4Weight",
        "KQuantWeight",
    ]
    patch, taken = count_fused_calls()
    with patch:
        fused = generate(llm, max_tokens=6)
    assert taken["fused"] > 0
    _, _, _, _, (_, kinds, segments), *_ = layer.fused_decode._arguments
    assert (kinds, segments) == ([400, 501, 400, 501, 800], [2, 1, 1, 1])
    with unfused():
        python_path = generate(llm, max_tokens=6)
    assert fused == python_path


def test_a_layer_with_biases_is_not_fused(tmp_path_factory):
    # Qwen2 is the Llama layer with qkv biases: the operator has no bias terms
    llm = LLM(model=tiny_gguf(tmp_path_factory, "qwen2"), dtype="bfloat16", max_model_len=128, skip_tokenizer_init=True)
    patch, taken = count_fused_calls()
    with patch:
        generate(llm, max_tokens=4)
    assert taken["fused"] == 0 and taken["declined"] > 0
    layer = llm.engine.executor.worker.runner.model.model.layers[0]
    assert layer.fused_decode._arguments is None


def test_float32_the_platform_chose_is_fused_and_gives_the_same_bits(tmp_path_factory):
    """A CPU without native bfloat16 runs --dtype auto in float32, int4 weights on the kernel:
    the operator takes those layers in float32."""
    with mock.patch.object(CpuPlatform, "default_dtype", lambda self, model_dtype: torch.float32):
        llm = LLM(
            model=tiny_gguf(tmp_path_factory, "llama"),
            max_model_len=128,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
        )
    assert llm.engine.executor.worker.runner.dtype == torch.float32
    patch, taken = count_fused_calls()
    with patch:
        fused = generate(llm, max_tokens=6)
    assert taken["fused"] > 0
    with unfused():
        python_path = generate(llm, max_tokens=6)
    assert fused == python_path


def test_float32_models_asked_for_by_name_are_not_fused(tmp_path_factory):
    # --dtype float32 keeps float32 exact: dense weights, no int4 kernel to chain
    llm = LLM(model=tiny_gguf(tmp_path_factory, "llama"), dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    patch, taken = count_fused_calls()
    with patch:
        outputs = generate(llm, max_tokens=4)
    assert taken["fused"] == 0 and all(len(tokens) == 4 for tokens, _ in outputs)
    assert torch.float32 == llm.engine.executor.worker.runner.dtype


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_is_fused_with_its_scales_and_gives_the_same_bits(tmp_path_factory, isa_level, cache_dtype):
    """The operator writes and reads an fp8 cache with the layer's scales (here calculated from the
    first step, which the Python path runs): the same bits as the layer's Python path."""
    llm = LLM(
        model=tiny_gguf(tmp_path_factory, "llama"),
        dtype="bfloat16",
        max_model_len=128,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        cache_dtype=cache_dtype,
        calculate_kv_scales=True,
    )
    runner = llm.engine.executor.worker.runner
    assert runner.kv_caches[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    patch, taken = count_fused_calls()
    with patch:
        fused = generate(llm)
    assert taken["fused"] > 0
    assert all(not scales.pending and scales.k_scale != 1.0 for scales in runner.kv_scales)
    with unfused():
        python_path = generate(llm)
    assert fused == python_path


def test_verification_steps_take_the_fused_layer_and_give_the_plain_decode_bits(tmp_path_factory, llama_llm):
    """With n-gram speculation a step verifies a request's pending token and its drafts, k + 1
    rows of one sequence (the tiny model loops, so drafts come): the operator takes those steps,
    each row computed as a one-row decode computes it, so in bfloat16 the greedy tokens and their
    logprobs are the bits of plain decoding."""
    speculative = LLM(
        model=tiny_gguf(tmp_path_factory, "llama"),
        dtype="bfloat16",
        max_model_len=128,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        plugins=["tokenloom.builtin_plugins.proposers"],  # the entry point until it is installed
        speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1},
    )
    patch, taken = count_fused_calls()
    with patch:
        verified = generate(speculative, max_tokens=20)
    assert speculative.engine.stats().spec_decoding.num_accepted_tokens > 0
    # a decode step has a row per request at most: more rows fused means verifying steps were
    assert max(taken["fused_rows"]) > len(PROMPTS)
    assert verified == generate(llama_llm, max_tokens=20)
