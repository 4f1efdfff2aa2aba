"""The layers' Triton operators under the interpreter against the layers' own torch code:
RMSNorm (Llama and Gemma, with and without the residual), rotary embedding in place (full and
partial rotary dims, strided views), SiLU/GELU-and-mul, and the causal softmax; and that a GPU
tensor is handed these operators by ``ops_for``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the `gpu` extra)")

from tokenloom.kernels import cpu_native  # noqa: E402
from tokenloom.kernels.triton import layers as triton_layers  # noqa: E402
from tokenloom.layers import rotary  # noqa: E402
from tokenloom.layers.activation import GeluAndMul, SiluAndMul  # noqa: E402
from tokenloom.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tolerance(dtype):
    """The kernels compute in float32 where torch chains 16-bit ops, so they may differ by a
    rounding; and Triton's interpreter converts float32 to bfloat16 by truncation, not to
    nearest as a GPU does, so a bfloat16 result may sit up to two ulps (2 * 2**-7) lower."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.bfloat16:
        return {"atol": 2e-2, "rtol": 2 * 2**-7 + 1e-3}
    return {"atol": 1e-2, "rtol": 1e-2}


@pytest.fixture
def torch_layers(monkeypatch):
    """The layers' torch code, not the CPU operators, as the reference."""
    for module in ("tokenloom.layers.layernorm", "tokenloom.layers.rotary", "tokenloom.layers.activation"):
        monkeypatch.setattr(f"{module}.ops_for", lambda tensor: None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(torch_layers, dtype, norm_class, with_residual):
    generator = torch.Generator().manual_seed(0)
    hidden = 96  # not a power of two: the masked tail
    norm = norm_class(hidden, eps=1e-6, params_dtype=dtype)
    norm.weight.data = (torch.randn(hidden, generator=generator) * 0.5 + (0 if norm_class is GemmaRMSNorm else 1)).to(
        dtype
    )
    x = torch.randn(5, hidden, generator=generator).to(dtype)
    residual = torch.randn(5, hidden, generator=generator).to(dtype) if with_residual else None
    expected = norm(x, residual)
    normed, summed = triton_layers.rms_norm(x, residual, norm.weight, norm.eps, norm.fused_gemma_variant)
    if with_residual:
        torch.testing.assert_close(normed, expected[0], **tolerance(dtype))
        if dtype == torch.bfloat16:  # the interpreter's truncation (see tolerance)
            torch.testing.assert_close(summed, expected[1], **tolerance(dtype))
        else:
            assert torch.equal(summed, expected[1])  # the sum is rounded exactly as torch rounds it
    else:
        torch.testing.assert_close(normed, expected, **tolerance(dtype))
        assert summed is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (128, 64), (256, 256)])
def test_rotary_in_place_on_a_strided_view(torch_layers, dtype, head_size, rotary_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    rope = rotary.RotaryEmbedding(head_size, rotary_dim, inv_freq, max_position=64, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 5, 17, 63, 31])
    # queries and keys side by side in one projection row, as the attention layers store them
    fused = torch.randn(5, 3 * head_size + 2 * head_size, generator=generator).to(dtype)
    heads = fused[:, : 3 * head_size].view(5, 3, head_size)
    expected = rope.rotate(positions, heads.clone())
    tail_before = fused[:, 3 * head_size :].clone()
    triton_layers.rotary_embedding_(heads, positions, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(heads, expected, **tolerance(dtype))
    assert torch.equal(fused[:, 3 * head_size :], tail_before)  # only the viewed heads move


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy in the interpreter: exp(big) = inf, as meant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "module, activation",
    [(SiluAndMul(), "silu"), (GeluAndMul("none"), "gelu"), (GeluAndMul("tanh"), "gelu_tanh")],
    ids=["silu", "gelu", "gelu_tanh"],
)
def test_act_and_mul(torch_layers, dtype, module, activation):
    x = (torch.randn(4, 2 * 1100, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)  # two column blocks
    torch.testing.assert_close(triton_layers.act_and_mul(x, activation), module(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_softmax(dtype):
    scores = torch.randn(3, 7, 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    future = torch.ones(7, 7, dtype=torch.bool).triu(1)
    expected = (scores.float() * 0.3).masked_fill(future, float("-inf")).softmax(-1).to(dtype)
    triton_layers.causal_softmax_(scores, 0.3)
    torch.testing.assert_close(scores, expected, **tolerance(dtype))


def test_empty_inputs_and_bad_shapes():
    empty = torch.empty(0, 8)
    normed, _ = triton_layers.rms_norm(empty, None, torch.ones(8), 1e-6, False)
    assert normed.shape == (0, 8)
    assert triton_layers.act_and_mul(torch.empty(0, 8), "silu").shape == (0, 4)
    with pytest.raises(Exception, match="unknown gated activation 'relu'"):
        triton_layers.act_and_mul(torch.ones(2, 8), "relu")
    with pytest.raises(Exception, match="contiguous features"):
        triton_layers.rms_norm(torch.ones(8, 2).t(), None, torch.ones(8), 1e-6, False)


def test_gpu_tensors_get_the_triton_operators_and_cpu_tensors_do_not():
    class OnGpu:
        device = torch.device("cuda", 0)

    assert cpu_native.ops_for(OnGpu()) is triton_layers
    assert cpu_native.ops_for(torch.ones(1)) is not triton_layers


def test_rotary_leaves_a_position_outside_the_table_unrotated():
    # a kernel cannot raise as the CPU operator does; the runner never makes such a position
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    rope = rotary.RotaryEmbedding(64, 64, inv_freq, max_position=8)
    heads = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(4))
    before = heads.clone()
    triton_layers.rotary_embedding_(heads, torch.tensor([3, 8, -1]), rope.cos_cache, rope.sin_cache)
    assert not torch.equal(heads[0], before[0])
    assert torch.equal(heads[1:], before[1:])
