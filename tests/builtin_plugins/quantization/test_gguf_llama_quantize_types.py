"""Every GGUF type llama.cpp's ``llama-quantize`` writes for a Llama, served with no dense copy of
any quantized weight: a tiny random Llama whose features are whole K-quant superblocks (256), its
float32 GGUF quantized by llama.cpp itself to Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M and Q2_K (the file's
tensor types asserted, so a K-quant type really appears and is not llama.cpp's fallback for rows
that do not fit). The loaded model is walked: no parameter of two or more dimensions holds a dense
float tensor (every linear layer, the embedding and the LM head keep the file's codes), and greedy
decoding agrees with transformers holding the file's dequantized values (vLLM's
``check_logprobs_close`` rule). The Q3_K_M and Q2_K files' decode steps take the fused decode
operator with their 2- and 3-bit projections, bit for bit the layers' own path. Skipped where
``llama-quantize`` is not built."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers.gguf_files import write_model_gguf
from helpers.model_parity import hf_greedy_top_k, randomize_parameters, served_greedy_top_k
from helpers.moe_checkpoints import llama_quantize, quantize_with_llama_cpp, with_gguf_values
from helpers.quantized_parity import check_logprobs_close
from transformers import LlamaConfig, LlamaForCausalLM

from tests.layers.test_fused_decode import count_fused_calls, unfused
from tokenloom import LLM
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.kernels import cpu_native
from tokenloom.layers.linear import LinearBase

pytestmark = [
    pytest.mark.skipif(llama_quantize() is None, reason="llama.cpp's llama-quantize is not built here"),
    pytest.mark.skipif(not cpu_native.enabled(), reason="tokenloom's CPU kernels are switched off"),
]

Q = GGMLQuantizationType
PROMPTS = [[9, 14, 130, 3, 57, 71], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
NEW_TOKENS = 8

# per llama-quantize kind: the types its linear layers must include (the kind's own K-quant, not a fallback)
KINDS = {
    "Q8_0": {Q.Q8_0},
    "Q6_K": {Q.Q6_K},
    "Q5_K_M": {Q.Q5_K, Q.Q6_K},
    "Q4_K_M": {Q.Q4_K, Q.Q6_K},
    "Q3_K_M": {Q.Q3_K, Q.Q4_K},
    "Q2_K": {Q.Q2_K, Q.Q3_K},
}
# the fused decode operator's kinds of layer 0's projections (q/k, v, o, gate/up, down runs)
FUSED_KINDS = {"Q3_K_M": [300, 508, 400, 300, 400], "Q2_K": [200, 300, 300, 200, 300]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The transformers model and its float32 GGUF: every linear layer's input a multiple of 256."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = randomize_parameters(LlamaForCausalLM(config).eval())
    path = tmp_path_factory.mktemp("llama") / "model-f32.gguf"
    return hf_model, write_model_gguf(str(path), "llama", config, hf_model.state_dict())


def with_file_values(hf_model, path: str):
    """``hf_model`` holding the file's dequantized values, q and k rows put back in transformers'
    order (the converter interleaves each head's halves for llama.cpp's rotary)."""
    hf_model = with_gguf_values(hf_model, "llama", path)
    config = hf_model.config
    with torch.no_grad():
        for layer in hf_model.model.layers:
            for projection, heads in (
                (layer.self_attn.q_proj, config.num_attention_heads),
                (layer.self_attn.k_proj, config.num_key_value_heads),
            ):
                rows, cols = projection.weight.shape
                interleaved = projection.weight.view(heads, rows // heads // 2, 2, cols)
                projection.weight.copy_(interleaved.transpose(1, 2).reshape(rows, cols))
    return hf_model


def dense_copies(model) -> list[str]:
    """Parameters of two or more dimensions that hold a dense tensor (a quantized weight's
    dequantized copy): a layer keeping the file's codes holds a meta placeholder instead."""
    return [name for name, param in model.named_parameters() if param.dim() >= 2 and not param.is_meta]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_llama_quantize_file_holds_no_dense_copy_and_agrees_with_transformers(llama, kind, tmp_path):
    hf_model, source = llama
    path = quantize_with_llama_cpp(source, str(tmp_path / f"model-{kind}.gguf"), kind)
    types = {info.name: Q(info.ggml_type) for info in GGUFFile(path).tensors.values()}
    linear_types = {quant_type for name, quant_type in types.items() if name.startswith("blk.") and "norm" not in name}
    assert KINDS[kind] <= linear_types, (kind, types)
    assert Q.F32 not in linear_types and Q.F16 not in linear_types

    llm = LLM(model=path, max_model_len=64, kv_cache_memory_bytes=2**20, skip_tokenizer_init=True)
    model = llm.engine.executor.worker.runner.model
    assert not dense_copies(model), f"{kind}: dense copies of quantized weights: {dense_copies(model)}"
    linears = [module for module in model.modules() if isinstance(module, LinearBase)]
    assert len(linears) == 2 * 4
    assert model.lm_head.kernel_weight is not None and model.model.embed_tokens.row_blocks is not None

    reference = with_file_values(hf_model, path)
    expected = [hf_greedy_top_k(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert all(len(set(tokens)) > 3 for tokens, _ in expected), "greedy decoding is degenerate"
    patch, taken = count_fused_calls()
    with patch:
        served = served_greedy_top_k(llm, PROMPTS, NEW_TOKENS)
    check_logprobs_close(expected, served)
    if kind in FUSED_KINDS:
        assert taken["fused"] > 0
        layer = model.model.layers[0]
        _, _, _, _, (_, kinds, _), *_ = layer.fused_decode._arguments
        assert kinds == FUSED_KINDS[kind]
        with unfused():
            assert served_greedy_top_k(llm, PROMPTS, NEW_TOKENS) == served
