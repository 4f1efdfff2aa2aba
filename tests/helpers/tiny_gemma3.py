"""The suite's tiny Gemma 3 text model: the transformers config several tests build a random
checkpoint from (two layers, 64 wide, 4 query / 2 KV heads of 32, a sliding window of 8 tokens in
the first layer), over a tokenizer's vocabulary."""

from __future__ import annotations


def tiny_gemma3_config(tokenizer, **overrides):
    """A ``Gemma3TextConfig`` with ``tokenizer``'s vocabulary and special ids and 256 positions,
    ``overrides`` applied."""
    from transformers import Gemma3TextConfig

    options = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=8,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    return Gemma3TextConfig(**{**options, **overrides})
