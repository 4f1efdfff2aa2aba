"""The step's data crosses process boundaries (the ``mp`` and ``ray`` executors pickle it):
:class:`SchedulerOutput` and :class:`ModelRunnerOutput` round-trip through pickle with every
field set, every field kind included (nested dataclasses, sets, numpy masks, CPU tensors)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import torch

from tokenloom.core.batch import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StructuredOutputMasks,
    TokenLogprobs,
)
from tokenloom.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from tokenloom.core.multimodal.inputs import MultiModalItem
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.lora.request import LoRARequest


def every_field_set(obj) -> None:
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        assert value not in (None, False, [], {}, set()), f"{type(obj).__name__}.{field.name} is left at its default"


def full_scheduler_output() -> SchedulerOutput:
    new = NewRequestData(
        req_id="a",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[4],
        sampling_params=SamplingParams(temperature=0.7, top_p=0.9, seed=3, stop=["\n"], logprobs=2, max_tokens=9),
        block_ids=[0, 5],
        num_computed_tokens=2,
        pooling_params=PoolingParams(dimensions=2),
        lora_request=LoRARequest("adapter", 1, "/tmp/adapter"),
        mm_items=[MultiModalItem("image", "ab" * 32, 1, 2, {"pixel_values": torch.ones(3, 2, 2)})],
    )
    every_field_set(new)
    output = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=[CachedRequestData(req_id="b", new_block_ids=[7], num_computed_tokens=11)],
        num_scheduled_tokens={"a": 2, "b": 3},
        finished_req_ids={"c", "d"},
        preempted_req_ids={"d"},
        structured_output=StructuredOutputMasks(req_ids=["b"], bitmask=np.array([[1, -1, 5]], dtype=np.int32)),
        scheduled_spec_decode_tokens={"b": [8, 9]},
        propose_drafts=True,
        kv_connector_metadata=KVConnectorMetadata(
            loads={"e": [(3, b"\x01" * 32)]}, saves=[(5, b"\x02" * 32)], num_loads_in_flight=1
        ),
    )
    every_field_set(output)
    return output


def test_scheduler_output_round_trips_through_pickle():
    original = full_scheduler_output()
    copy = pickle.loads(pickle.dumps(original, protocol=pickle.HIGHEST_PROTOCOL))
    bitmask = copy.structured_output.bitmask
    assert isinstance(bitmask, np.ndarray) and bitmask.dtype == np.int32
    assert np.array_equal(bitmask, original.structured_output.bitmask)
    # compare the rest as plain values (numpy arrays do not compare with ==)
    copy.structured_output.bitmask = original.structured_output.bitmask = None
    assert torch.equal(copy.scheduled_new_reqs[0].mm_items[0].data["pixel_values"], torch.ones(3, 2, 2))
    assert copy == original
    assert copy.total_num_scheduled_tokens == 5 and isinstance(copy.finished_req_ids, set)


def test_model_runner_output_round_trips_through_pickle():
    logprob = TokenLogprobs(token_ids=[5, 2], logprobs=[-0.1, -2.5], rank=1)
    original = ModelRunnerOutput(
        sampled_token_ids={"a": [5], "b": [6, 7]},
        logprobs={"a": [logprob]},
        prompt_logprobs={"a": [logprob, logprob]},
        pooled={"p": torch.tensor([0.25, -1.0])},
        errors={"e": "sampler failed: probabilities contain NaN"},
        draft_token_ids={"b": [1, 2, 3]},
        mm_cache_queries=2,
        mm_cache_hits=1,
        kv_connector_output=KVConnectorOutput(finished_loads={"e": 1}, num_blocks_loaded=1, num_bytes_stored=4096),
    )
    every_field_set(original)
    copy = pickle.loads(pickle.dumps(original, protocol=pickle.HIGHEST_PROTOCOL))
    assert torch.equal(copy.pooled["p"], original.pooled["p"])
    copy.pooled = original.pooled = {}
    assert copy == original
