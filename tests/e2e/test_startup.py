"""Start-up of the real `tokenloom serve smollm2`: a second start takes the tokenizer from the
cache the first one wrote, and serves exactly the same tokens; serving imports no
structured-output backend before a request asks for one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server
from tokenloom.builtin_plugins.loaders.derived_cache import CACHE_DIR_ENV, cache_root
from tokenloom.builtin_plugins.loaders.gguf_tokenizer import TOKENIZER_CACHE_KIND

pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> 日本 🤗"}]
OPTIONAL_BACKENDS = ("xgrammar", "outlines", "outlines_core", "lmformatenforcer", "llguidance")


def _tokenize(server) -> tuple[list[int], list[int]]:
    chat = httpx.post(server.base_url + "/tokenize", json={"model": "smollm2", "messages": CHAT}).json()
    prompt = httpx.post(
        server.base_url + "/tokenize", json={"model": "smollm2", "prompt": "<|im_start|>user\nhello there<|im_end|>"}
    ).json()
    return chat["tokens"], prompt["tokens"]


def test_a_second_start_takes_the_tokenizer_from_the_cache_and_serves_the_same_tokens(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    kernels = cache_root() / "kernels"
    if kernels.is_dir():  # the compiled CPU kernels stay where they are: no rebuild for this test
        (cache / "kernels").symlink_to(kernels)
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache))
    tokens = []
    for start in ("first", "second"):
        server = start_server(["smollm2", "--max-model-len", "1024"], str(tmp_path / f"{start}.log"))
        try:
            tokens.append(_tokenize(server))
        finally:
            stop_server(server)
        built = "built the tokenizer of" in server.log()
        assert built == (start == "first"), server.log()[-3000:]
        assert len(list((cache / TOKENIZER_CACHE_KIND).glob("*.entry"))) == 1
    assert tokens[0] == tokens[1]
    assert tokens[0][0][:3] == [1, 9690, 198]  # <|im_start|>system\n


def test_serving_imports_no_structured_output_backend_before_a_request_needs_one():
    probe = textwrap.dedent(f"""
        import asyncio, json, sys
        from tokenloom.api.app import build_app
        from tokenloom.api.server_config import ServerConfig
        from tokenloom.core.config import EngineArgs
        from tokenloom.core.engine import AsyncLLM
        from tokenloom.plugins.manager import load_plugins

        plugins = load_plugins()
        engine = AsyncLLM.from_engine_args(EngineArgs(model="smollm2", max_model_len=1024), plugins)
        build_app(engine, plugins, ServerConfig())
        print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in {OPTIONAL_BACKENDS!r})))
        asyncio.run(engine.shutdown())
    """)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
