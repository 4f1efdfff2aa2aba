"""The fused CPU operators of a decoder layer (``tokenloom_cpu.rms_norm``, ``rotary_embedding_``,
``act_and_mul``) against the layers' torch code, which stays the reference: the same layer is
run with the operators and with them switched off."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import cpu_native
from tokenloom.layers import activation, layernorm, rotary
from tokenloom.layers.activation import GeluAndMul, SiluAndMul
from tokenloom.layers.layernorm import GemmaRMSNorm, RMSNorm
from tokenloom.layers.rotary import get_rope

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# on every CPU kernel level the host runs
pytestmark = pytest.mark.usefixtures("isa_level")


def tolerance(dtype):
    # the fused operators round once where the torch chain rounds after every operator
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture
def torch_only(monkeypatch):
    """Run a layer's torch code: every layer module sees no native operators."""

    def switch_off():
        for module in (layernorm, activation, rotary):
            monkeypatch.setattr(module, "ops_for", lambda tensor: None)

    return switch_off


def test_the_operators_load_here():
    # `make install` builds them; a missing compiler would make every fused path silently torch
    assert cpu_native.load() is not None
    assert cpu_native.ops_for(torch.zeros(1)) is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_chain(dtype, norm_class, with_residual, torch_only):
    generator = torch.Generator().manual_seed(0)
    norm = norm_class(40, eps=1e-5, params_dtype=dtype)
    norm.weight.data.copy_(torch.randn(40, generator=generator))
    x = (torch.randn(37, 40, generator=generator) * 3).to(dtype)
    residual = torch.randn(37, 40, generator=generator).to(dtype) if with_residual else None
    fused = norm(x, residual)
    torch_only()
    expected = norm(x, residual)
    if with_residual:
        torch.testing.assert_close(fused[0], expected[0], **tolerance(dtype))
        # the new residual is x + residual rounded to the dtype, exactly as torch adds them
        assert torch.equal(fused[1], expected[1])
    else:
        torch.testing.assert_close(fused, expected, **tolerance(dtype))


def test_rms_norm_reads_strided_rows():
    x = torch.randn(6, 64)[:, :32]
    norm = RMSNorm(32)
    torch.testing.assert_close(norm(x), norm(x.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rotary_in_place_matches_the_torch_rotation(dtype, rotary_fraction, torch_only):
    rope = get_rope(
        16, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary_fraction}, 64, dtype=dtype
    )
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=generator).to(dtype)
    positions = torch.tensor([0, 3, 17, 63, 8])
    query_and_key = qkv[:, :96]  # strided rows: values sit beside them
    values_before = qkv[:, 96:].clone()
    unrotated = query_and_key.clone()
    fused = rope.rotate(positions, query_and_key)
    assert fused.data_ptr() == query_and_key.data_ptr()  # in place
    assert torch.equal(qkv[:, 96:], values_before)
    torch_only()
    expected = rope.rotate(positions, unrotated)
    torch.testing.assert_close(fused, expected, **tolerance(dtype))


def test_rotary_rejects_a_position_beyond_its_table():
    rope = get_rope(8, {"rope_type": "default", "rope_theta": 10000.0}, 16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rope.rotate(torch.tensor([16]), torch.zeros(1, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layer", [SiluAndMul(), GeluAndMul("tanh"), GeluAndMul("none")], ids=["silu", "gelu_tanh", "gelu"]
)
def test_gated_activations_match_torch(dtype, layer, torch_only):
    x = (torch.randn(9, 2 * 24, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    x[0, 0], x[1, 1] = -200.0, 200.0  # far tails of the activation
    fused = layer(x)
    torch_only()
    torch.testing.assert_close(fused, layer(x), **tolerance(dtype))


def test_act_and_mul_rejects_an_unknown_activation():
    with pytest.raises(RuntimeError, match="unknown activation"):
        cpu_native.load().act_and_mul(torch.zeros(2, 4), "relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries, keys", [(1, 1), (5, 5), (4, 9), (70, 70)])
def test_causal_softmax_matches_masked_softmax(dtype, queries, keys):
    scores = (torch.randn(3, queries, keys, generator=torch.Generator().manual_seed(4)) * 5).to(dtype)
    query_positions = torch.arange(keys - queries, keys).unsqueeze(1)
    allowed = torch.arange(keys).unsqueeze(0) <= query_positions
    expected = (scores.float() * 0.3).masked_fill(~allowed, float("-inf")).softmax(-1).to(dtype)
    fused = scores.clone()
    cpu_native.load().causal_softmax_(fused, 0.3)
    torch.testing.assert_close(fused, expected, **tolerance(dtype))
    assert (fused.float()[:, ~allowed] == 0).all()


# widths around the vector lengths (8 lanes on AVX2, 16 on AVX-512): the last values of a row
# take a padded or masked tail
ODD_WIDTHS = [1, 7, 8, 9, 15, 17, 33, 577]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", ODD_WIDTHS)
@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_tails_match_the_torch_chain(dtype, features, norm_class, torch_only):
    generator = torch.Generator().manual_seed(features)
    norm = norm_class(features, eps=1e-6, params_dtype=dtype)
    norm.weight.data.copy_(torch.randn(features, generator=generator))
    x = (torch.randn(3, features, generator=generator) * 5).to(dtype)
    residual = torch.randn(3, features, generator=generator).to(dtype)
    fused, fused_sum = norm(x, residual)
    fused_alone = norm(x)
    torch_only()
    expected, expected_sum = norm(x, residual)
    assert torch.equal(fused_sum, expected_sum)
    torch.testing.assert_close(fused, expected, **tolerance(dtype))
    torch.testing.assert_close(fused_alone, norm(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_residual_rounds_ties_to_even(dtype, torch_only):
    """x + residual lands exactly halfway between two values of the dtype: rounded to the even
    one, as torch rounds (bfloat16 keeps 8 significant bits, float16 11)."""
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    halves = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, 0.5, 1.5, 2.5]) * ulp
    x = torch.ones(2, 9, dtype=dtype)
    residual = torch.stack([halves, -halves / 2]).to(dtype)
    norm = RMSNorm(9, params_dtype=dtype)
    _, fused_sum = norm(x, residual)
    torch_only()
    _, expected_sum = norm(x, residual)
    assert torch.equal(fused_sum, expected_sum)
    assert torch.equal(fused_sum, x + residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", ODD_WIDTHS + [1536])
def test_silu_and_mul_tails_and_extremes_match_torch(dtype, width, torch_only):
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(4, 2 * width, generator=generator) * 6).to(dtype)
    # the exponential's range: saturated, clamped and tiny gates, and exact zeros
    extremes = torch.tensor([-200.0, -88.0, -87.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 87.0, 200.0, -0.0])
    x[0, : min(width, len(extremes))] = extremes[:width].to(dtype)
    fused = SiluAndMul()(x)
    torch_only()
    torch.testing.assert_close(fused, SiluAndMul()(x), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries, keys", [(1, 7), (3, 9), (2, 17), (9, 9), (5, 12), (1, 33)])
@pytest.mark.parametrize("spread", [1.0, 100.0])
def test_causal_softmax_tails_match_masked_softmax(dtype, queries, keys, spread):
    """Visible lengths that are not whole vectors, and scores so spread that most of the row's
    exponentials underflow to zero."""
    scores = (torch.randn(2, queries, keys, generator=torch.Generator().manual_seed(keys)) * spread).to(dtype)
    query_positions = torch.arange(keys - queries, keys).unsqueeze(1)
    allowed = torch.arange(keys).unsqueeze(0) <= query_positions
    expected = (scores.float() * 0.3).masked_fill(~allowed, float("-inf")).softmax(-1).to(dtype)
    fused = scores.clone()
    cpu_native.load().causal_softmax_(fused, 0.3)
    torch.testing.assert_close(fused, expected, **tolerance(dtype))
    assert (fused.float()[:, ~allowed] == 0).all()
