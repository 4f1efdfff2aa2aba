"""Chat prompts: which template applies (request, ``--chat-template``, the model's), how
message content reaches it (``--chat-template-content-format``), and rendering with Jinja2
the way transformers' ``apply_chat_template`` renders (same sandbox, options, globals and
``tojson``), so a prompt is the same string either way.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenloom.errors import ConfigError, InvalidRequestError

CONTENT_FORMATS = ("auto", "string", "openai")
TEXT_PART_TYPES = ("text", "input_text")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# names the renderer itself passes; chat_template_kwargs may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_CONTINUE_TAG = "TOKENLOOM_CONTINUE_FINAL_MESSAGE "
NO_TEMPLATE_MESSAGE = (
    "this model has no chat template, so /v1/chat/completions cannot build a prompt; start the server "
    "with --chat-template FILE_OR_TEMPLATE, pass \"chat_template\" in the request, or use /v1/completions"
)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the contents of the file when ``value`` is an existing path, else
    ``value`` itself as the template text (or the name of one of the model's named templates)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as template_file:
            return template_file.read()
    looks_like_path = not any(marker in value for marker in ("{{", "{%", "\n")) and (
        os.sep in value or value.endswith((".jinja", ".jinja2", ".j2")))
    if looks_like_path:
        raise ConfigError(f"--chat-template {value!r}: no such file (and it is not a Jinja template either)",
                          param="--chat-template")
    return value


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker)
    renders its body unchanged: the mask is of no use to a server."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    # dunder or underscore attributes on a namespace would reach CPython internals
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' semantics: no HTML escaping (Jinja's own filter escapes <, >, &, ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


@lru_cache(maxsize=1)
def template_environment() -> ImmutableSandboxedEnvironment:
    # chat templates are untrusted code (from the Hub, or from a request): sandboxed
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _TemplateNamespace
    return environment


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    try:
        return template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno})",
                                  param="chat_template") from None


def _is_content_access(node: jinja2.nodes.Node, content_names: set[str]) -> bool:
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in content_names


@lru_cache(maxsize=64)
def detect_content_format(source: str) -> str:
    """``openai`` when the template loops over a message's content (it expects a list of
    parts), else ``string``."""
    try:
        tree = template_environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    content_names: set[str] = set()
    for assign in tree.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content_access(assign.node, set()):
            content_names.add(assign.target.name)
    for loop in tree.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter, content_names):
            return "openai"
    return "string"


def _text_of_parts(parts: list, where: str) -> list[str]:
    texts = []
    for part_index, part in enumerate(parts):
        part_where = f"{where}[{part_index}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise InvalidRequestError(f"{part_where} must be an object like {{\"type\": \"text\", \"text\": ...}}",
                                      param=part_where)
        part_type = part.get("type")
        if part_type not in TEXT_PART_TYPES:
            raise InvalidRequestError(
                f"{part_where}: content parts of type {part_type!r} are not supported (this model takes text "
                "only); send {\"type\": \"text\", \"text\": ...} parts or a string", param=part_where)
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{part_where}.text must be a string", param=f"{part_where}.text")
        texts.append(part["text"])
    return texts


def normalize_messages(messages: list[Any], content_format: str) -> list[dict[str, Any]]:
    """Messages as the template expects them: content as one string (``string``) or as a
    list of text parts (``openai``); tool-call arguments parsed from JSON text into objects,
    since templates render them with ``tojson`` or iterate their items."""
    normalized = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"{where}.role is required and must be a string", param=f"{where}.role")
        message = dict(message)
        content = message.get("content")
        if content is None:
            message["content"] = None if message.get("tool_calls") else ("" if content_format == "string" else [])
        elif isinstance(content, str):
            message["content"] = content if content_format == "string" else [{"type": "text", "text": content}]
        elif isinstance(content, list):
            texts = _text_of_parts(content, f"{where}.content")
            message["content"] = ("\n".join(texts) if content_format == "string"
                                  else [{"type": "text", "text": text} for text in texts])
        else:
            raise InvalidRequestError(f"{where}.content must be a string or a list of content parts",
                                      param=f"{where}.content")
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_parse_tool_call_arguments(call) for call in message["tool_calls"]]
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            # templates read reasoning under one name or another; transformers fills both
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _parse_tool_call_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def message_text(message: dict[str, Any]) -> str:
    """A request message's content as plain text (for chat ``echo``)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_of_parts(content, "content"))
    return ""


class ChatRenderer:
    """Renders conversations for one model: its template, the server's override, the
    content format and the tokenizer's special tokens."""

    def __init__(self, tokenizer: Any, server_template: str | None = None, content_format: str = "auto"):
        if content_format not in CONTENT_FORMATS:
            raise ConfigError(f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}, "
                              f"got {content_format!r}", param="--chat-template-content-format")
        self.tokenizer = tokenizer
        self.server_template = server_template
        self.content_format = content_format
        self.model_template = getattr(tokenizer, "chat_template", None)
        special_tokens = getattr(tokenizer, "special_tokens_map", None) or {}
        self.special_tokens = {name: value for name, value in special_tokens.items()}

    def template_source(self, request_template: str | None = None, has_tools: bool = False) -> str:
        """The template that applies: the request's, else ``--chat-template``, else the model's."""
        for candidate in (request_template, self.server_template):
            if candidate is None:
                continue
            if isinstance(self.model_template, dict) and candidate in self.model_template:
                return self.model_template[candidate]  # the name of one of the model's templates
            return candidate
        template = self.model_template
        if isinstance(template, dict):
            template = template.get("tool_use") if has_tools and "tool_use" in template else template.get("default")
        if not template:
            raise InvalidRequestError(NO_TEMPLATE_MESSAGE, param="chat_template")
        return template

    def resolved_content_format(self, source: str) -> str:
        return detect_content_format(source) if self.content_format == "auto" else self.content_format

    def render(self, messages: list[Any], *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict] | None = None, documents: list[dict] | None = None,
               chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true; set "
                                      "add_generation_prompt to false to continue the last message",
                                      param="continue_final_message")
        extra = dict(chat_template_kwargs or {})
        clashing = sorted(RESERVED_TEMPLATE_VARIABLES & set(extra))
        if clashing:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(clashing)}: use the request "
                                      "fields of the same names", param="chat_template_kwargs")
        source = self.template_source(chat_template, has_tools=bool(tools))
        template = compile_template(source)
        chat = normalize_messages(messages, self.resolved_content_format(source))
        continued_text = self._tag_final_message(chat) if continue_final_message else None
        variables = {**self.special_tokens, **extra}
        try:
            rendered = template.render(messages=chat, tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template could not render these messages: {exc}",
                                      param="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRequestError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                                      param="messages") from None
        if continued_text is not None:
            rendered = self._cut_after_final_message(rendered, continued_text)
        return rendered

    @staticmethod
    def _tag_final_message(chat: list[dict[str, Any]]) -> str:
        """Appends a tag to the last message's text; the prompt is cut where it lands."""
        final = chat[-1]
        content = final.get("content")
        if isinstance(content, list):
            for part in reversed(content):
                if isinstance(part, dict) and "text" in part:
                    original = part["text"]
                    part["text"] = original + _CONTINUE_TAG
                    return original
            raise InvalidRequestError("continue_final_message: the last message has no text to continue",
                                      param="continue_final_message")
        if not isinstance(content, str):
            raise InvalidRequestError("continue_final_message: the last message has no content to continue",
                                      param="continue_final_message")
        final["content"] = content + _CONTINUE_TAG
        return content

    @staticmethod
    def _cut_after_final_message(rendered: str, continued_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        position = rendered.rfind(tag)
        if position < 0 or continued_text.strip() not in rendered:
            raise InvalidRequestError("continue_final_message: the chat template drops or changes the last "
                                      "message, so it cannot be continued", param="continue_final_message")
        if rendered[position:position + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:position]
        # the template trimmed the message, and with it the tag's trailing space
        return rendered[:position].rstrip()
