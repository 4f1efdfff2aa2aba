"""RMSNorm and Gemma's (1 + weight) variant against transformers' modules, in float32 and
bfloat16 (where the rounding order differs between the two), with the fused residual add; the
torch code to the bit, the fused CPU operator to the bit in bfloat16 and within float32's
summation-order noise in float32."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tokenloom.errors import ModelLoadError
from tokenloom.layers import layernorm
from tokenloom.layers.layernorm import GemmaRMSNorm, RMSNorm

# on every CPU kernel level the host runs
pytestmark = pytest.mark.usefixtures("isa_level")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours, theirs", [(RMSNorm, LlamaRMSNorm), (GemmaRMSNorm, Gemma3RMSNorm)])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_matches_transformers(ours, theirs, dtype, fused, monkeypatch):
    if not fused:
        monkeypatch.setattr(layernorm, "ops_for", lambda tensor: None)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32, generator=generator) * 0.3 + (1.0 if ours is RMSNorm else 0.0)
    x = (torch.randn(5, 32, generator=generator) * 3).to(dtype)
    reference = theirs(32, eps=1e-5).to(dtype)
    reference.weight.data.copy_(weight)
    norm = ours(32, 1e-5, params_dtype=dtype)
    norm.load_checkpoint_weight("weight", weight)
    exact = not fused or dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(norm(x), reference(x), atol=0 if exact else 1e-6, rtol=0 if exact else 1e-6)


def test_fused_residual_add_returns_the_sum_as_new_residual():
    norm = RMSNorm(16)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    normed, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, norm(x + residual))


def test_initial_weights_make_identity_scaling():
    x = torch.randn(2, 8)
    torch.testing.assert_close(RMSNorm(8)(x), GemmaRMSNorm(8)(x))


def test_per_head_norm_works_on_the_last_dimension():
    norm = GemmaRMSNorm(4)
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(norm(x)[1, 1], norm(x[1, 1]))


def test_wrong_shape_is_a_load_error():
    with pytest.raises(ModelLoadError, match="shape"):
        RMSNorm(8).load_checkpoint_weight("weight", torch.ones(9))
