"""The pooler: CLS / MEAN / LAST over sequences laid end to end, against per-sequence
loops; per-request dimensions, normalize and softmax; defaults from a config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenloom.core.sampling_params import PoolingParams
from tokenloom.errors import ConfigError
from tokenloom.layers.pooler import Pooler

SEQ_LENS = [3, 1, 5, 2]


@pytest.fixture
def hidden_states():
    return torch.randn(sum(SEQ_LENS), 6, generator=torch.Generator().manual_seed(0))


def sequences(hidden_states):
    return list(torch.split(hidden_states, SEQ_LENS))


@pytest.mark.parametrize(
    "pooling_type, expected",
    [
        ("CLS", lambda seq: seq[0]),
        ("MEAN", lambda seq: seq.mean(dim=0)),
        ("LAST", lambda seq: seq[-1]),
    ],
)
def test_pool_matches_a_per_sequence_loop(hidden_states, pooling_type, expected):
    pooled = Pooler(pooling_type, normalize=False).pool(hidden_states, SEQ_LENS)
    reference = torch.stack([expected(seq) for seq in sequences(hidden_states)])
    torch.testing.assert_close(pooled, reference)


def test_mean_pooling_of_bfloat16_is_accumulated_in_float32():
    hidden_states = torch.full((4, 2), 1.0 / 3.0).to(torch.bfloat16)
    pooled = Pooler("MEAN").pool(hidden_states, [4])
    assert pooled.dtype == torch.float32
    torch.testing.assert_close(pooled, hidden_states[:1].float())


def test_forward_normalizes_by_default_and_returns_one_cpu_tensor_per_sequence(hidden_states):
    outputs = Pooler("MEAN")(hidden_states, SEQ_LENS)
    assert len(outputs) == len(SEQ_LENS)
    for output, seq in zip(outputs, sequences(hidden_states)):
        assert output.device.type == "cpu" and output.dtype == torch.float32
        torch.testing.assert_close(output, torch.nn.functional.normalize(seq.mean(dim=0), dim=0))
        assert torch.linalg.vector_norm(output).item() == pytest.approx(1.0, abs=1e-6)


def test_per_request_options_apply_to_their_own_rows_only(hidden_states):
    pooler = Pooler("LAST", normalize=True)
    params = [None, PoolingParams(dimensions=3), PoolingParams(normalize=False), PoolingParams(softmax=True)]
    outputs = pooler(hidden_states, SEQ_LENS, params)
    last = [seq[-1] for seq in sequences(hidden_states)]
    torch.testing.assert_close(outputs[0], torch.nn.functional.normalize(last[0], dim=0))
    # Matryoshka: truncated first, then normalized
    torch.testing.assert_close(outputs[1], torch.nn.functional.normalize(last[1][:3], dim=0))
    torch.testing.assert_close(outputs[2], last[2])
    torch.testing.assert_close(outputs[3], torch.nn.functional.normalize(last[3], dim=0).softmax(dim=0))


def test_from_config_takes_defaults_for_unset_fields():
    pooler = Pooler.from_config(
        SimpleNamespace(pooling_type=None, normalize=False, softmax=None), default_pooling_type="CLS"
    )
    assert (pooler.pooling_type, pooler.normalize, pooler.softmax) == ("CLS", False, False)
    assert Pooler.from_config(None, default_pooling_type="last").pooling_type == "LAST"


def test_bad_pooling_type_and_row_count_are_errors(hidden_states):
    with pytest.raises(ConfigError, match="CLS, MEAN, LAST"):
        Pooler("MAX")
    with pytest.raises(ValueError, match="rows"):
        Pooler("MEAN").pool(hidden_states, [1, 2])
