"""Speculative decoding on a model with sliding-window layers (a tiny random Gemma 3: a window of
8 tokens, q/k norms, soft caps, so its layers take the Python path, not the fused decode
operator), through the real engine: by n-gram prompt lookup and by the target as its own draft,
the greedy token ids of plain decoding, with every draft of the self-draft accepted, while the
prompts and the verified runs of drafts reach far past the window (a verify step's rows each
see their own window of the cache). The real Gemma 3 270M GGUF speculates over HTTP in
tests/e2e/test_spec_decode_gemma3.py."""

from __future__ import annotations

import pytest
from helpers.model_parity import randomize_parameters
from helpers.tiny_gemma3 import tiny_gemma3_config

from tests.core.spec_decode.test_spec_decode_engine import NGRAM, PROMPTS, PROPOSERS, greedy, token_ids
from tokenloom import LLM

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, smollm2_gguf):
    from transformers import Gemma3ForCausalLM

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    directory = tmp_path_factory.mktemp("tiny-gemma3-spec")
    tokenizer = GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)
    tokenizer.save_pretrained(directory)
    config = tiny_gemma3_config(tokenizer, sliding_window=WINDOW, num_key_value_heads=1, final_logit_softcapping=30.0)
    # weights large enough that greedy decoding does not repeat one token and attention depends
    # on position (so a window applied wrongly changes the tokens)
    model = randomize_parameters(Gemma3ForCausalLM(config).eval(), seed=0)
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


@pytest.fixture(scope="module")
def plain_ids(tiny_gemma3_dir):
    llm = LLM(model=tiny_gemma3_dir, dtype="float32")
    return token_ids(llm, PROMPTS, greedy()), token_ids(llm, PROMPTS[1], greedy(max_tokens=60))


def spec_stats(llm: LLM):
    stats = llm.engine.stats().spec_decoding
    assert stats is not None
    return stats


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_greedy_ids_equal_plain_decoding_past_the_window(tiny_gemma3_dir, plain_ids, method):
    config = (
        NGRAM
        if method == "ngram"
        else {
            "method": "draft_model",
            "model": tiny_gemma3_dir,
            "num_speculative_tokens": 3,
            "adaptive_num_speculative_tokens": False,
        }
    )
    llm = LLM(model=tiny_gemma3_dir, dtype="float32", plugins=PROPOSERS, speculative_config=config)
    batch, single = plain_ids
    assert all(len(ids) == 40 for ids in batch)  # 40 tokens: five windows
    assert token_ids(llm, PROMPTS, greedy()) == batch
    assert token_ids(llm, PROMPTS[1], greedy(max_tokens=60)) == single
    stats = spec_stats(llm)
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if method == "self-draft":
        # the draft is the target: its greedy drafts are the target's argmax, every one accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
