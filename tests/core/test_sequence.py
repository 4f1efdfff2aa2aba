"""The engine's sequence state: its own id and the request it belongs to."""

from __future__ import annotations

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import EngineSequence


def test_a_sequence_belongs_to_the_request_of_its_own_id_unless_told_otherwise():
    alone = EngineSequence(seq_id="r", prompt_token_ids=[1], sampling_params=SamplingParams())
    sibling = EngineSequence(
        seq_id="r#1", prompt_token_ids=[1], sampling_params=SamplingParams(), request_id="r", index=1
    )
    assert (alone.seq_id, alone.request_id) == ("r", "r")
    assert (sibling.seq_id, sibling.request_id, sibling.index) == ("r#1", "r", 1)
