"""``CacheConfig``: the paged KV cache (block size, memory, prefix caching, cache dtype)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device's memory the engine may use: on a GPU, of its total memory, for
    weights, activations and KV cache together (as in vLLM); on the CPU, of available RAM for
    the KV cache (capped at 4 GiB unless ``--kv-cache-memory-bytes`` is given)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of memory for the KV cache; overrides the utilization-based size."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV-cache blocks (testing, preemption experiments)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (on by default, as in vLLM v1)."""
    prefix_caching_hash_algo: str = "sha256"
    """Hash of prefix-cache keys: sha256 (collision resistant, the default) or builtin
    (Python's hash(): a little faster, but a crafted collision is easy; every hit is still
    checked against the block's token ids, so a collision costs a miss, never another
    request's KV)."""
    cache_dtype: str = "auto"
    """KV-cache data type: ``auto`` (the model's dtype), ``bfloat16``, or an 8-bit float
    cache holding twice the tokens in the same memory: ``fp8`` (= ``fp8_e4m3``) or
    ``fp8_e5m2``, scaled per layer by k_scale/v_scale (1.0, or see
    ``--calculate-kv-scales``). ``fp8_inc`` (Intel Gaudi) is refused."""
    calculate_kv_scales: bool = False
    """With an fp8 KV cache: set each layer's k_scale and v_scale from the first step's keys
    and values (max |k| / 200, max |v| / 100, as vLLM) instead of 1.0."""
