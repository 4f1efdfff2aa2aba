"""The real `tokenloom serve --attention-backend triton` on the CPU, its Triton kernels run by
Triton's interpreter (TRITON_INTERPRET=1): over HTTP with the openai client, greedy completions
of the tiny random Llama equal the torch attention backend's (SmolLM2's 30 layers take minutes
interpreted); and `tokenloom serve smollm2` refuses a backend name that does not exist and the
Triton backend on a CPU without the interpreter, with what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the `gpu` extra)")

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):\n", "1, 2, 3, 4,"]
MAX_TOKENS = 8
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def triton_server(tmp_path_factory, tiny_llama_dir):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    try:
        server = start_server(
            [tiny_llama_dir, "--served-model-name", "tiny", *SERVE_ARGS, "--attention-backend", "triton"], log_path
        )
    finally:
        monkeypatch.undo()
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def torch_backend_texts(tiny_llama_dir):
    from tokenloom import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, attention_backend="torch")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [output.outputs[0].text for output in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.shutdown()


def test_greedy_completions_over_http_equal_the_torch_backends(triton_server, torch_backend_texts):
    from openai import OpenAI

    client = OpenAI(base_url=triton_server.base_url + "/v1", api_key="unused")
    completion = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    texts = [choice.text for choice in sorted(completion.choices, key=lambda choice: choice.index)]
    assert texts == torch_backend_texts
    assert all(text for text in texts)


def _serve_fails(args: list[str], env_extra: dict[str, str]) -> str:
    import os

    env = dict(os.environ, PYTHONPATH=REPO_ROOT, **env_extra)
    env.pop("TRITON_INTERPRET", None) if "TRITON_INTERPRET" not in env_extra else None
    result = subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", "smollm2", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=240,
    )
    assert result.returncode != 0
    return result.stdout + result.stderr


def test_an_unknown_backend_name_is_refused_with_the_known_ones():
    output = _serve_fails(["--attention-backend", "FLASH_ATTN"], {})
    assert "no attention backend 'FLASH_ATTN'" in output and "triton" in output
    output = _serve_fails([], {"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    assert "VLLM_ATTENTION_BACKEND: no attention backend 'FLASHINFER'" in output


def test_the_triton_backend_on_the_cpu_without_the_interpreter_says_what_to_set():
    output = _serve_fails([*SERVE_ARGS, "--attention-backend", "triton"], {"TRITON_INTERPRET": "0"})
    assert "TRITON_INTERPRET=1" in output
    assert "Traceback" not in output
