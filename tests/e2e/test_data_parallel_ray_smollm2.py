"""`tokenloom serve smollm2 -dp 2 --data-parallel-backend ray`: two engine replicas as Ray
actors on a local Ray the server starts, behind the one API; a small request set (the full
server module runs against `-dp 2` under mp, tests/e2e/test_server_smollm2.py), then the server
stops and takes Ray and its actors with it."""

from __future__ import annotations

import asyncio

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import API_KEY, serve_smollm2, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    yield from serve_smollm2(tmp_path_factory, ["-dp", "2", "--data-parallel-backend", "ray"])


@pytest.fixture(scope="module")
def client(ray_server):
    return openai.OpenAI(base_url=ray_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_greedy_completion_streamed_equals_whole_and_chat_answers(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert whole.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content


def test_concurrent_requests_use_both_replicas_and_metrics_sum_them(ray_server):
    async def run():
        async with openai.AsyncOpenAI(
            base_url=ray_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"Count from {i}:", max_tokens=10, temperature=0)
                    for i in range(8)
                )
            )

    before = generation_tokens(ray_server)
    results = asyncio.run(run())
    assert all(result.usage.completion_tokens == 10 for result in results)
    assert generation_tokens(ray_server) - before == 80
    assert "data parallel: 2 replicas (ray backend) ready" in ray_server.log()


def generation_tokens(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


def test_stopping_the_server_leaves_no_ray_process(ray_server):
    descendants = psutil.Process(ray_server.process.pid).children(recursive=True)
    assert any("ray" in " ".join(proc.cmdline()).lower() for proc in descendants)  # Ray ran under the server
    stop_server(ray_server)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not [proc for proc in alive if proc.status() != psutil.STATUS_ZOMBIE], alive
