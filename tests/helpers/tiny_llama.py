"""The suite's tiny Llama: the transformers config most tests build a random checkpoint from
(two layers, 64 wide, 4 query / 2 KV heads), over a tokenizer's vocabulary."""

from __future__ import annotations


def tiny_llama_config(tokenizer, **overrides):
    """A ``LlamaConfig`` with ``tokenizer``'s vocabulary and special ids, a tied head and 256
    positions, ``overrides`` applied."""
    from transformers import LlamaConfig

    options = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return LlamaConfig(**{**options, **overrides})
