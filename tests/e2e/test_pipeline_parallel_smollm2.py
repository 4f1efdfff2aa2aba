"""`tokenloom serve smollm2 -pp 2` (two pipeline stages in worker processes, float32): greedy
completions over HTTP, one at a time and four at once (batches in flight together), carry
exactly the token ids of one worker running the same model offline."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import start_server, stop_server
from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "Q: What is 12 times 7?\nA:",
    "Les fleurs du printemps",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def one_worker_ids(smollm2_gguf):
    llm = LLM(model=smollm2_gguf, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def pp_server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("pp-server") / "serve.log")
    server = start_server(
        ["smollm2", "-pp", "2", "--dtype", "float32", "--max-model-len", "512"], log_path, timeout=360.0
    )
    yield server
    stop_server(server)


def completion_ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


EXTRA = {"ignore_eos": True, "return_token_ids": True}


def test_one_request_at_a_time_matches_one_worker(pp_server, one_worker_ids):
    client = OpenAI(base_url=pp_server.base_url + "/v1", api_key="unused")
    for prompt, expected in zip(PROMPTS, one_worker_ids, strict=True):
        response = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=EXTRA
        )
        assert completion_ids(response.choices[0]) == expected


def test_concurrent_requests_match_one_worker(pp_server, one_worker_ids):
    async def run() -> list[list[int]]:
        client = AsyncOpenAI(base_url=pp_server.base_url + "/v1", api_key="unused")
        try:
            responses = await asyncio.gather(
                *(
                    client.completions.create(
                        model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=EXTRA
                    )
                    for prompt in PROMPTS
                )
            )
        finally:
            await client.close()
        return [completion_ids(response.choices[0]) for response in responses]

    assert asyncio.run(run()) == one_worker_ids
