"""``LoadConfig``: the weight format plugin and where model files come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LoadConfig:
    load_format: str = "auto"
    """Weight format plugin: auto, safetensors, pt, gguf, dummy, or one a plugin adds."""
    download_dir: str | None = None
    """Directory to download and cache Hugging Face models in."""
    ignore_patterns: list[str] | None = None
    """Glob patterns of model files not to load (e.g. ``original/**/*``)."""
    use_tqdm_on_load: bool = True
    """Show a progress bar while loading weights."""
    model_loader_extra_config: dict[str, Any] | None = None
    """Extra options for the load format plugin."""
