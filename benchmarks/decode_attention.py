"""Decode attention of SmolLM2's shape (9 query / 3 KV heads of 64, bfloat16, blocks of 16) over
30 layers' caches, as in a decode step (each layer's cache read from memory, not from the CPU
caches): the native kernel against the torch backend, for 1, 8 and 32 sequences of 257-384
cached tokens in scattered blocks; and the memory's own read speed (a sum over the caches).
Then one sequence of ~300 cached tokens verifying R = 1, 2, 5, 9 rows (its pending token and
R - 1 drafts: rows of one block table with consecutive lengths), the native kernel alone.

  python benchmarks/decode_attention.py [verify | cached] [--heads Q:KV]   (verify: only the
      verifying sequence; cached: the native kernel's arithmetic, its caches in L2 (8, 4, 2
      sequences of 16, 32, 64 keys: TSC cycles a key and KV head, at 2.6 GHz) and one layer's
      cache of 8 sequences of 257-384 keys (L3) against 30 layers' (memory); --heads: another
      model's query and KV heads of 64, e.g. 32:32 for SmolLM2-1.7B; --huge-pages: the caches
      moved onto 2 MiB pages first, as the CPU platform maps the served KV cache)
"""

import random
import sys
import time

import torch

from tokenloom.core.batch import AttentionMetadata
from tokenloom.kernels import cpu_native, huge_pages
from tokenloom.kernels.paged_attention import TorchPagedAttention

ops = cpu_native.load()
random.seed(0)
torch.manual_seed(0)
num_q_heads, num_kv_heads, head_size, block_size = 9, 3, 64, 16
if "--heads" in sys.argv:  # another model's heads, e.g. --heads 32:32 (SmolLM2-1.7B)
    at = sys.argv.index("--heads")
    num_q_heads, num_kv_heads = (int(part) for part in sys.argv[at + 1].split(":"))
    del sys.argv[at : at + 2]
huge = "--huge-pages" in sys.argv
if huge:
    sys.argv.remove("--huge-pages")


def per_30_layers(function, caches, repeats=5):
    for cache in caches:
        function(cache)
    started = time.perf_counter()
    for _ in range(repeats):
        for cache in caches:
            function(cache)
    return (time.perf_counter() - started) / repeats * 1e3


def verify_rows_case():
    num_blocks = 25 + 50
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).bfloat16() for _ in range(30)]
    order = torch.randperm(num_blocks)
    for rows in (1, 2, 5, 9):
        context_len = 300  # cached tokens before the pending one
        seq_lens = torch.arange(context_len + 1, context_len + 1 + rows)
        block_tables = order[: -(-int(seq_lens[-1]) // block_size)].unsqueeze(0).expand(rows, -1).contiguous()
        query = torch.randn(rows, num_q_heads, head_size).bfloat16()
        output = torch.empty_like(query)

        def native_attention(cache):
            return ops.paged_decode_attention(output, query, cache, block_tables, seq_lens, head_size**-0.5, 0, 0.0)  # noqa: B023

        best = min(per_30_layers(native_attention, caches, repeats=20) for _ in range(5))
        print(f"1 sequence verifying {rows} rows (~{context_len} cached tokens): native {best:.3f} ms per 30 layers")


def scattered_tables(batch: int, num_blocks: int) -> tuple[list[int], torch.Tensor]:
    """``batch`` sequences of 257-384 cached tokens and their block tables, the blocks scattered
    over the cache in a random order."""
    seq_lens = [random.randint(257, 384) for _ in range(batch)]
    order = torch.randperm(num_blocks)
    tables = torch.zeros(batch, max(-(-length // block_size) for length in seq_lens), dtype=torch.long)
    used = 0
    for row, length in enumerate(seq_lens):
        count = -(-length // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    return seq_lens, tables


def cached_case():
    """The kernel with its caches in L2 (short sequences), in L3 (one layer) and in memory."""
    scale = head_size**-0.5
    for num_keys, batch in ((16, 8), (32, 4), (64, 2)):
        blocks = batch * -(-num_keys // block_size)
        tables = torch.arange(blocks).view(batch, -1)
        cache = torch.randn(2, blocks, block_size, num_kv_heads, head_size).bfloat16()
        query = torch.randn(batch, num_q_heads, head_size).bfloat16()
        output, lens = torch.empty_like(query), torch.full((batch,), num_keys)
        repeats = 20000 // (num_keys * batch)
        for _ in range(repeats):  # warm-up: the cache, the thread pool
            ops.paged_decode_attention(output, query, cache, tables, lens, scale, 0, 0.0)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(repeats):
                ops.paged_decode_attention(output, query, cache, tables, lens, scale, 0, 0.0)
            best = min(best, (time.perf_counter() - started) / repeats)
        cycles = best * torch.get_num_threads() * 2.6e9 / (batch * num_keys * num_kv_heads)
        print(
            f"{batch} sequences x {num_keys} keys (L2): {best * 1e6:.1f} us, {cycles:.1f} TSC cycles a key and KV head"
        )
    batch = 8
    num_blocks = batch * 25 + 50
    seq_lens, tables = scattered_tables(batch, num_blocks)
    query = torch.randn(batch, num_q_heads, head_size).bfloat16()
    output, lens = torch.empty_like(query), torch.tensor(seq_lens)
    layer_bytes = sum(seq_lens) * num_kv_heads * head_size * 2 * 2
    for copies, repeats, where in ((1, 60, "one layer's cache: L3"), (30, 3, "30 layers' caches: memory")):
        caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).bfloat16() for _ in range(copies)]
        if huge:
            print(f"on huge pages: {huge_pages.collapse(caches) / 2**20:.0f} MiB")
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(repeats):
                for cache in caches:
                    ops.paged_decode_attention(output, query, cache, tables, lens, scale, 0, 0.0)
            best = min(best, (time.perf_counter() - started) / (repeats * copies))
        print(f"8 sequences of 257-384 keys, {where}: {best * 1e3:.3f} ms a layer, {layer_bytes / best / 1e9:.1f} GB/s")


if sys.argv[1:] == ["cached"]:
    print(f"kernel level: {cpu_native.selected_level().name}, {torch.get_num_threads()} threads")
    cached_case()
    sys.exit(0)

if sys.argv[1:] == ["verify"]:
    print(f"kernel level: {cpu_native.selected_level().name}, {torch.get_num_threads()} threads")
    verify_rows_case()
    sys.exit(0)

for batch in (1, 8, 32):
    num_blocks = batch * 25 + 50
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).bfloat16() for _ in range(30)]
    seq_lens, block_tables = scattered_tables(batch, num_blocks)
    query = torch.randn(batch, num_q_heads, head_size).bfloat16()
    new_kv = torch.randn(batch, num_kv_heads, head_size).bfloat16()
    lens = torch.tensor(seq_lens)
    output = torch.empty_like(query)
    slots = torch.tensor(
        [
            int(block_tables[row, (length - 1) // block_size]) * block_size + (length - 1) % block_size
            for row, length in enumerate(seq_lens)
        ]
    )
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1),
        seq_lens=lens,
        block_tables=block_tables,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        kv_caches=caches,
    )
    torch_backend = TorchPagedAttention()

    # each lambda runs inside per_30_layers, within this iteration, so binding the loop's names is right
    def native_attention(cache):
        return ops.paged_decode_attention(output, query, cache, block_tables, lens, head_size**-0.5, 0, 0.0)  # noqa: B023

    def torch_attention(cache):
        return torch_backend.forward(query, new_kv, new_kv, cache, metadata, scale=head_size**-0.5)  # noqa: B023

    native = per_30_layers(native_attention, caches)
    reference = per_30_layers(torch_attention, caches)
    read = per_30_layers(lambda cache: cache.sum(), caches)
    read_bytes = sum(seq_lens) * num_kv_heads * head_size * 2 * 2 * 30
    print(
        f"{batch:2d} sequences, {read_bytes / 1e6:.0f} MB of K/V: native {native:.2f} ms, torch {reference:.2f} ms "
        f"per 30 layers; memory reads {caches[0].numel() * 2 * 30 / read / 1e6:.1f} GB/s"
    )

verify_rows_case()
