"""Structured outputs through the real `tokenloom serve smollm2` over HTTP, for every built-in
backend: varied JSON schemas, regexes and choices sampled at temperature 1 must all parse and
validate (whatever the request form: guided_*, response_format, structured_outputs, chat or
completions, streamed or whole); named and "required" tool calls
validate against the tools' schemas; bad constraints are 400s that name the problem."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.builtin_plugins.structured_output.cases import CHOICES, GRAMMAR_EBNF, GRAMMAR_LARK, REGEXES, SCHEMAS
from tests.e2e.conftest import API_KEY
from tokenloom.api.chat_tool_calls import required_tool_calls_schema
from tokenloom.api.protocol import ChatCompletionRequest
from tokenloom.builtin_plugins.structured_output.guidance_backend import GuidanceBackend
from tokenloom.builtin_plugins.structured_output.lm_format_enforcer_backend import LMFormatEnforcerBackend
from tokenloom.builtin_plugins.structured_output.outlines_backend import OutlinesBackend
from tokenloom.builtin_plugins.structured_output.xgrammar_backend import XGrammarBackend
from tokenloom.core.structured_output_constraints import BackendOptions, Constraint
from tokenloom.errors import InvalidRequestError

pytestmark = pytest.mark.slow

MODEL = "smollm2"
SEEDS = (1, 2)
MAX_TOKENS = 300
CONCURRENCY = 24
BACKENDS = {
    "xgrammar": XGrammarBackend,
    "guidance": GuidanceBackend,
    "outlines": OutlinesBackend,
    "lm-format-enforcer": LMFormatEnforcerBackend,
}


@pytest.fixture(scope="module")
def server(smollm2_server):
    # the session's SmolLM2 server: the flags this module needs (--max-model-len 1024, the API key)
    return smollm2_server


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def client(server):
    # closed inside the test's event loop (a client collected later finds its loop closed)
    async with openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=600
    ) as async_client:
        yield async_client


# Of the JSON schemas the default backend serves every one through the server; each other
# backend every JSON_SHARE-th schema it takes, a different slice each, so every schema still
# meets two backends here where two take it (and every backend's own tests, under
# tests/builtin_plugins/structured_output, walk every case's masks without a model).
# lm-format-enforcer computes its masks in Python per token: all its schemas took half of this
# module's time.
JSON_SHARE = {"xgrammar": 1, "guidance": 2, "outlines": 2, "lm-format-enforcer": 3}


def json_share(backend: str, cases: dict) -> dict:
    """The JSON cases ``backend`` samples here, of those it takes: every JSON_SHARE-th schema of
    SCHEMAS, starting at the backend's own offset."""
    share = JSON_SHARE[backend]
    offset = list(BACKENDS).index(backend) % share
    return {
        name: spec for index, (name, spec) in enumerate(SCHEMAS.items()) if index % share == offset and name in cases
    }


def supported(backend: str, kind: str, cases: dict) -> dict:
    """The cases ``backend`` takes (construction is cheap: no tokenizer needed to ask)."""
    instance = BACKENDS[backend](None, 0, [], BackendOptions())
    return {
        name: spec
        for name, spec in cases.items()
        if instance.supports(Constraint(kind, tuple(spec) if kind == "choice" else spec)) is None
    }


async def gather_limited(coroutines):
    limit = asyncio.Semaphore(CONCURRENCY)

    async def run(coroutine):
        async with limit:
            return await coroutine

    return await asyncio.gather(*(run(c) for c in coroutines))


def check(kind: str, spec, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), f"{text!r} does not match {spec!r}"
    else:
        assert text in spec, f"{text!r} is not one of {spec}"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def request_forms(kind: str, spec, backend: str, index: int) -> tuple[str, dict]:
    """(endpoint, request fields): the case's constraint in one of the forms clients use."""
    value = list(spec) if kind == "choice" else spec
    forms = {
        "json": [
            {"guided_json": value},
            {"guided_json": json.dumps(value)},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": value}}},
            {"structured_outputs": {"json": value}},
        ],
        "regex": [{"guided_regex": value}, {"structured_outputs": {"regex": value}}],
        "choice": [{"guided_choice": value}, {"structured_outputs": {"choice": value}}],
    }[kind]
    fields = dict(forms[index % len(forms)])
    if "structured_outputs" in fields:
        fields["structured_outputs"] = {**fields["structured_outputs"], "backend": backend}
    else:
        fields["guided_decoding_backend"] = backend
    # response_format is a chat-only form; the rest also go through completions
    endpoint = "completions" if index % 3 == 2 and "response_format" not in fields else "chat"
    return endpoint, fields


async def generate(client, endpoint: str, prompt: str, fields: dict, seed: int, stream: bool = False):
    """(text, finish_reason)."""
    common = dict(model=MODEL, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, extra_body=fields)
    if "response_format" in fields:
        common["response_format"] = fields["response_format"]
        common["extra_body"] = {k: v for k, v in fields.items() if k != "response_format"}
    if endpoint == "chat":
        if not stream:
            response = await client.chat.completions.create(messages=user(prompt), **common)
            return response.choices[0].message.content, response.choices[0].finish_reason
        chunks = [
            chunk async for chunk in await client.chat.completions.create(messages=user(prompt), stream=True, **common)
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
    if not stream:
        response = await client.completions.create(prompt=prompt + "\n", **common)
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = [chunk async for chunk in await client.completions.create(prompt=prompt + "\n", stream=True, **common)]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)


def prompt_for(kind: str, name: str, spec) -> str:
    if kind == "json":
        return f"Write a JSON value for '{name}' that follows this JSON schema: {json.dumps(spec)}"
    if kind == "regex":
        return f"Write an example of a {name.replace('_', ' ')}."
    return f"Pick one of: {', '.join(spec)}."


async def run_cases(client, backend: str, kind: str, cases: dict) -> int:
    """One sample of each case. Its seed is SEEDS[0] for the first four cases, SEEDS[1] for the
    next four, and so on, and its request form the (case index + seed)th: consecutive cases take
    consecutive forms, so every form and both endpoints are drawn (the backends' own tests walk
    each case's masks at random many times over, without a model). Every other case is streamed,
    its chunks concatenated: streamed output must be valid output too."""
    jobs, expected = [], []
    for index, (name, spec) in enumerate(cases.items()):
        seed = SEEDS[index // 4 % len(SEEDS)]
        endpoint, fields = request_forms(kind, spec, backend, index + seed)
        stream = index % 2 == 1
        jobs.append(generate(client, endpoint, prompt_for(kind, name, spec), fields, seed, stream))
        expected.append((name, spec, f"{endpoint}{' streamed' if stream else ''}", fields))
    results = await gather_limited(jobs)
    failures = []
    for (text, finish_reason), (name, spec, endpoint, fields) in zip(results, expected):
        try:
            assert finish_reason == "stop", f"finish_reason {finish_reason}"
            check(kind, spec, text)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{backend} {kind} {name} via {endpoint} {sorted(fields)}: {exc}: {text!r}")
    assert not failures, "\n".join(failures)
    return len(results)


@pytest.mark.anyio
@pytest.mark.parametrize("backend", list(BACKENDS))
async def test_json_schemas_always_validate(client, backend):
    cases = supported(backend, "json", SCHEMAS)
    assert len(cases) >= 18, f"{backend} takes only {sorted(cases)}"
    sampled = json_share(backend, cases)
    assert await run_cases(client, backend, "json", sampled) == len(sampled)


@pytest.mark.anyio
@pytest.mark.parametrize("backend", list(BACKENDS))
async def test_regexes_and_choices_always_match(client, backend):
    regexes, choices = supported(backend, "regex", REGEXES), supported(backend, "choice", CHOICES)
    assert len(regexes) == len(REGEXES) and len(choices) == len(CHOICES)
    await run_cases(client, backend, "regex", regexes)
    await run_cases(client, backend, "choice", choices)


CAT_JSON = "Give a JSON object with a cat's name and age."


@pytest.mark.anyio
async def test_json_object_grammars_and_whitespace_options(client):
    greedy = client.chat.completions.create(
        model=MODEL,
        messages=user(CAT_JSON),
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    sampled = [
        client.chat.completions.create(
            model=MODEL,
            messages=user(CAT_JSON),
            seed=seed,
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_object"},
        )
        for seed in range(1, 5)
    ]
    first, *others = await asyncio.gather(greedy, *sampled)
    # greedy, the model closes its object well inside the budget
    assert first.choices[0].finish_reason == "stop" and isinstance(json.loads(first.choices[0].message.content), dict)
    for response in others:
        choice = response.choices[0]
        # sampled at temperature 1, the small model may ramble inside a string past the budget:
        # an object it closed parses; one it did not is the start of one
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    sentence = r"(The cat|A dog|My friend) (sees|likes|chases) (the ball|a bird|the moon)\."
    for grammar, pattern in ((GRAMMAR_EBNF, sentence), (GRAMMAR_LARK, r"[1-9][0-9]?[+-][1-9][0-9]?=[1-9][0-9]?")):
        response = await client.completions.create(
            model=MODEL,
            prompt="Say something:",
            temperature=1.0,
            seed=3,
            max_tokens=60,
            extra_body={"guided_grammar": grammar},
        )
        assert re.fullmatch(pattern, response.choices[0].text), response.choices[0].text
    schema = SCHEMAS["flags"]
    compact = await client.chat.completions.create(
        model=MODEL,
        messages=user("Flags as JSON"),
        temperature=1.0,
        seed=4,
        max_tokens=MAX_TOKENS,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    text = compact.choices[0].message.content
    assert text == json.dumps(json.loads(text), separators=(",", ":"))
    spaced = await client.chat.completions.create(
        model=MODEL,
        messages=user("Flags as JSON"),
        temperature=1.0,
        seed=5,
        max_tokens=MAX_TOKENS,
        extra_body={"guided_json": schema, "guided_whitespace_pattern": "[ ]{2}"},
    )  # auto: only outlines takes it
    assert re.fullmatch(
        r'\{  "read"  :  (true|false)  ,  "write"  :  (true|false)  ,  "exec"  :  (true|false)  \}',
        spaced.choices[0].message.content,
    )


@pytest.mark.anyio
async def test_n_samples_logprobs_and_stop_strings_compose_with_constraints(client):
    response = await client.chat.completions.create(
        model=MODEL,
        messages=user("Is the sky blue?"),
        n=3,
        seed=6,
        temperature=1.0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.message.content in ("yes", "no", "maybe") and choice.logprobs.content
    stopped = await client.completions.create(
        model=MODEL,
        prompt="A date:",
        seed=7,
        temperature=1.0,
        max_tokens=30,
        stop=["-"],
        extra_body={"guided_regex": REGEXES["iso_date"]},
    )
    assert re.fullmatch(r"20[0-9]{2}", stopped.choices[0].text) and stopped.choices[0].finish_reason == "stop"


@pytest.mark.anyio
async def test_lm_format_enforcer_serves_integers_numbers_and_max_length(client):
    """Issue 19 item 17: the backend named in the request serves ordinary schemas with
    unbounded integers and numbers and a maxLength (it used to refuse them with a 400)."""
    schema = SCHEMAS["measurement"]
    forms = [
        {"guided_json": schema, "guided_decoding_backend": "lm-format-enforcer"},
        {"structured_outputs": {"json": schema, "backend": "lm-format-enforcer"}},
    ]
    prompt = "Describe an apple on sale as JSON with an integer count, a price and a short label."
    # each form through each endpoint
    jobs = [
        generate(client, endpoint, prompt, forms[seed % 2], seed)
        for seed in range(1, 3)
        for endpoint in ("chat", "completions")
    ]
    for text, finish_reason in await gather_limited(jobs):
        assert finish_reason == "stop", text
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert type(value["count"]) is int and len(value["label"]) <= 8, text


@pytest.mark.anyio
async def test_guidance_grammars_and_structural_tags(client):
    sentence = r"(The cat|A dog|My friend) (sees|likes|chases) (the ball|a bird|the moon)\."
    for grammar, pattern in ((GRAMMAR_EBNF, sentence), (GRAMMAR_LARK, r"[1-9][0-9]?[+-][1-9][0-9]?=[1-9][0-9]?")):
        response = await client.completions.create(
            model=MODEL,
            prompt="Say something:",
            temperature=1.0,
            seed=3,
            max_tokens=60,
            extra_body={"guided_grammar": grammar, "guided_decoding_backend": "guidance"},
        )
        assert re.fullmatch(pattern, response.choices[0].text), response.choices[0].text
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<call>", "schema": city, "end": "</call>"}],
        "triggers": ["<call>"],
    }
    texts = []
    for seed in range(1, 5):
        response = await client.chat.completions.create(
            model=MODEL,
            messages=user("Look up the weather: write <call> followed by a JSON object with a city, then </call>."),
            temperature=1.0,
            seed=seed,
            max_tokens=80,
            response_format=tag,
            extra_body={"guided_decoding_backend": "guidance"},
        )
        texts.append(response.choices[0].message.content)
    for text in texts:
        # free text around the tags; inside each, exactly the schema and the end string
        for inside in re.findall(r"<call>(.*?)(?:</call>|$)", text, flags=re.S):
            if text.endswith(inside):
                continue  # cut by max_tokens inside the tag
            jsonschema.validate(json.loads(inside), city)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -100, "maximum": 100},
                    "b": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["a", "b"],
            },
        },
    },
]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


@pytest.mark.anyio
async def test_named_and_required_tool_calls_validate(client):
    messages = user("What is the weather in Paris, and what is 2 + 3?")
    named = [
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            seed=seed,
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            tool_choice={"type": "function", "function": {"name": name}},
        )
        for name in TOOL_SCHEMAS
        for seed in SEEDS
    ]
    # one call each: a small model may list calls until max_tokens when the array is unbounded
    required = [
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            seed=seed,
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        for seed in (*SEEDS, 3, 4)
    ]
    responses = await asyncio.gather(*named, *required)
    for index, response in enumerate(responses):
        calls = response.choices[0].message.tool_calls
        check_calls(calls)
        if index < len(named):
            assert [call.function.name for call in calls] == [list(TOOL_SCHEMAS)[index // len(SEEDS)]]
            arguments = calls[0].function.arguments  # generated compact: no whitespace to spend tokens on
            assert arguments == json.dumps(json.loads(arguments), separators=(",", ":"))
        else:
            assert response.choices[0].finish_reason == "tool_calls"
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        seed=9,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    deltas = [
        call for chunk in [c async for c in stream] if chunk.choices for call in chunk.choices[0].delta.tool_calls or []
    ]
    assert deltas and all(call.function.name in TOOL_SCHEMAS for call in deltas)
    for call in deltas:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_request_forms_become_one_structured_outputs_dict():
    def constraint(**fields):
        return ChatCompletionRequest(messages=user("hi"), **fields).structured_output_constraint()

    schema = SCHEMAS["flags"]
    assert constraint() is None and constraint(response_format={"type": "text"}) is None
    assert constraint(guided_json=json.dumps(schema)) == {"json": schema}
    assert constraint(guided_json=schema, guided_decoding_backend="outlines", guided_whitespace_pattern=" ?") == {
        "json": schema,
        "backend": "outlines",
        "whitespace_pattern": " ?",
    }
    assert constraint(guided_regex="a+") == {"regex": "a+"}
    assert constraint(guided_choice=["a", "b"]) == {"choice": ["a", "b"]}
    assert constraint(guided_grammar=GRAMMAR_EBNF) == {"grammar": GRAMMAR_EBNF}
    assert constraint(response_format={"type": "json_object"}) == {"json_object": True}
    assert constraint(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    ) == {"json": schema}
    tag = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a>"]}
    assert constraint(response_format=tag) == {"structural_tag": tag}
    # a backend inside structured_outputs wins over guided_decoding_backend
    assert constraint(structured_outputs={"regex": "x", "backend": "xgrammar"}, guided_decoding_backend="outlines") == {
        "regex": "x",
        "backend": "xgrammar",
    }
    for fields, param in (
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ):
        with pytest.raises(InvalidRequestError) as error:
            constraint(**fields)
        assert error.value.param == param


def test_the_required_tool_calls_schema_takes_exactly_calls_of_the_tools():
    tools = TOOLS + [
        {
            "type": "function",
            "function": {
                "name": "locate",
                "parameters": {
                    "type": "object",
                    "properties": {"at": {"$ref": "#/$defs/point"}},
                    "required": ["at"],
                    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                },
            },
        }
    ]
    schema = required_tool_calls_schema(tools)
    assert schema["$defs"] == {"point": tools[2]["function"]["parameters"]["$defs"]["point"]}
    jsonschema.validate(
        [{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "locate", "parameters": {"at": {"x": 3}}}], schema
    )
    for bad in (
        [],
        [{"name": "add", "parameters": {"a": 1}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "locate", "parameters": {"at": {"x": "3"}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_tool_calls_schema(tools, parallel_tool_calls=False)["maxItems"] == 1
    clash = [
        tools[2],
        {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"point": {"type": "string"}}}}},
    ]
    with pytest.raises(InvalidRequestError, match="define \\$defs/point differently"):
        required_tool_calls_schema(clash)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"guided_json": {"type": "objekt"}}, "invalid JSON schema"),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
        ({"guided_regex": "a(b"}, "cannot compile a regex"),
        ({"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
        ({"guided_regex": "a", "guided_decoding_backend": "grammarly"}, "unknown guided_decoding_backend 'grammarly'"),
        (
            {"guided_json": {"type": "array", "uniqueItems": True}, "guided_decoding_backend": "guidance"},
            'guidance cannot enforce this JSON schema: Unimplemented keys: ["uniqueItems"]',
        ),
        (
            {"guided_grammar": "start: missing", "guided_decoding_backend": "guidance"},
            "guidance cannot compile a grammar",
        ),
        ({"guided_grammar": GRAMMAR_EBNF, "guided_decoding_backend": "outlines"}, "regular languages only"),
        (
            {"guided_json": SCHEMAS["probability"], "guided_decoding_backend": "lm-format-enforcer"},
            "lm-format-enforcer cannot enforce the JSON-schema keyword(s) maximum, minimum",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give one structured-output form"),
        ({"structured_outputs": {"jsn": {}}}, "unknown structured_outputs key(s) jsn"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(server, body, message):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for endpoint, payload in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": user("Hi")}),
    ):
        response = httpx.post(
            server.base_url + endpoint,
            headers=headers,
            timeout=120,
            json={"model": MODEL, "max_tokens": 5, **payload, **body},
        )
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
