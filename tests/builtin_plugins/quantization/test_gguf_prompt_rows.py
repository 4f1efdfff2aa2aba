"""A GGUF layer multiplies a prompt's rows and the other rows each their own way (on a CPU with
AMX-BF16 the prompt rows through the bfloat16 panel kernels, layers/row_roles.py), and a row's
role follows from its position alone: a request gets the same bits whether it runs alone, beside
other prompts, or while another request's prompt is computed in its decode steps.

A tiny Llama GGUF whose q, k, gate and up are Q4_1 (tokenloom's int4 kernel) and whose v and down
are Q5_0 (the 5-bit kernel), so a fused qkv layer holds two runs of rows, as a Q4_K_M file's does.
"""

from __future__ import annotations

from unittest import mock

import pytest
from gguf import GGMLQuantizationType
from helpers.gguf_files import tiny_model_state_dict, write_model_gguf

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import int4_matmul, kquant_matmul

pytestmark = pytest.mark.skipif(
    int4_matmul._native_kernel() is None, reason="tokenloom's CPU kernels are switched off or did not build"
)

PROMPT_A = [5 + (7 * position) % 80 for position in range(11)]
PROMPT_B = [9 + (5 * position) % 80 for position in range(37)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    config, state_dict = tiny_model_state_dict("llama", seed=5)
    path = write_model_gguf(
        str(tmp_path_factory.mktemp("llama") / "model.gguf"),
        "llama",
        config,
        state_dict,
        quant_type=GGMLQuantizationType.Q4_1,
        quant_type_of={"attn_v.weight": GGMLQuantizationType.Q5_0, "ffn_down.weight": GGMLQuantizationType.Q5_0},
    )
    # no prefix cache: a repeated prompt is computed again
    return LLM(model=path, dtype="bfloat16", max_model_len=128, enable_prefix_caching=False, skip_tokenizer_init=True)


def run(llm, late_b_after_steps: int | None):
    """Request A alone (``None``), or with B added after A's first ``late_b_after_steps`` steps
    (0: both prompts in the first step): A's and B's token ids and top-3 logprobs, exactly."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    engine.add_request("a", {"prompt_token_ids": PROMPT_A}, params)
    steps = 0
    finished = {}
    while engine.has_unfinished_requests() or (
        late_b_after_steps is not None and "b" not in finished and steps <= late_b_after_steps
    ):
        if late_b_after_steps is not None and steps == late_b_after_steps:
            engine.add_request("b", {"prompt_token_ids": PROMPT_B}, params)
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                finished[output.request_id] = (
                    completion.token_ids,
                    [{token: entry.logprob for token, entry in step.items()} for step in completion.logprobs],
                )
        steps += 1
    return finished


def test_a_request_gets_the_same_bits_alone_beside_a_prompt_and_with_a_prompt_in_its_decode_steps(llm):
    alone = run(llm, None)["a"]
    together = run(llm, 0)
    late = run(llm, 3)  # B's 37 prompt rows share a step with A's decode row
    assert together["a"] == alone
    assert late["a"] == alone
    assert late["b"] == together["b"]
    assert len(alone[0]) == 10 and len(set(alone[0])) > 1


@pytest.mark.skipif(not int4_matmul.bf16_amx_available(), reason="no AMX-BF16 here: every row takes the 8-bit kernels")
def test_prompt_rows_take_the_bfloat16_kernels_and_decode_rows_the_8_bit_ones(llm):
    rows = {"int4": [], "int4_bf16": [], "kquant": [], "kquant_bf16": []}

    def spy(name, function):
        def wrapper(x, weight, *args, **kwargs):
            rows[name].append(x.shape[0])
            return function(x, weight, *args, **kwargs)

        return wrapper

    patches = [
        mock.patch.object(module, function.__name__, spy(name, function))
        for module, name, function in (
            (int4_matmul, "int4", int4_matmul.int4_linear),
            (int4_matmul, "int4_bf16", int4_matmul.int4_linear_bf16),
            (kquant_matmul, "kquant", kquant_matmul.kquant_linear),
            (kquant_matmul, "kquant_bf16", kquant_matmul.kquant_linear_bf16),
        )
    ]
    # the layers' method imported the functions by name: patch them where it calls them
    from tokenloom.builtin_plugins.quantization import gguf

    patches += [
        mock.patch.object(gguf, name, spy(key, getattr(gguf, name)))
        for name, key in (
            ("int4_linear", "int4"),
            ("int4_linear_bf16", "int4_bf16"),
            ("kquant_linear", "kquant"),
            ("kquant_linear_bf16", "kquant_bf16"),
        )
    ]
    for patch in patches:
        patch.start()
    try:
        # (decode-only steps run through the fused decode layer, which calls neither)
        run(llm, 3)
    finally:
        for patch in patches:
            patch.stop()
    # A's 11 prompt rows, then B's 37 beside A's decode row: only prompt rows on bfloat16
    assert set(rows["int4_bf16"]) == {11, 37} and set(rows["kquant_bf16"]) == {11, 37}
    assert set(rows["int4"]) <= {1, 2} and set(rows["kquant"]) <= {1, 2}
