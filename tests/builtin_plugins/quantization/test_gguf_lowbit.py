"""GGML's Q2_K and Q3_K blocks as the 2- and 3-bit kernels' parts (exactly the values the gguf
package's ``dequantize`` gives), and the ``gguf`` method keeping such layers native: the fused
layers of llama-quantize's Q3_K_M (Q3_K q/k beside a Q5_K v) and Q2_K (Q2_K q/k beside a Q3_K v)
files hold no dense weight, and a head on such blocks multiplies their codes, on every CPU kernel
level the host runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from tests.builtin_plugins.quantization.test_gguf_kquant import loaded_layer, random_weight
from tokenloom.builtin_plugins.quantization.gguf_lowbit import lowbit_parts
from tokenloom.kernels import lowbit_matmul
from tokenloom.kernels.kquant_matmul import KQuantWeight
from tokenloom.kernels.lowbit_matmul import LowbitWeight, dequantize_int2, dequantize_int3, lowbit_linear
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.usefixtures("isa_level")

Q = GGMLQuantizationType
NATIVE = lowbit_matmul._kernel(3, 16, 256) is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="tokenloom's CPU kernels are switched off or did not build")


@pytest.mark.parametrize("quant_type", [Q.Q3_K, Q.Q2_K])
def test_parts_give_the_gguf_packages_values_exactly(quant_type):
    weight = random_weight(quant_type, 6, 512, seed=int(quant_type))
    parts = lowbit_parts(weight)
    if quant_type == Q.Q3_K:
        codes, scales, d = parts
        assert (
            int(codes.max()) <= 7 and scales.dtype == torch.int8 and -32 <= int(scales.min()) <= int(scales.max()) < 32
        )
        dense = dequantize_int3(codes, scales, d)
    else:
        codes, scales, mins, d, dmin = parts
        assert int(codes.max()) <= 3 and int(scales.max()) <= 15 and int(mins.max()) <= 15
        dense = dequantize_int2(codes, scales, mins, d, dmin)
    assert d.shape == (6, 2)
    expected = reference_dequantize(weight.data.numpy().reshape(-1), quant_type).reshape(6, 512)
    np.testing.assert_allclose(dense.numpy(), expected, rtol=1.5e-7, atol=1e-9)


# layers as llama-quantize writes them: (shard types, in features, the packed runs of rows)
FUSED = {
    "q3_k_m-qkv": ([Q.Q3_K, Q.Q3_K, Q.Q5_K], 256, [LowbitWeight, KQuantWeight]),
    "q2_k-qkv": ([Q.Q2_K, Q.Q2_K, Q.Q3_K], 512, [LowbitWeight, LowbitWeight]),
    "q2_k-gate-up": ([Q.Q2_K, Q.Q2_K], 256, [LowbitWeight]),
    "q3_k-down": ([Q.Q3_K], 768, [LowbitWeight]),
}


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(FUSED))
def test_layers_keep_every_shard_native_and_no_dense_weight(case, dtype):
    types, features, runs = FUSED[case]
    shards = [random_weight(quant_type, 32, features, seed=index) for index, quant_type in enumerate(types)]
    method, layer = loaded_layer(shards, dtype)
    assert layer.weight.is_meta and layer.int4_weight is None
    assert [type(segment) for segment in layer.native_segments] == runs
    x = torch.randn(3, features, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = method.apply(layer, x, None)
    assert out.dtype == dtype and out.shape == (3, layer.weight.shape[0])
    dense = x.double() @ torch.cat([shard.dequantize() for shard in shards]).double().T
    torch.testing.assert_close(out.double(), dense, rtol=0, atol=0.03 * dense.abs().max().item())


@needs_native
@pytest.mark.parametrize("quant_type", [Q.Q3_K, Q.Q2_K])
def test_a_tied_head_on_low_bit_blocks_multiplies_their_codes_and_holds_no_dense_weight(quant_type):
    """A head written with ``--output-tensor-type q3_k`` (or q2_k), tied to the embedding: the
    lowbit kernel on the file's codes at every batch, float32 logits; the lookup dequantizes rows."""
    weight = random_weight(quant_type, 48, 256, seed=3)
    embedding = VocabParallelEmbedding(48, 256, params_dtype=torch.bfloat16)
    head = ParallelLMHead(48, 256, params_dtype=torch.bfloat16)
    head.tie_to(embedding)
    embedding.load_checkpoint_weight("weight", weight)
    embedding.process_weights_after_loading()
    head.process_weights_after_loading()
    assert isinstance(head.kernel_weight, LowbitWeight)
    assert embedding.weight.is_meta and head.weight is embedding.weight
    exact = weight.dequantize(torch.float32)
    ids = torch.tensor([47, 0, 9])
    assert torch.equal(embedding(ids), exact[ids].to(torch.bfloat16))
    for rows in (1, 8):
        hidden = torch.randn(rows, 256, dtype=torch.bfloat16)
        logits = head.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 48)
        assert torch.equal(logits, lowbit_linear(hidden, head.kernel_weight, dtype=torch.float32))
        torch.testing.assert_close(logits, hidden.float() @ exact.T, rtol=0, atol=0.03 * logits.abs().max().item())
