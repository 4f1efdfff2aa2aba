"""``DeviceConfig``: the platform plugin and the paged-attention backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeviceConfig:
    device: str = "auto"
    """Device platform plugin; ``auto`` picks the available one of highest priority (a GPU
    before the CPU)."""
    attention_backend: str = "auto"
    """Paged attention backend: auto (the platform's choice), torch, cpu_native, reference or
    triton (on the CPU only under TRITON_INTERPRET=1); vLLM's names (TORCH_SDPA, TRITON_ATTN)
    are accepted. Unset, the TOKENLOOM_ATTENTION_BACKEND or VLLM_ATTENTION_BACKEND environment
    variable decides."""
