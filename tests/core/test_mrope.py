"""M-RoPE positions (core/multimodal/mrope.py) against transformers' ``get_rope_index`` for
prompts with images of different grids, at any chunk of the prompt and past it (decode: the
index plus the prompt's delta); the step positions the runner hands a model; and
:class:`~tokenloom.layers.mrope.MRotaryEmbedding` against transformers' Qwen2-VL rotation."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from tokenloom.core.multimodal.inputs import MultiModalItem
from tokenloom.core.multimodal.mrope import MROPE_GRID, mrope_positions, step_positions
from tokenloom.layers.mrope import get_mrope

IMAGE_TOKEN = 9


def image_item(offset: int, grid: tuple[int, int, int]) -> MultiModalItem:
    frames, height, width = grid
    return MultiModalItem("image", f"{offset:064x}", offset, frames * height * width, {MROPE_GRID: grid})


# text, a 2 x 3 image, text, a 4 x 1 image, text (grids in the language model's merged tokens)
ITEMS = [image_item(3, (1, 2, 3)), image_item(11, (1, 4, 1))]
PROMPT_LEN = 19


def transformers_positions(items: list[MultiModalItem], prompt_len: int) -> tuple[torch.Tensor, int]:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    input_ids = torch.ones(1, prompt_len, dtype=torch.long)
    for item in items:
        input_ids[0, item.offset : item.end] = IMAGE_TOKEN
    merge = 2
    grids = torch.tensor([[t, h * merge, w * merge] for t, h, w in (item.data[MROPE_GRID] for item in items)])
    owner = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=partial(Qwen2VLModel.get_vision_position_ids, None),
    )
    positions, deltas = Qwen2VLModel.get_rope_index(
        owner, input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=grids
    )
    return positions[:, 0], int(deltas[0, 0])


def test_prompt_positions_are_transformers_rope_index():
    expected, _ = transformers_positions(ITEMS, PROMPT_LEN)
    assert mrope_positions(ITEMS, 0, PROMPT_LEN).tolist() == expected.tolist()
    # the first image's tokens: t fixed, h by row, w by column, from the position after the text
    assert mrope_positions(ITEMS, 3, 6).tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]


@pytest.mark.parametrize("first, num_tokens", [(0, 5), (5, 4), (9, 7), (14, 5)])
def test_any_chunk_of_the_prompt_has_the_whole_prompts_positions(first, num_tokens):
    whole = mrope_positions(ITEMS, 0, PROMPT_LEN)
    assert mrope_positions(ITEMS, first, num_tokens).tolist() == whole[:, first : first + num_tokens].tolist()


def test_tokens_after_the_prompt_are_at_their_index_plus_the_delta():
    _, delta = transformers_positions(ITEMS, PROMPT_LEN)
    assert delta == (3 - 6) + (4 - 4)
    generated = mrope_positions(ITEMS, PROMPT_LEN, 3)
    assert generated.tolist() == [[PROMPT_LEN + delta + step for step in range(3)]] * 3


def test_step_positions_are_plain_unless_a_row_is_on_a_grid():
    plain = torch.arange(4)
    text_only = [([], 0, 4)]
    assert step_positions(text_only, plain) is plain
    # decode steps after an image: one row each, all three positions equal -> a [T] tensor
    decode = [(ITEMS, PROMPT_LEN, 1), ([], 7, 1)]
    assert step_positions(decode, torch.tensor([PROMPT_LEN, 7])).tolist() == [PROMPT_LEN - 3, 7]
    # a prefill chunk holding image tokens beside a text row -> [3, T]
    mixed = step_positions([(ITEMS, 2, 3), ([], 7, 2)], torch.tensor([2, 3, 4, 7, 8]))
    assert mixed.tolist() == [[2, 3, 3, 7, 8], [2, 3, 3, 7, 8], [2, 3, 4, 7, 8]]


def test_mrope_rotation_is_transformers_qwen2_vl_rotation():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    section = [2, 3, 3]
    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        )
    ).text_config
    positions = mrope_positions(ITEMS, 0, PROMPT_LEN)
    query = torch.randn(PROMPT_LEN, 4, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = Qwen2VLRotaryEmbedding(config)(query, positions.unsqueeze(1))
    expected, _ = apply_rotary_pos_emb(query.transpose(0, 1)[None], query.transpose(0, 1)[None], cos, sin)
    ours = get_mrope(16, {"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": section}, 64)
    rotated = ours.rotate(positions, query.reshape(PROMPT_LEN, -1).clone())
    torch.testing.assert_close(rotated, expected[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    # [T] positions: plain RoPE, equal to three equal rows
    text = torch.arange(PROMPT_LEN)
    torch.testing.assert_close(
        ours.rotate(text, query.reshape(PROMPT_LEN, -1).clone()).reshape(PROMPT_LEN, 4, 16),
        ours.rotate(text.expand(3, -1), query.reshape(PROMPT_LEN, -1).clone()).reshape(PROMPT_LEN, 4, 16),
        rtol=1e-5,
        atol=1e-5,
    )
