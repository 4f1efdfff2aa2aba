"""The output processor: request state, text and stop strings, logprobs, and outputs by kind
(cumulative, delta, final only), fed by hand the way the engine feeds it after each step."""

from __future__ import annotations

import pytest

from tokenloom.core.batch import ModelRunnerOutput, TokenLogprobs
from tokenloom.core.engine.input_processor import InputProcessor, ModelLimits, PreparedPrompt
from tokenloom.core.engine.output_processor import OutputProcessor, RequestState
from tokenloom.core.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from tokenloom.core.sequence import EngineSequence, SequenceStatus


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def new_request(tokenizer, request_id: str, params: SamplingParams) -> tuple[OutputProcessor, RequestState]:
    limits = ModelLimits(
        max_model_len=256,
        vocab_size=len(tokenizer),
        block_size=16,
        num_blocks=64,
        max_logprobs=5,
        eos_token_ids=(tokenizer.eos_token_id,),
    )
    prepared = PreparedPrompt(encode(tokenizer, "Say it:"), "Say it:")
    sequences = InputProcessor(tokenizer, limits).build_sequences(request_id, prepared, params, arrival_time=1.0)
    processor = OutputProcessor(tokenizer)
    state = processor.new_request_state(request_id, prepared, params, sequences, arrival_time=1.0)
    processor.add(state)
    return processor, state


def advance(
    processor: OutputProcessor,
    state: RequestState,
    seq: EngineSequence,
    token_ids: list[int],
    runner_output: ModelRunnerOutput | None = None,
    status: SequenceStatus | None = None,
) -> str | None:
    """One step: the scheduler appended ``token_ids`` (and maybe finished ``seq``)."""
    seq.output_token_ids.extend(token_ids)
    if status is not None:
        seq.status = status
    return processor.process_sequence(state, seq, runner_output or ModelRunnerOutput(), now=2.0)


def test_delta_outputs_carry_only_what_is_new(smollm2_tokenizer):
    params = SamplingParams(n=2, output_kind=RequestOutputKind.DELTA, max_tokens=10)
    processor, state = new_request(smollm2_tokenizer, "r", params)
    first, second = state.sequences
    hello, world = encode(smollm2_tokenizer, "Hello"), encode(smollm2_tokenizer, " world")
    advance(processor, state, first, hello)
    output = processor.make_output(state)
    assert [(c.index, c.text, c.token_ids) for c in output.outputs] == [(0, "Hello", hello)]  # nothing new in #1
    assert output.request_id == "r" and not output.finished and output.metrics.first_token_time == 2.0
    assert processor.make_output(state) is None  # nothing new at all
    advance(processor, state, first, world, status=SequenceStatus.FINISHED_LENGTH)
    advance(processor, state, second, hello, status=SequenceStatus.FINISHED_LENGTH)
    output = processor.make_output(state)
    assert [(c.index, c.text, c.finish_reason) for c in output.outputs] == [
        (0, " world", "length"),
        (1, "Hello", "length"),
    ]
    assert output.finished and state.finished
    assert processor.generation_tokens_total == 2 * len(hello) + len(world)


def test_cumulative_and_final_only_outputs(smollm2_tokenizer):
    tokens = encode(smollm2_tokenizer, "one two")
    processor, state = new_request(smollm2_tokenizer, "c", SamplingParams(max_tokens=10))
    advance(processor, state, state.sequences[0], tokens[:1])
    advance(processor, state, state.sequences[0], tokens[1:])
    assert processor.make_output(state).outputs[0].text == "one two"  # all text so far, every time
    processor, state = new_request(smollm2_tokenizer, "f", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    advance(processor, state, state.sequences[0], tokens[:1])
    assert processor.make_output(state) is None
    advance(processor, state, state.sequences[0], tokens[1:], status=SequenceStatus.FINISHED_LENGTH)
    assert processor.make_output(state).outputs[0].text == "one two"


def test_a_stop_string_is_reported_for_the_engine_to_finish(smollm2_tokenizer):
    processor, state = new_request(smollm2_tokenizer, "s", SamplingParams(stop=["STOP"], max_tokens=50))
    seq = state.sequences[0]
    assert advance(processor, state, seq, encode(smollm2_tokenizer, "go ST")) is None
    assert state.texts[0] == "go "  # "ST" may turn out to start the stop string: held back
    assert advance(processor, state, seq, encode(smollm2_tokenizer, "OP and more")) == "STOP"
    assert seq.stop_reason == "STOP" and not seq.finished  # the engine finishes it in the scheduler
    seq.status = SequenceStatus.FINISHED_STOPPED
    processor.update_text(state, seq)
    output = processor.make_output(state)
    assert (output.outputs[0].text, output.outputs[0].finish_reason, output.outputs[0].stop_reason) == (
        "go ",
        "stop",
        "STOP",
    )


def test_the_stop_token_is_not_part_of_the_text(smollm2_tokenizer):
    params = SamplingParams(skip_special_tokens=False)
    processor, state = new_request(smollm2_tokenizer, "e", params)
    seq = state.sequences[0]
    seq.stop_reason = smollm2_tokenizer.eos_token_id
    advance(
        processor,
        state,
        seq,
        encode(smollm2_tokenizer, "Hi") + [smollm2_tokenizer.eos_token_id],
        status=SequenceStatus.FINISHED_STOPPED,
    )
    assert processor.make_output(state).outputs[0].text == "Hi"


def test_logprobs_ranks_and_decoded_tokens(smollm2_tokenizer):
    processor, state = new_request(smollm2_tokenizer, "l", SamplingParams(logprobs=2, prompt_logprobs=1))
    seq = state.sequences[0]
    hi, there = encode(smollm2_tokenizer, "Hi")[0], encode(smollm2_tokenizer, " there")[0]
    seq.prompt_logprobs = [TokenLogprobs([there], [-0.5], rank=3)]
    # the chosen token first (its rank among all tokens), then the top-k by position
    runner_output = ModelRunnerOutput(logprobs={"l": [TokenLogprobs([there, hi, there], [-1.5, -0.25, -1.5], 2)]})
    advance(processor, state, seq, [there], runner_output)
    output = processor.make_output(state)
    [entry] = output.outputs[0].logprobs
    assert list(entry) == [there, hi]
    assert (entry[there].rank, entry[there].logprob, entry[there].decoded_token) == (2, -1.5, " there")
    assert (entry[hi].rank, entry[hi].decoded_token) == (1, "Hi")
    assert output.outputs[0].cumulative_logprob == -1.5
    assert output.prompt_logprobs[0] is None and output.prompt_logprobs[1][there].rank == 3


def test_a_worker_error_becomes_the_stop_reason(smollm2_tokenizer):
    processor, state = new_request(smollm2_tokenizer, "w", SamplingParams())
    seq = state.sequences[0]
    advance(
        processor,
        state,
        seq,
        [],
        ModelRunnerOutput(errors={"w": "sampler failed"}),
        status=SequenceStatus.FINISHED_ERROR,
    )
    output = processor.make_output(state)
    assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("error", "sampler failed")


def test_request_ids_and_sequence_ids_are_tracked_until_popped(smollm2_tokenizer):
    processor, state = new_request(smollm2_tokenizer, "q", SamplingParams(n=2))
    assert processor.id_in_use("q") and processor.id_in_use("q#1") and not processor.id_in_use("q#2")
    assert processor.owner("q#0") is state and list(processor) == [state]
    assert processor.pop("q") is state and processor.pop("q") is None
    assert not processor.id_in_use("q#0") and processor.owner("q#0") is None


def test_pooling_output(smollm2_tokenizer):
    sequence = EngineSequence("p", [1, 2], SamplingParams(max_tokens=1), pooling_params=PoolingParams())
    state = OutputProcessor.new_pooling_state("p", PreparedPrompt([1, 2], None), PoolingParams(), sequence)
    sequence.status = SequenceStatus.FINISHED_STOPPED
    output = OutputProcessor.make_pooling_output(state, ModelRunnerOutput(pooled={"p": [0.5, 0.25]}))
    assert (output.request_id, output.outputs.data, output.finished, output.error) == ("p", [0.5, 0.25], True, None)
    sequence.status, sequence.stop_reason = SequenceStatus.FINISHED_ERROR, "out of memory"
    assert OutputProcessor.make_pooling_output(state, ModelRunnerOutput()).error == "out of memory"


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_a_finished_request_always_reports(smollm2_tokenizer, kind):
    processor, state = new_request(smollm2_tokenizer, "k", SamplingParams(output_kind=kind))
    advance(processor, state, state.sequences[0], [], status=SequenceStatus.FINISHED_ABORTED)
    output = processor.make_output(state)
    assert output is not None and output.finished and output.outputs[0].finish_reason == "abort"
