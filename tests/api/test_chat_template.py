"""The chat-template renderer: identical strings to transformers' apply_chat_template,
content-format detection, transformers' template globals and filters, and where a
template comes from."""

from __future__ import annotations

import pytest

from tokenloom.chat_template import (
    ChatRenderer,
    detect_content_format,
    load_chat_template,
    normalize_messages,
)
from tokenloom.errors import ConfigError, InvalidRequestError

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke\nwith two lines."}],
    [{"role": "user", "content": "Unicode: héllo ✓ 日本語 <tag> & \"quotes\""}],
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(tokenizer, conversation, add_generation_prompt):
    expected = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    rendered = ChatRenderer(tokenizer).render(conversation, add_generation_prompt=add_generation_prompt)
    assert rendered == expected


def test_continue_final_message_matches_transformers(tokenizer):
    conversation = [{"role": "user", "content": "Write a haiku"},
                    {"role": "assistant", "content": "Autumn moonlight,"}]
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
    expected = tokenizer.apply_chat_template(conversation, tools=tools, documents=documents, chat_template=template,
                                             tokenize=False, flavour="mint")
    rendered = ChatRenderer(tokenizer).render(conversation, tools=tools, documents=documents, chat_template=template,
                                              chat_template_kwargs={"flavour": "mint"})
    assert rendered == expected
    assert '"héllo <b>"' in rendered  # ensure_ascii=False and no HTML escaping


def test_raise_exception_is_a_400_with_the_templates_message(tokenizer):
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system message first, please') }}{% endif %}"
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


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
])
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
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(InvalidRequestError, match="'image_url'") as info:
        ChatRenderer(tokenizer).render(messages)
    assert info.value.param == "messages[0].content[1]"


def test_tool_call_arguments_are_parsed_for_templates():
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}
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


def test_unknown_content_format_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError, match="content-format"):
        ChatRenderer(tokenizer, content_format="xml")
