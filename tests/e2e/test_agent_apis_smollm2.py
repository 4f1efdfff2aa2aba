"""/v1/responses and /v1/messages through the real ``tokenloom serve smollm2`` with the
official ``openai`` and ``anthropic`` clients: greedy text whole and streamed agrees with chat
completions, OpenAI's and Anthropic's event order, max_output_tokens / max_tokens cut-offs as
``incomplete`` / ``max_tokens``, stop_sequences, a ``text.format`` json_schema whose output
validates, and both endpoints counted in the Prometheus metrics."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import API_KEY

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = "What is the capital of France? Answer in one sentence."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(smollm2_server):
    return anthropic.Anthropic(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def request_success_total(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def test_responses_text_matches_chat_and_streams_in_openai_order(oai):
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    whole = oai.responses.create(
        model=MODEL, instructions="Be brief.", input=QUESTION, max_output_tokens=24, temperature=0
    )
    assert whole.output_text == chat.choices[0].message.content and whole.output_text.strip()
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    expected_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert whole.status == expected_status and whole.instructions == "Be brief."

    with oai.responses.stream(
        model=MODEL, instructions="Be brief.", input=QUESTION, max_output_tokens=24, temperature=0
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == streamed.output_text
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if expected_status == "incomplete" else "response.completed",
    ]
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_max_output_tokens_cut_is_incomplete(oai):
    response = oai.responses.create(
        model=MODEL, input="Write a long story about a dragon.", max_output_tokens=5, temperature=0
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"


def test_text_format_json_schema_validates(oai):
    for seed in (1, 2):
        response = oai.responses.create(
            model=MODEL,
            input="Invent a person: give a name and an age, as JSON.",
            max_output_tokens=120,
            temperature=1.0,
            extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        )
        assert response.status == "completed", response
        jsonschema.validate(json.loads(response.output_text), PERSON)
    json_object = oai.responses.create(
        model=MODEL,
        input="Give a JSON object with a key 'city'.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(json_object.output_text), dict)


def test_messages_output_config_json_schema_validates(claude):
    message = claude.messages.create(
        model=MODEL,
        max_tokens=120,
        messages=[{"role": "user", "content": "Invent a person as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(message.content[0].text), PERSON)


def test_messages_text_matches_chat_whole_and_streamed(claude, oai):
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    # temperature is a Messages API field the newest anthropic client no longer lists: sent as extra_body
    ask = {
        "model": MODEL,
        "system": "Be brief.",
        "max_tokens": 24,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": QUESTION}],
    }
    message = claude.messages.create(**ask)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert message.usage.input_tokens == chat.usage.prompt_tokens

    with claude.messages.stream(**ask) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_messages_stop_sequences(claude):
    first = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count from one to ten in words."}],
    )
    words = first.content[0].text.split()
    assert len(words) > 3, first
    stop = words[2].strip(",.")
    cut = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
        messages=[{"role": "user", "content": "Count from one to ten in words."}],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert stop not in cut.content[0].text and first.content[0].text.startswith(cut.content[0].text)


def test_both_endpoints_are_counted_in_the_metrics(oai, claude, smollm2_server):
    before = request_success_total(smollm2_server)
    oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert request_success_total(smollm2_server) == before + 2
