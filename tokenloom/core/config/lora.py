"""``LoRAConfig``: LoRA adapters served beside the base model."""

from __future__ import annotations

from dataclasses import dataclass

LORA_DTYPE_CHOICES = ("auto", "float16", "bfloat16", "float32")


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) beside the base model: requests pick one by name."""
    max_loras: int = 1
    """Distinct LoRA adapters that can run in one batch (the worker's adapter slots)."""
    max_lora_rank: int = 16
    """The largest LoRA rank served; an adapter of a higher rank is refused."""
    max_cpu_loras: int | None = None
    """LoRA adapters kept read in memory (least recently used leave first); at least
    --max-loras, which is the default."""
    lora_dtype: str = "auto"
    """Data type of the LoRA weights and their matmuls: auto (the model's), float16, bfloat16,
    float32."""
