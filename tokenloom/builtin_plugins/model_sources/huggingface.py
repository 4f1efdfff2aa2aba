"""The ``huggingface`` model source: a Hub repo id (``org/name``), from the local Hugging Face
cache when it is there, else downloaded with ``huggingface_hub.snapshot_download``.

Never hangs without a network: the cache is tried first (``local_files_only``), and a download
is only attempted after a short reachability check of the Hub.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from urllib.parse import urlparse

from tokenloom.plugin_api import ModelLoadError, ModelSource, ResolvedModel

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a model needs; a GGUF repo's many quantized files are left alone (pass one .gguf path instead)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
FALLBACK_WEIGHT_PATTERNS = ["*.bin", "*.pt"]
REACHABILITY_TIMEOUT_S = 5.0
_TRUE_VALUES = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, read now rather than at import."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE_VALUES for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_reachable(endpoint: str | None = None, timeout: float = REACHABILITY_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub opens within ``timeout`` (DNS included)."""
    from huggingface_hub import constants

    parsed = urlparse(endpoint or constants.ENDPOINT)
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    # name resolution ignores socket timeouts, so the whole probe runs under a deadline
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _no_network_error(model: str, reason: str) -> ModelLoadError:
    return ModelLoadError(
        f"{model!r} is not in the local Hugging Face cache and {reason}, so it cannot be downloaded. "
        f"Download it elsewhere and pass its local directory (or .gguf file) as the model, e.g. "
        f"`tokenloom serve /path/to/{model.split('/')[-1]}`, or use a packaged model such as `smollm2`"
    )


class HuggingFaceModelSource(ModelSource):
    """``org/name`` repo ids that are not also local paths."""

    def matches(self, model: str) -> bool:
        return bool(REPO_ID.match(model)) and not os.path.exists(os.path.expanduser(model))

    def resolve(self, model, *, revision=None, download_dir=None) -> ResolvedModel:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        try:
            path = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
            return ResolvedModel(path=path, name=model, source="huggingface")
        except HFValidationError as exc:
            raise ModelLoadError(f"{model!r} is not a valid Hugging Face repo id: {exc}") from exc
        except LocalEntryNotFoundError:
            pass
        if hub_offline():
            raise _no_network_error(model, "HF_HUB_OFFLINE is set (there is no network)")
        if not hub_reachable():
            raise _no_network_error(model, "the Hugging Face Hub is unreachable (there is no network)")
        try:
            path = snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS)
            if not any(name.endswith(".safetensors") for name in os.listdir(path)):
                path = snapshot_download(
                    model,
                    revision=revision,
                    cache_dir=download_dir,
                    allow_patterns=ALLOW_PATTERNS + FALLBACK_WEIGHT_PATTERNS,
                )
        except Exception as exc:  # huggingface_hub raises many HTTP/IO kinds; all mean "not downloaded"
            raise ModelLoadError(
                f"cannot download {model!r} from the Hugging Face Hub: {type(exc).__name__}: {exc}"
            ) from exc
        return ResolvedModel(path=path, name=model, source="huggingface")
