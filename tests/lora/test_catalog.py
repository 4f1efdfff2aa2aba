"""The engine's adapter catalogue (``tokenloom/lora/catalog.py``) facing paths a client chose:
every path that leads to no readable adapter gets one and the same answer, so the answers do not
tell which paths exist on the server; a request that may not name a Hub repo never reaches the
source that downloads one; weights are checked in the ``--lora-dtype`` when it is given."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.lora.test_peft import Q_A, tensors, write_adapter
from tokenloom.lora.catalog import LoRACatalog
from tokenloom.lora.peft import LoRAAdapterError
from tokenloom.lora.request import LoRARequest

HF_CONFIG = SimpleNamespace(
    hidden_size=8,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=16,
    num_hidden_layers=1,
    vocab_size=32,
)


def local_only(tag: str, allow_hub: bool) -> str:
    """The local model source's behaviour: a path, absolute, that must exist."""
    path = os.path.abspath(tag)
    if not os.path.exists(path):
        raise RuntimeError(f"model path {path} does not exist")
    return path


def catalog(resolve_path=local_only, dtype=None):
    return LoRACatalog(max_lora_rank=4, hf_config=HF_CONFIG, resolve_path=resolve_path, model_name="m", dtype=dtype)


def test_every_unusable_path_gets_the_same_message(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    unreadable = tmp_path / "unreadable"
    write_adapter(unreadable, tensors())
    os.chmod(unreadable / "adapter_config.json", 0)
    paths = ["/nowhere/at/all", str(tmp_path / "a-file"), str(tmp_path / "empty"), str(no_weights), "/etc", "/"]
    if os.geteuid() != 0:  # root reads whatever the mode says
        paths.append(str(unreadable))
    messages = set()
    for index, path in enumerate(paths):
        with pytest.raises(LoRAAdapterError) as refused:
            catalog().resolve(LoRARequest("x", index + 1, path))
        assert refused.value.status_code == 400 and refused.value.param == "lora_path"
        messages.add(refused.value.message.replace(repr(path), "PATH"))
    assert len(messages) == 1, messages
    (message,) = messages
    assert "is not a usable adapter" in message and "adapter_config.json" in message
    assert "does not exist" not in message


def test_a_request_without_allow_hub_never_reaches_the_hub(tmp_path):
    seen = []

    def resolve_path(tag, allow_hub):
        seen.append((tag, allow_hub))
        raise RuntimeError(f"{tag!r} is not in the local Hugging Face cache")

    with pytest.raises(LoRAAdapterError, match="'org/adapter' is not a usable adapter"):
        catalog(resolve_path).resolve(LoRARequest("x", 1, "org/adapter", allow_hub=False))
    assert seen == [("org/adapter", False)]


def test_the_real_engine_skips_the_hub_source_for_such_a_request(monkeypatch):
    from tokenloom.core.config import ModelConfig
    from tokenloom.core.model_loader import resolve_source
    from tokenloom.errors import ModelLoadError
    from tokenloom.plugins.manager import load_plugins

    plugins = load_plugins()
    hub = sys.modules.get("huggingface_hub")
    if hub is not None:
        monkeypatch.setattr(hub, "snapshot_download", lambda *args, **kwargs: pytest.fail("downloaded"))
    with pytest.raises(ModelLoadError, match="no model source recognises 'org/adapter'"):
        resolve_source("org/adapter", plugins, ModelConfig(model="x"), None, skip_sources=("huggingface",))


def test_weights_are_checked_in_the_lora_dtype(tmp_path):
    source = tensors()
    source[Q_A] = torch.full_like(source[Q_A], 1e6)  # beyond float16
    path = write_adapter(tmp_path / "a", source)
    catalog(dtype=torch.bfloat16).resolve(LoRARequest("x", 1, path))
    with pytest.raises(LoRAAdapterError, match="beyond float16's range"):
        catalog(dtype=torch.float16).resolve(LoRARequest("x", 1, path))
