"""The chat-template renderer: identical strings to transformers' apply_chat_template,
content-format detection, transformers' template globals and filters, where a template
comes from, message normalisation for tool conversations, who is at fault when a template
fails, and the trust flag and time/size limits that bound templates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from tests.api.conftest import client_for
from tokenloom import chat_template
from tokenloom.chat_template import (
    ChatRenderer,
    ChatTemplateError,
    RenderLimits,
    detect_content_format,
    load_chat_template,
    normalize_messages,
)
from tokenloom.errors import ConfigError, InvalidRequestError

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke\nwith two lines."},
    ],
    [{"role": "user", "content": 'Unicode: héllo ✓ 日本語 <tag> & "quotes"'}],
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(tokenizer, conversation, add_generation_prompt):
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = ChatRenderer(tokenizer).render(conversation, add_generation_prompt=add_generation_prompt)
    assert rendered == expected


def test_continue_final_message_matches_transformers(tokenizer):
    conversation = [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moonlight,"}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    rendered = ChatRenderer(tokenizer).render(conversation, add_generation_prompt=False, continue_final_message=True)
    assert rendered == expected
    assert rendered.endswith("Autumn moonlight,")


def test_template_features_like_transformers(tokenizer):
    template = (
        "{% for m in messages %}{{ m['content'] | tojson }}{% if loop.last %}{% break %}{% endif %}{% endfor %}|"
        "{{ tools | tojson(indent=2) }}|{{ documents[0].title }}|{{ bos_token }}{{ eos_token }}|{{ flavour }}|"
        "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}{% endfor %}"
        "{{ ns.count }}|{{ strftime_now('%Y') | length }}|"
        "{% generation %}{{ 'gen' }}{% endgeneration %}"
    )
    conversation = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    documents = [{"title": "Doc", "text": "body"}]
    expected = tokenizer.apply_chat_template(
        conversation, tools=tools, documents=documents, chat_template=template, tokenize=False, flavour="mint"
    )
    rendered = ChatRenderer(tokenizer).render(
        conversation, tools=tools, documents=documents, chat_template=template, chat_template_kwargs={"flavour": "mint"}
    )
    assert rendered == expected
    assert '"héllo <b>"' in rendered  # ensure_ascii=False and no HTML escaping


def test_raise_exception_is_a_400_with_the_templates_message(tokenizer):
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system message first, please') }}{% endif %}"
    )
    with pytest.raises(InvalidRequestError, match="system message first, please"):
        ChatRenderer(tokenizer).render([{"role": "user", "content": "x"}], chat_template=template)


def test_sandbox_blocks_unsafe_attribute_access(tokenizer):
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequestError):
        ChatRenderer(tokenizer).render([{"role": "user", "content": "x"}], chat_template=template)


def test_template_syntax_error_is_a_400(tokenizer):
    with pytest.raises(InvalidRequestError, match="not valid Jinja") as info:
        ChatRenderer(tokenizer).render([{"role": "user", "content": "x"}], chat_template="{% for %}")
    assert info.value.param == "chat_template"


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
    ],
)
def test_detect_content_format(template, expected):
    assert detect_content_format(template) == expected


def test_content_formats(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert normalize_messages(parts, "string")[0]["content"] == "one\ntwo"
    plain = [{"role": "user", "content": "just text"}]
    assert normalize_messages(plain, "openai")[0]["content"] == [{"type": "text", "text": "just text"}]
    openai_template = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"
    auto = ChatRenderer(tokenizer, server_template=openai_template)
    assert auto.render(plain, add_generation_prompt=False) == "[just text]"
    forced_string = ChatRenderer(tokenizer, server_template="{{ messages[0]['content'] }}", content_format="string")
    assert forced_string.render(parts, add_generation_prompt=False) == "one\ntwo"


def test_non_text_parts_are_rejected_by_type(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
        }
    ]
    with pytest.raises(InvalidRequestError, match="'image_url'") as info:
        ChatRenderer(tokenizer).render(messages)
    assert info.value.param == "messages[0].content[1]"


def test_tool_call_arguments_are_parsed_for_templates():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    [normalized] = normalize_messages([message], "string")
    assert normalized["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert normalized["content"] == ""


def test_template_sources(tokenizer, tmp_path):
    template_file = tmp_path / "t.jinja"
    template_file.write_text("FILE{{ messages[0]['content'] }}")
    assert load_chat_template(str(template_file)) == "FILE{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ConfigError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    renderer = ChatRenderer(tokenizer, server_template=load_chat_template(str(template_file)))
    messages = [{"role": "user", "content": "x"}]
    assert renderer.render(messages) == "FILEx"
    assert renderer.render(messages, chat_template="REQ{{ messages[0]['content'] }}") == "REQx"


def test_no_template_says_how_to_pass_one(tokenizer, monkeypatch):
    renderer = ChatRenderer(tokenizer)
    renderer.model_template = None
    with pytest.raises(InvalidRequestError, match="--chat-template"):
        renderer.render([{"role": "user", "content": "x"}])


def test_reserved_kwargs_and_conflicting_flags(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="messages"):
        renderer.render(messages, chat_template_kwargs={"messages": []})
    with pytest.raises(InvalidRequestError) as info:
        renderer.render(messages, add_generation_prompt=True, continue_final_message=True)
    assert info.value.param == "continue_final_message"


@pytest.mark.parametrize("name", ["raise_exception", "namespace", "strftime_now", "range", "bos_token", "mask_token"])
def test_kwargs_may_not_shadow_the_templates_functions_or_special_tokens(tokenizer, name):
    # issue 37: {"raise_exception": ...} or {"eos_token": ...} replaced what the template relies on
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="may not set") as info:
        renderer.render(messages, chat_template_kwargs={name: "x", "flavour": "mint"})
    assert info.value.param == "chat_template_kwargs" and repr(name) in info.value.message
    assert renderer.render(messages, chat_template_kwargs={"flavour": "mint", "enable_thinking": False})


@pytest.mark.anyio
async def test_shadowing_kwargs_are_a_400_over_http(client):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    response = await client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"eos_token": "!"}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_unknown_content_format_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError, match="content-format"):
        ChatRenderer(tokenizer, content_format="xml")


# -- the second turn of a tool conversation (issue 16) ---------------------------------------------

WEATHER_CALL = {
    "id": "call-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    # what the OpenAI API returns for a tool call, and what every client sends back
    {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL], "refusal": None, "function_call": None},
    {"role": "tool", "tool_call_id": "call-1", "content": [{"type": "text", "text": '{"temperature": 21}'}]},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("content_format, empty", [("string", ""), ("openai", [])])
@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
def test_null_and_missing_content_are_empty_in_either_format(role, content_format, empty):
    for message in ({"role": role, "content": None}, {"role": role}):
        assert normalize_messages([message], content_format)[0]["content"] == empty


@pytest.mark.parametrize(
    "content_format, expected",
    [
        ("string", '{"temperature": 21}'),
        ("openai", [{"type": "text", "text": '{"temperature": 21}'}]),
    ],
)
def test_tool_history_is_normalized_for_templates(content_format, expected):
    user, assistant, tool = normalize_messages(TOOL_HISTORY, content_format)
    assert assistant["content"] == ("" if content_format == "string" else [])
    assert assistant["tool_calls"] == [
        {**WEATHER_CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert "refusal" not in assistant and "function_call" not in assistant  # null fields read as absent
    assert tool == {"role": "tool", "tool_call_id": "call-1", "content": expected}
    assert TOOL_HISTORY[1]["content"] is None and TOOL_HISTORY[1]["tool_calls"][0] is WEATHER_CALL  # not mutated


@pytest.mark.parametrize(
    "arguments, parsed",
    [("", {}), (None, {}), ('{"a": [1]}', {"a": [1]}), ("not json", "not json"), ({"a": 1}, {"a": 1})],
)
def test_tool_call_arguments_as_templates_expect_them(arguments, parsed):
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    [message] = normalize_messages([{"role": "assistant", "tool_calls": [call]}], "string")
    assert message["tool_calls"][0]["function"]["arguments"] == parsed


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "assistant", "tool_calls": {"id": "1"}}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"id": "1", "function": {"arguments": "{}"}}]},
            "messages[0].tool_calls[0]",
        ),
        ({"role": "tool", "tool_call_id": 7, "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "tool", "content": {"temperature": 21}}, "messages[0].content"),
    ],
)
def test_malformed_tool_messages_are_400s_naming_the_field(message, param):
    with pytest.raises(InvalidRequestError) as info:
        normalize_messages([message], "string")
    assert info.value.param == param


def test_smollm2_template_renders_the_second_turn_like_transformers(tokenizer):
    # transformers cannot render null content with this template at all; vLLM's (and our)
    # normalisation gives it "", which is what transformers renders for an empty turn
    as_transformers_needs = [
        TOOL_HISTORY[0],
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"temperature": 21}'},
    ]
    expected = tokenizer.apply_chat_template(as_transformers_needs, tokenize=False, add_generation_prompt=True)
    for tools in (None, [WEATHER_TOOL]):
        assert ChatRenderer(tokenizer).render(TOOL_HISTORY, tools=tools) == expected


@pytest.mark.parametrize(
    "template_name, written_call, written_result",
    [
        (
            "tool_chat_template_hermes.jinja",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>',
        ),
        (
            "tool_chat_template_llama3_json.jinja",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
            '<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>',
        ),
        (
            "tool_chat_template_mistral.jinja",
            '[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call-1"}]',
            '[TOOL_RESULTS] {"content": "{\\"temperature\\": 21}", "call_id": "call-1"}[/TOOL_RESULTS]',
        ),
        (
            "tool_chat_template_mistral_parallel.jinja",
            '[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call-1"}]',
            '[TOOL_RESULTS] {"content": "{\\"temperature\\": 21}", "call_id": "call-1"}[/TOOL_RESULTS]',
        ),
    ],
)
def test_example_tool_templates_write_the_call_and_result_back(tokenizer, template_name, written_call, written_result):
    renderer = ChatRenderer(tokenizer, server_template=load_chat_template(str(EXAMPLES / template_name)))
    for tools in (None, [WEATHER_TOOL]):
        rendered = renderer.render(TOOL_HISTORY, tools=tools)
        assert written_call in rendered and written_result in rendered
        assert ("Current weather" in rendered) == bool(tools)


@pytest.mark.parametrize(
    "template_name", ["tool_chat_template_mistral.jinja", "tool_chat_template_mistral_parallel.jinja"]
)
def test_mistral_templates_keep_the_last_nine_characters_of_call_ids_and_put_tools_before_the_last_turn(
    tokenizer, template_name
):
    renderer = ChatRenderer(tokenizer, server_template=load_chat_template(str(EXAMPLES / template_name)))
    long_call = {**WEATHER_CALL, "id": "chatcmpl-tool-0123456789abcdef"}
    history = [
        {"role": "system", "content": "Be brief."},
        TOOL_HISTORY[0],
        {**TOOL_HISTORY[1], "tool_calls": [long_call]},
        {**TOOL_HISTORY[2], "tool_call_id": long_call["id"]},
        {"role": "assistant", "content": "21 degrees."},
        {"role": "user", "content": "Thanks"},
    ]
    rendered = renderer.render(history, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert '"id": "789abcdef"' in rendered and '"call_id": "789abcdef"' in rendered
    assert "0123456" not in rendered
    # tools and the system message go in front of the last user turn only
    assert rendered.index("[AVAILABLE_TOOLS]") > rendered.index("21 degrees.")
    assert rendered.endswith("Be brief.\n\nThanks[/INST]")
    assert rendered.count("[INST]") == 2
    assert ("[TOOL_CALLS] followed by a JSON list" in rendered) == template_name.endswith("_parallel.jinja")


def test_every_example_template_the_seed_documents_name_exists():
    seeds = Path(os.environ.get("TOKENLOOM_SEEDS_DIR", Path(__file__).resolve().parents[3] / "shared" / "seeds"))
    if not seeds.is_dir():
        pytest.skip(f"vLLM's seed documents are not at {seeds}")
    text = "".join(path.read_text(encoding="utf-8") for path in sorted(seeds.glob("0*.txt")))
    named = set(re.findall(r"examples/[A-Za-z0-9_./-]+\.jinja", text))
    assert named  # the seeds name some: the check is not vacuous
    assert [path for path in sorted(named) if not (EXAMPLES.parent / path).is_file()] == []


def test_an_openai_format_template_renders_the_tool_history(tokenizer):
    # auto-detected: the template loops over each message's content parts
    template = (
        "{% for m in messages %}{{ m.role }}:{% for part in m.content %}[{{ part.text }}]{% endfor %}"
        "{% for call in m.tool_calls or [] %}<{{ call.function.name }} {{ call.function.arguments.city }}>"
        "{% endfor %}|{% endfor %}"
    )
    rendered = ChatRenderer(tokenizer, server_template=template).render(TOOL_HISTORY, add_generation_prompt=False)
    assert rendered == 'user:[What is the weather in Paris?]|assistant:<get_weather Paris>|tool:[{"temperature": 21}]|'


def test_the_offline_api_renders_without_the_server_package():
    # llm.py imports the chat template; neither may pull in tokenloom.api (the server)
    code = (
        "import sys, tokenloom.llm, tokenloom.chat_template; "
        "print([name for name in sys.modules if name.startswith('tokenloom.api')])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == "[]"


# -- who is at fault when a template fails -----------------------------------------------------------

FAILS_ON_TOOL_MESSAGES = (
    "{% for m in messages %}\n{{ m.role }}\n{% if m.role == 'tool' %}{{ m.content + 1 }}{% endif %}\n{% endfor %}"
)


def test_a_server_template_failing_on_a_well_formed_request_is_a_500_saying_where(tokenizer):
    renderer = ChatRenderer(tokenizer, server_template=FAILS_ON_TOOL_MESSAGES)
    with pytest.raises(ChatTemplateError) as info:
        renderer.render(TOOL_HISTORY)
    assert info.value.status_code == 500
    assert "messages[2]" in info.value.message and "template line 3" in info.value.message
    assert "TypeError" in info.value.message


def test_a_request_template_failing_is_the_requests_400_saying_where(tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        ChatRenderer(tokenizer).render(TOOL_HISTORY, chat_template=FAILS_ON_TOOL_MESSAGES)
    assert info.value.param == "chat_template"
    assert "messages[2]" in info.value.message and "template line 3" in info.value.message


def test_a_server_template_that_is_not_jinja_fails_the_start(tokenizer):
    with pytest.raises(ConfigError, match="--chat-template is not valid Jinja"):
        ChatRenderer(tokenizer, server_template="{% for %}")


# -- request templates are code: refused unless trusted, and bounded always (issue 20 item 1) --------


def test_request_templates_need_the_trust_flag(tokenizer):
    renderer = ChatRenderer(tokenizer, trust_request_chat_template=False)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="--trust-request-chat-template") as info:
        renderer.render(messages, chat_template="{{ messages[0].content }}")
    assert info.value.param == "chat_template"
    assert renderer.render(messages) == ChatRenderer(tokenizer).render(messages)  # the model's own still works


def test_a_model_template_named_in_the_request_is_not_request_code(tokenizer):
    renderer = ChatRenderer(tokenizer, trust_request_chat_template=False)
    renderer.model_template = {"default": "D{{ messages[0].content }}", "tool_use": "T{{ messages[0].content }}"}
    assert renderer.render([{"role": "user", "content": "x"}], chat_template="tool_use") == "Tx"


HOSTILE_TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a list": "{% set l = range(100000) | list %}{% for i in l %}{% for j in l %}{% endfor %}"
    "{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "string repetition": "{{ 'x' * 10**10 }}",
    "list repetition": "{% set l = [1] * 10**10 %}",
    "doubling by concatenation": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s | length }}",
    "doubling by +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "huge integer": "{{ 10 ** (10 ** 9) }}",
    "squaring integers": "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
    "{% endfor %}",
    "center method": "{{ 'x'.center(10**10) }}",
    "center filter": "{{ 'x' | center(9999999999) }}",
    "ljust method": "{{ 'x'.ljust(10**10) }}",
    "printf width": "{{ '%9999999999d' % 1 }}",
    "format filter width": "{{ '%9999999999d' | format(1) }}",
    "str.format width": "{{ '{:>9999999999}'.format(1) }}",
    "str.format nested width": "{{ '{:{}}'.format(1, 10**10) }}",
    "replace": "{% set s = 'x' * 1000 %}{{ s.replace('x', s).replace('x', s) }}",
    "replace filter": "{% set s = 'x' * 1000 %}{{ s | replace('x', s) | replace('x', s) }}",
    "join": "{% set s = 'x' * 100000 %}{{ s.join(range(100000) | map('string')) }}",
    "join filter": "{% set s = 'x' * 100000 %}{{ range(100000) | join(s) }}",
    "indent": "{% set s = '\\n' * 100000 %}{{ s | indent(100000) }}",
    "tojson indent": "{{ messages | tojson(indent=10**9) }}",
    "batch": "{{ [1] | batch(10**10, 'x') | list }}",
    "lipsum": "{{ lipsum(10**8) }}",
    "output": "{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_request_templates_are_quick_400s(tokenizer, monkeypatch, name):
    monkeypatch.setattr(chat_template, "DEFAULT_LIMITS", RenderLimits(seconds=1.0))
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        ChatRenderer(tokenizer).render([{"role": "user", "content": "x"}], chat_template=HOSTILE_TEMPLATES[name])
    assert time.monotonic() - started < 5
    assert info.value.param == "chat_template"
    # the budget's own refusal, or Python's recursion limit reported as the template's failure
    assert re.search(r"simplify the request's chat_template$|RecursionError", info.value.message), info.value.message


def test_a_hostile_server_template_is_the_servers_500(tokenizer):
    renderer = ChatRenderer(tokenizer, server_template=HOSTILE_TEMPLATES["string repetition"])
    with pytest.raises(ChatTemplateError, match="limit"):
        renderer.render([{"role": "user", "content": "x"}])


def test_the_size_limit_grows_with_the_input(tokenizer):
    # a legitimate template may write its (large) input out several times
    renderer = ChatRenderer(tokenizer, limits=RenderLimits(base_chars=1000, chars_per_input_char=4))
    long_text = "y" * 5000
    template = "{% for m in messages %}{{ m.content }}{{ m.content }}{{ m.content }}{% endfor %}"
    assert renderer.render([{"role": "user", "content": long_text}], chat_template=template) == long_text * 3
    with pytest.raises(InvalidRequestError, match="limit"):
        renderer.render(
            [{"role": "user", "content": long_text}],
            chat_template="{% for i in range(6) %}" + template + "{% endfor %}",
        )


def test_templates_loops_still_see_loop_variables(tokenizer):
    template = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}"
        "{{ loop.nextitem.role if loop.nextitem is defined }};{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ChatRenderer(tokenizer).render(messages, chat_template=template) == "1/2assistant;2/2!;"


@pytest.mark.anyio
async def test_render_async_answers_by_the_deadline_and_keeps_the_loop_free(tokenizer, monkeypatch):
    monkeypatch.setattr(chat_template, "DEFAULT_LIMITS", RenderLimits(seconds=1.0))
    renderer = ChatRenderer(tokenizer)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        with pytest.raises(InvalidRequestError, match="longer than"):
            await renderer.render_async(
                [{"role": "user", "content": "x"}], chat_template=HOSTILE_TEMPLATES["nested loops"]
            )
        group.cancel_scope.cancel()
    assert ticks >= 10  # the event loop kept running while the template spun


# -- over HTTP (the real app, a fake engine) --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_request_templates_are_refused_over_http_naming_the_flag(make_app, engine, path):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "chat_template": "{{ messages[0].content }}",
    }
    async with client_for(make_app()) as client:
        response = await client.post(path, json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "--trust-request-chat-template" in error["message"] and error["param"] == "chat_template"
        assert not engine.requests
    async with client_for(make_app(trust_request_chat_template=True)) as client:
        assert (await client.post(path, json=body)).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_health_answers_while_a_hostile_template_is_refused(make_app, engine, monkeypatch, path):
    monkeypatch.setattr(chat_template, "DEFAULT_LIMITS", RenderLimits(seconds=2.0))
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "chat_template": HOSTILE_TEMPLATES["nested loops"],
    }
    outcome = {}
    async with client_for(make_app(trust_request_chat_template=True)) as client:

        async def hostile():
            outcome["response"] = await client.post(path, json=body)

        async with anyio.create_task_group() as group:
            group.start_soon(hostile)
            await anyio.sleep(0.3)
            for _ in range(3):
                started = time.monotonic()
                health = await client.get("/health")
                assert health.status_code == 200 and time.monotonic() - started < 0.5
                assert "response" not in outcome  # still being refused
                await anyio.sleep(0.2)
    response = outcome["response"]
    assert response.status_code == 400
    assert "longer than 2 s" in response.json()["error"]["message"]
    assert not engine.requests


@pytest.mark.anyio
async def test_a_server_template_failing_is_a_500_over_http(make_app, engine):
    async with client_for(make_app(chat_template=FAILS_ON_TOOL_MESSAGES)) as client:
        response = await client.post("/v1/chat/completions", json={"messages": TOOL_HISTORY, "max_tokens": 1})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "InternalServerError"
    assert "messages[2]" in error["message"] and "template line 3" in error["message"]


@pytest.mark.anyio
async def test_the_tool_history_renders_and_tokenizes_over_http(client, engine, tokenizer):
    response = await client.post(
        "/v1/chat/completions", json={"messages": TOOL_HISTORY, "tools": [WEATHER_TOOL], "max_tokens": 1}
    )
    assert response.status_code == 200, response.text
    tokenized = await client.post("/tokenize", json={"messages": TOOL_HISTORY})
    assert tokenized.json()["tokens"] == engine.requests[0].prompt


@pytest.mark.anyio
async def test_large_inputs_tokenize_off_the_loop_with_the_same_result(client, tokenizer, monkeypatch):
    from tokenloom.api import prompt_inputs

    calls = []
    real_run_sync = anyio.to_thread.run_sync

    async def recording_run_sync(function, *args, **kwargs):
        calls.append(getattr(function, "__name__", repr(function)))
        return await real_run_sync(function, *args, **kwargs)

    monkeypatch.setattr(prompt_inputs.anyio.to_thread, "run_sync", recording_run_sync)
    text = "tokenize me " * (prompt_inputs.OFF_LOOP_TOKENIZE_CHARS // 12 + 1)
    response = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert response.json()["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "tokenize_text" in calls
    calls.clear()
    await client.post("/tokenize", json={"prompt": "short", "add_special_tokens": False})
    assert "tokenize_text" not in calls
