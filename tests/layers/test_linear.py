"""Linear layers: forward against F.linear, checkpoint loading into fused row ranges, and the
tensor-parallel arithmetic (shapes and slices per rank; per-rank outputs recombine to the
unsharded result)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers import linear
from tokenloom.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    kv_heads_per_rank,
    process_weights_after_loading,
)
from tokenloom.layers.quantization import UnquantizedMethod


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layer_class", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
def test_plain_layers_match_f_linear(layer_class):
    layer = layer_class(12, 8, bias=True)
    weight, bias, x = randn(8, 12, seed=1), randn(8, seed=2), randn(5, 12, seed=3)
    layer.load_checkpoint_weight("weight", weight)
    layer.load_checkpoint_weight("bias", bias)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))


def test_qkv_loads_shards_into_their_rows_and_splits_by_heads():
    layer = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    q, k, v = randn(16, 16, seed=1), randn(8, 16, seed=2), randn(8, 16, seed=3)
    for shard_id, tensor in zip("qkv", (q, k, v)):
        layer.load_checkpoint_weight("weight", tensor, shard_id)
        layer.load_checkpoint_weight("bias", tensor[:, 0], shard_id)
    torch.testing.assert_close(layer.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(layer.bias, torch.cat([q[:, 0], k[:, 0], v[:, 0]]))
    assert (layer.q_size, layer.kv_size, layer.output_size) == (16, 8, 32)


def test_merged_column_loads_gate_and_up():
    layer = MergedColumnParallelLinear(6, [10, 10])
    gate, up = randn(10, 6, seed=1), randn(10, 6, seed=2)
    layer.load_checkpoint_weight("weight", up, 1)
    layer.load_checkpoint_weight("weight", gate, 0)
    torch.testing.assert_close(layer.weight, torch.cat([gate, up]))


def test_unknown_shard_and_parameter_are_load_errors():
    layer = MergedColumnParallelLinear(6, [10, 10])
    with pytest.raises(ModelLoadError, match="shard 2"):
        layer.load_checkpoint_weight("weight", randn(10, 6), 2)
    with pytest.raises(ModelLoadError, match="without one"):
        layer.load_checkpoint_weight("bias", randn(20), 0)
    with pytest.raises(ModelLoadError, match="no parameter 'scale'"):
        ColumnParallelLinear(6, 4).load_checkpoint_weight("scale", randn(4))


# -- tensor parallelism: tp_size=2 shapes and slices ------------------------------------


def test_column_parallel_ranks_hold_row_slices():
    full = randn(8, 6, seed=4)
    x = randn(3, 6, seed=5)
    outputs = []
    for rank in range(2):
        layer = ColumnParallelLinear(6, 8, tp_rank=rank, tp_size=2)
        assert layer.weight.shape == (4, 6)
        layer.load_checkpoint_weight("weight", full)
        torch.testing.assert_close(layer.weight, full[rank * 4 : (rank + 1) * 4])
        outputs.append(layer(x))
    torch.testing.assert_close(torch.cat(outputs, dim=-1), F.linear(x, full))


def test_row_parallel_ranks_hold_column_slices_and_sum(monkeypatch):
    monkeypatch.setattr(linear, "tensor_parallel_all_reduce", lambda tensor, tp_group, tp_size: tensor)
    full, bias, x = randn(5, 8, seed=6), randn(5, seed=7), randn(3, 8, seed=8)
    partial_sum = torch.zeros(3, 5)
    for rank in range(2):
        layer = RowParallelLinear(8, 5, bias=True, tp_rank=rank, tp_size=2)
        assert layer.weight.shape == (5, 4)
        layer.load_checkpoint_weight("weight", full)
        layer.load_checkpoint_weight("bias", bias)
        torch.testing.assert_close(layer.weight, full[:, rank * 4 : (rank + 1) * 4])
        partial_sum += layer(x[:, rank * 4 : (rank + 1) * 4])
    torch.testing.assert_close(partial_sum, F.linear(x, full, bias))


def test_row_parallel_forward_without_a_communicator_raises():
    layer = RowParallelLinear(8, 5, tp_rank=0, tp_size=2)
    with pytest.raises(RuntimeError, match="without a communicator"):
        layer(torch.zeros(1, 4))


def test_qkv_tensor_parallel_slices_heads():
    head = 2
    q, k, v = randn(8 * head, 4, seed=1), randn(4 * head, 4, seed=2), randn(4 * head, 4, seed=3)
    for rank in range(2):
        layer = QKVParallelLinear(4, head, total_num_heads=8, total_num_kv_heads=4, tp_rank=rank, tp_size=2)
        assert (layer.num_heads, layer.num_kv_heads, layer.weight.shape[0]) == (4, 2, (4 + 2 * 2) * head)
        for shard_id, tensor in zip("qkv", (q, k, v)):
            layer.load_checkpoint_weight("weight", tensor, shard_id)
        expected = torch.cat([q[rank * 8 : (rank + 1) * 8], k[rank * 4 : (rank + 1) * 4], v[rank * 4 : (rank + 1) * 4]])
        torch.testing.assert_close(layer.weight, expected)


def test_qkv_replicates_kv_heads_when_ranks_outnumber_them():
    head = 2
    k = randn(2 * head, 4, seed=2)
    for rank in range(4):
        layer = QKVParallelLinear(4, head, total_num_heads=4, total_num_kv_heads=2, tp_rank=rank, tp_size=4)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (1, 1, 2)
        layer.load_checkpoint_weight("weight", k, "k")
        kv_head = rank // 2
        torch.testing.assert_close(layer.weight[head : 2 * head], k[kv_head * head : (kv_head + 1) * head])


def test_merged_column_tensor_parallel_offsets():
    gate, up = randn(8, 3, seed=1), randn(8, 3, seed=2)
    layer = MergedColumnParallelLinear(3, [8, 8], tp_rank=1, tp_size=2)
    layer.load_checkpoint_weight("weight", gate, 0)
    layer.load_checkpoint_weight("weight", up, 1)
    torch.testing.assert_close(layer.weight, torch.cat([gate[4:], up[4:]]))


def test_indivisible_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        ColumnParallelLinear(4, 7, tp_size=2)
    with pytest.raises(ConfigError, match="attention heads"):
        QKVParallelLinear(4, 2, total_num_heads=3, total_num_kv_heads=1, tp_size=2)
    with pytest.raises(ConfigError, match="rank 2"):
        ColumnParallelLinear(4, 8, tp_rank=2, tp_size=2)


class PackedTensor:
    def __init__(self, tensor):
        self.tensor = tensor

    def dequantize(self):
        return self.tensor


def test_packed_weights_load_whole_but_cannot_be_split():
    weight = randn(4, 6)
    layer = ColumnParallelLinear(6, 4)
    layer.load_checkpoint_weight("weight", PackedTensor(weight))
    torch.testing.assert_close(layer.weight, weight)
    with pytest.raises(ModelLoadError, match="tensor parallelism"):
        ColumnParallelLinear(6, 8, tp_size=2).load_checkpoint_weight("weight", PackedTensor(randn(8, 6)))


class RecordingMethod(UnquantizedMethod):
    """Records how layers use their quantization method."""

    name = "recording"

    def __init__(self):
        self.loads, self.processed = [], []

    def load_weight(self, layer, loaded_weight, output_offset, output_size):
        self.loads.append((output_offset, output_size, tuple(loaded_weight.shape)))
        super().load_weight(layer, loaded_weight, output_offset, output_size)

    def process_weights_after_loading(self, layer):
        self.processed.append(layer)


def test_quant_method_receives_shard_rows_and_post_load_call():
    method = RecordingMethod()
    qkv = QKVParallelLinear(8, 2, total_num_heads=4, total_num_kv_heads=2, quant_method=method)
    out = RowParallelLinear(8, 8, quant_method=method)
    for shard_id, rows in zip("qkv", (8, 4, 4)):
        qkv.load_checkpoint_weight("weight", randn(rows, 8), shard_id)
    assert method.loads == [(0, 8, (8, 8)), (8, 4, (4, 8)), (12, 4, (4, 8))]
    model = torch.nn.ModuleList([qkv, out])
    process_weights_after_loading(model)
    assert method.processed == [qkv, out]


# -- tensor parallelism through a communicator ----------------------------------------------


class SummingGroup:
    """One rank's view of a group whose all-reduce adds the other ranks' partials (given)."""

    def __init__(self, rank: int, size: int, others=None):
        self.rank, self.size, self.others = rank, size, others
        self.reduced = []

    def all_reduce(self, tensor):
        self.reduced.append(tensor.dtype)
        return tensor + self.others if self.others is not None else tensor


def test_layers_take_rank_and_size_from_their_communicator():
    group = SummingGroup(1, 2)
    layer = QKVParallelLinear(4, 2, total_num_heads=8, total_num_kv_heads=4, tp_group=group)
    assert (layer.tp_rank, layer.tp_size, layer.num_heads, layer.num_kv_heads) == (1, 2, 4, 2)
    assert MergedColumnParallelLinear(3, [8, 8], tp_group=group).weight.shape == (8, 3)
    assert RowParallelLinear(8, 5, tp_group=group).weight.shape == (5, 4)


def test_row_parallel_sums_through_the_group_with_the_bias_once():
    full, bias, x = randn(5, 8, seed=6), randn(5, seed=7), randn(3, 8, seed=8)
    rank1 = RowParallelLinear(8, 5, bias=True, tp_group=SummingGroup(1, 2))
    rank1.load_checkpoint_weight("weight", full)
    rank1.load_checkpoint_weight("bias", bias)
    partial1 = rank1(x[:, 4:])  # no bias on rank 1
    rank0 = RowParallelLinear(8, 5, bias=True, tp_group=SummingGroup(0, 2, others=partial1))
    rank0.load_checkpoint_weight("weight", full)
    rank0.load_checkpoint_weight("bias", bias)
    torch.testing.assert_close(rank0(x[:, :4]), F.linear(x, full, bias))


def test_16_bit_partials_are_summed_in_float32():
    group = SummingGroup(0, 2)
    layer = RowParallelLinear(8, 5, params_dtype=torch.bfloat16, tp_group=group)
    layer.load_checkpoint_weight("weight", randn(5, 8))
    out = layer(randn(2, 4).bfloat16())
    assert group.reduced == [torch.float32] and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,tp_size",
    [(4, 2, 2), (6, 3, 3), (8, 2, 4), (4, 1, 2), (4, 1, 4), (9, 3, 3), (8, 4, 2), (16, 4, 8)],
)
def test_each_rank_holds_the_kv_head_its_query_heads_read(num_heads, num_kv_heads, tp_size):
    """Query head h reads KV head h // (num_heads / num_kv_heads); every rank's KV slice must
    hold exactly the KV heads of its query heads, replicated or split."""
    head = 2
    k = torch.arange(num_kv_heads * head * 4, dtype=torch.float32).view(num_kv_heads * head, 4)
    group_size = num_heads // num_kv_heads
    for rank in range(tp_size):
        layer = QKVParallelLinear(4, head, num_heads, num_kv_heads, tp_rank=rank, tp_size=tp_size)
        layer.load_checkpoint_weight("weight", k, "k")
        query_heads = range(rank * layer.num_heads, (rank + 1) * layer.num_heads)
        needed = sorted({h // group_size for h in query_heads})
        assert len(needed) == layer.num_kv_heads
        held = layer.weight[layer.q_size : layer.q_size + layer.kv_size]
        torch.testing.assert_close(held, torch.cat([k[h * head : (h + 1) * head] for h in needed]))
        # the per-rank head count the KV cache is shaped with
        assert kv_heads_per_rank(num_kv_heads, tp_size)[0] == layer.num_kv_heads


def test_heads_that_do_not_divide_name_the_numbers_and_the_flag():
    with pytest.raises(ConfigError, match=r"attention heads \(9\).*\(2\).*--tensor-parallel-size"):
        QKVParallelLinear(576, 64, 9, 3, tp_size=2)
    with pytest.raises(ConfigError, match=r"KV heads \(2\).*\(3\)"):
        kv_heads_per_rank(2, 3)
    with pytest.raises(ConfigError, match=r"KV heads \(4\).*\(3\)"):
        QKVParallelLinear(4, 2, 6, 4, tp_size=3)
