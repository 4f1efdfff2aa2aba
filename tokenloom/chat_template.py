"""Chat prompts: which template applies (request, ``--chat-template``, the model's), how
message content reaches it (``--chat-template-content-format``), and rendering with Jinja2
the way transformers' ``apply_chat_template`` renders (same sandbox, options, globals and
``tojson``), so a prompt is the same string either way.

Shared by the server and the offline ``LLM.chat``, so it lives outside ``api/``. Every
template is untrusted code, whoever supplied it: it renders in Jinja's sandbox under a
time limit and a size limit (:class:`RenderLimits`), and the server renders off the event
loop (:meth:`ChatRenderer.render_async`).
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import os
import re
import string
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import anyio
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenloom.errors import ConfigError, InvalidRequestError, TokenloomError

logger = logging.getLogger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")
TEXT_PART_TYPES = ("text", "input_text")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# names the renderer itself passes; chat_template_kwargs may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# the tokenizer's special-token variables (transformers' names), reserved even when this
# tokenizer lacks one: a template that tests ``bos_token is defined`` must not be steered
SPECIAL_TOKEN_VARIABLES = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)
_CONTINUE_TAG = "TOKENLOOM_CONTINUE_FINAL_MESSAGE "
NO_TEMPLATE_MESSAGE = (
    "this model has no chat template, so /v1/chat/completions cannot build a prompt; start the server "
    'with --chat-template FILE_OR_TEMPLATE, pass "chat_template" in the request (the server needs '
    "--trust-request-chat-template for that), or use /v1/completions"
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
        os.sep in value or value.endswith((".jinja", ".jinja2", ".j2"))
    )
    if looks_like_path:
        raise ConfigError(
            f"--chat-template {value!r}: no such file (and it is not a Jinja template either)", param="--chat-template"
        )
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


class ChatTemplateError(TokenloomError):
    """A well-formed request that the server's chat template (``--chat-template`` or the
    model's) failed to render: the server's problem, so a 500 that names the message and the
    template line."""

    status_code = 500
    error_type = "InternalServerError"


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one render, whoever wrote the template: a template is a program, and one
    that loops for ever or builds a huge string must cost its request an error, not stall the
    server."""

    seconds: float = 10.0
    """Wall-clock time one render may take (checked at every loop step, call, attribute
    access and operator inside the template)."""
    base_chars: int = 1 << 20
    """Characters any string or list built by a template may hold, plus ``chars_per_input_char``
    for each character of the request's messages, tools and documents."""
    chars_per_input_char: int = 4
    max_int_bits: int = 1 << 16
    """Size of the integers a template may compute (``10 ** (10 ** 9)`` takes minutes)."""

    def max_chars(self, input_chars: int) -> int:
        return self.base_chars + self.chars_per_input_char * input_chars


class TemplateBudgetExceeded(Exception):
    """A template went over its :class:`RenderLimits`; deliberately not a Jinja error."""


class _RenderBudget:
    """The limits of the render running in this context (see ``_active_budget``)."""

    def __init__(self, limits: RenderLimits, input_chars: int, message_ids: dict[int, int]):
        self.limits = limits
        self.max_chars = limits.max_chars(input_chars)
        self.deadline = time.monotonic() + limits.seconds
        self.steps = 0
        self.message_ids = message_ids  # id(normalized message) -> its index in the request
        self.last_message_index: int | None = None

    def step(self) -> None:
        self.steps += 1
        if self.steps & 255 == 0 and time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(f"the chat template took longer than {self.limits.seconds:g} s to render")


# the budget of the render on this thread (renders run in worker threads, one at a time each)
_active_budget: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)
_STATIC_LIMITS = RenderLimits()
DEFAULT_LIMITS = RenderLimits()  # a renderer's limits unless given others


def _max_chars() -> int:
    budget = _active_budget.get()
    # outside a render (constant folding while compiling): the input-independent bound
    return budget.max_chars if budget is not None else _STATIC_LIMITS.base_chars


def _step() -> None:
    budget = _active_budget.get()
    if budget is not None:
        budget.step()


def _too_big(what: str, size: int) -> TemplateBudgetExceeded:
    return TemplateBudgetExceeded(
        f"the chat template tried to build {what} of {size} characters or items "
        f"(the limit for this request is {_max_chars()})"
    )


def _check_size(size: int, what: str = "a string or list") -> None:
    if size > _max_chars():
        raise _too_big(what, size)


def _sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)):
        _check_size(len(value))
    return value


def _check_width(value: Any, what: str) -> None:
    if isinstance(value, int) and value > _max_chars():
        raise _too_big(what, value)


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(template_text: str) -> None:
    for width, precision in _PRINTF_SPEC.findall(template_text):
        for number in (width, precision):
            if number == "*":
                raise TemplateBudgetExceeded("the chat template used a '*' width in %-formatting; write the width")
            if number and int(number) > _max_chars():
                raise _too_big("a %-formatted field", int(number))


def _check_str_format(template_text: str) -> None:
    try:
        fields = list(string.Formatter().parse(template_text))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise TemplateBudgetExceeded("the chat template used a nested {} width in str.format; write the width")
        for number in re.findall(r"\d+", spec or ""):
            if int(number) > _max_chars():
                raise _too_big("a formatted field", int(number))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    limits = _active_budget.get()
    max_int_bits = limits.limits.max_int_bits if limits is not None else _STATIC_LIMITS.max_int_bits
    both_ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and both_ints and abs(left) > 1 and right > 0:
        if right * left.bit_length() > max_int_bits:
            raise TemplateBudgetExceeded(
                f"the chat template tried to compute {left} ** {right}, an integer of more than {max_int_bits} bits"
            )
    elif operator == "*" and both_ints:
        if left.bit_length() + right.bit_length() > max_int_bits:
            raise TemplateBudgetExceeded(
                f"the chat template tried to compute a product of more than {max_int_bits} bits"
            )
    elif operator == "*":
        for sequence, times in ((left, right), (right, left)):
            if isinstance(sequence, (str, list, tuple)) and isinstance(times, int):
                _check_size(len(sequence) * max(times, 0))
    elif operator == "%" and isinstance(left, str):
        _check_printf(left)


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Pre-checks for the str methods whose result can be far larger than their inputs;
    returns the arguments to call with (an iterable given to ``join`` is read once, here)."""
    text, name = method.__self__, method.__name__
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _check_width(args[0], f"a {name}() string")
    elif name == "expandtabs":
        tab_size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab_size, int):
            _check_size(len(text) + text.count("\t") * tab_size)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = text.count(old) if old else len(text) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        _check_size(len(text) + count * max(len(new) - len(old), 0))
    elif name == "join" and args:
        items = list(args[0])
        _check_size(len(text) * max(len(items) - 1, 0) + sum(len(item) for item in items if isinstance(item, str)))
        args = (items, *args[1:])
    return args


class _LoopAndConcatGuard(jinja2.visitor.NodeTransformer):
    """Routes every ``for`` loop's iterable and every ``~`` concatenation through the
    environment's guards: a loop with an empty body calls nothing else the sandbox sees."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = jinja2.nodes.Call(
            jinja2.nodes.EnvironmentAttribute("guard_loop"), [node.iter], [], None, None, lineno=node.iter.lineno
        )
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return jinja2.nodes.Call(
            jinja2.nodes.EnvironmentAttribute("guard_size"), [node], [], None, None, lineno=node.lineno
        )


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, plus the time and size bounds of the active
    :class:`_RenderBudget`: checked at every call, attribute or item access, loop step and
    the operators that can amplify (``*``, ``**``, ``%``, ``+``)."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def _generate(self, source, name, filename, defer_init=False):
        # the documented hook between parsing and code generation
        source = _LoopAndConcatGuard().visit(source)
        return super()._generate(source, name, filename, defer_init=defer_init)

    def guard_loop(self, iterable: Any):
        _step()
        for item in iterable:
            _step()
            yield item

    def guard_size(self, value: Any) -> Any:
        _step()
        return _sized(value)

    def call_binop(self, context, operator, left, right):
        _step()
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def call(self, context, callable_object, /, *args, **kwargs):
        _step()
        if isinstance(getattr(callable_object, "__self__", None), str):
            args = _check_str_method(callable_object, args, kwargs)
        return _sized(super().call(context, callable_object, *args, **kwargs))

    def wrap_str_format(self, value):
        # str.format reaches templates as this wrapper, never through call()
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_str_format(value.__self__)
        return wrapped

    def getattr(self, obj, attribute):
        self._note_message(obj)
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._note_message(obj)
        return super().getitem(obj, argument)

    @staticmethod
    def _note_message(obj: Any) -> None:
        budget = _active_budget.get()
        if budget is not None:
            budget.step()
            index = budget.message_ids.get(id(obj))
            if index is not None:
                budget.last_message_index = index


def _guarded_filter(filter_function, precheck):
    """``filter_function`` with ``precheck`` run on its arguments (after the context argument
    Jinja passes some filters) and its result's size checked; ``precheck`` may return a
    replacement for the filtered value (an iterable it had to read)."""
    skip = 1 if getattr(filter_function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(filter_function)  # keeps jinja_pass_arg
    def guarded(*args, **kwargs):
        _step()
        replacement = precheck(*args[skip:], **kwargs)
        if replacement is not None:
            args = (*args[:skip], replacement, *args[skip + 1 :])
        return _sized(filter_function(*args, **kwargs))

    return guarded


def _precheck_center(value=None, width=80, *_, **__):
    _check_width(width, "a centred string")


def _precheck_indent(text="", width=4, *_, **__):
    pad = len(width) if isinstance(width, str) else width
    if isinstance(pad, int):
        _check_size(len(str(text)) + (str(text).count("\n") + 1) * pad)


def _precheck_format(value="", *_, **__):
    if isinstance(value, str):
        _check_printf(value)


def _precheck_replace(text="", old="", new="", count=None, *_, **__):
    text, old, new = str(text), str(old), str(new)
    times = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    _check_size(len(text) + times * max(len(new) - len(old), 0))


def _precheck_join(value=(), d="", attribute=None, *_, **__):
    items = list(value)
    _check_size(len(str(d)) * max(len(items) - 1, 0) + sum(len(str(item)) for item in items))
    return items


def _precheck_count(value=None, count=0, *_, **__):
    _check_width(count, "a list of batches or slices")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' semantics: no HTML escaping (Jinja's own filter escapes <, >, &, ')
    for spacing in (indent, *(separators or ())):
        size = len(spacing) if isinstance(spacing, str) else spacing
        if isinstance(size, int) and size > 256:
            raise TemplateBudgetExceeded(
                f"the chat template asked tojson for an indent or separator of {size} characters (at most 256)"
            )
    return _sized(
        json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )


def _lipsum(n=5, *args, **kwargs):
    _check_width(n * 1000, "lorem ipsum")
    return jinja2.utils.generate_lorem_ipsum(n, *args, **kwargs)


class _RaisedByTemplate(jinja2.exceptions.TemplateError):
    """``raise_exception(...)``: the template refusing the conversation (a 400)."""


def _raise_exception(message):
    raise _RaisedByTemplate(message)


def _strftime_now(format_string):
    return datetime.now().strftime(format_string)


@lru_cache(maxsize=1)
def template_environment() -> ImmutableSandboxedEnvironment:
    # chat templates are untrusted code (from the Hub, or from a request): sandboxed and bounded
    environment = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    for name, precheck in (
        ("center", _precheck_center),
        ("indent", _precheck_indent),
        ("format", _precheck_format),
        ("replace", _precheck_replace),
        ("join", _precheck_join),
        ("batch", _precheck_count),
        ("slice", _precheck_count),
    ):
        environment.filters[name] = _guarded_filter(environment.filters[name], precheck)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _TemplateNamespace
    environment.globals["lipsum"] = _lipsum
    return environment


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    try:
        return template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(
            f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno})", param="chat_template"
        ) from None


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


def _text_of_parts(parts: list, where: str, placeholders: dict[str, str] | None = None) -> list[str | None]:
    """Each part's text; None for an image part (``{"type": "image"}``, what the server makes of
    an ``image_url`` part) when ``placeholders`` has one for images."""
    texts: list[str | None] = []
    for part_index, part in enumerate(parts):
        part_where = f"{where}[{part_index}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise InvalidRequestError(
                f'{part_where} must be an object like {{"type": "text", "text": ...}}', param=part_where
            )
        part_type = part.get("type")
        if part_type == "image" and placeholders and "image" in placeholders:
            texts.append(None)
            continue
        if part_type not in TEXT_PART_TYPES:
            raise InvalidRequestError(
                f"{part_where}: content parts of type {part_type!r} are not supported (this model takes text "
                'only); send {"type": "text", "text": ...} parts or a string',
                param=part_where,
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{part_where}.text must be a string", param=f"{part_where}.text")
        texts.append(part["text"])
    return texts


def normalize_messages(
    messages: list[Any], content_format: str, placeholders: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Messages as the template expects them, as vLLM prepares them, for every role: content
    as one string (``string``: absent or null content is ``""``, text parts are joined by
    newlines) or as a list of text parts (``openai``: absent or null content is ``[]``);
    ``tool_calls`` and ``tool_call_id`` passed through, tool-call arguments parsed from JSON
    text into objects (templates render them with ``tojson`` or iterate their items); fields
    sent as null left out, as if absent (clients send back ``"function_call": null`` and the
    like, and templates test ``is defined``). An image part stays ``{"type": "image"}`` in the
    ``openai`` format and becomes the model's placeholder text (``placeholders["image"]``) in
    the ``string`` format."""
    normalized = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'", param=where)
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"{where}.role is required and must be a string", param=f"{where}.role")
        content = message.get("content")
        message = {key: value for key, value in message.items() if value is not None}
        if content is None:
            message["content"] = "" if content_format == "string" else []
        elif isinstance(content, str):
            message["content"] = content if content_format == "string" else [{"type": "text", "text": content}]
        elif isinstance(content, list):
            texts = _text_of_parts(content, f"{where}.content", placeholders)
            image_text = (placeholders or {}).get("image", "")
            message["content"] = (
                "\n".join(image_text if text is None else text for text in texts)
                if content_format == "string"
                else [{"type": "image"} if text is None else {"type": "text", "text": text} for text in texts]
            )
        else:
            raise InvalidRequestError(
                f"{where}.content must be a string, a list of content parts or null", param=f"{where}.content"
            )
        if "tool_calls" in message:
            message["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if "tool_call_id" in message and not isinstance(message["tool_call_id"], str):
            raise InvalidRequestError(
                f"{where}.tool_call_id must be a string (the id of the call it answers)", param=f"{where}.tool_call_id"
            )
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            # templates read reasoning under one name or another; transformers fills both
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list of tool calls", param=where)
    normalized = []
    for call_index, call in enumerate(calls):
        call_where = f"{where}[{call_index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(
                f'{call_where} must be like {{"id": ..., "type": "function", "function": '
                '{"name": ..., "arguments": "{...}"}}',
                param=call_where,
            )
        normalized.append({**call, "function": {**function, "arguments": _parsed_arguments(function.get("arguments"))}})
    return normalized


def _parsed_arguments(arguments: Any) -> Any:
    """Arguments as the template expects them: an object (vLLM's and transformers' convention);
    none or empty are ``{}``; text that is not JSON stays text (templates test ``is string``)."""
    if arguments is None or arguments == "":
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def message_text(message: dict[str, Any]) -> str:
    """A request message's content as plain text (for chat ``echo``)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(text for text in _text_of_parts(content, "content") if text is not None)
    return ""


def _input_chars(value: Any) -> int:
    """About how many characters of text ``value`` holds (what a template may reasonably echo)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(key)) + _input_chars(item) + 4 for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_input_chars(item) + 2 for item in value)
    return 8


def _template_line(exc: BaseException) -> int | None:
    """The template line where ``exc`` was raised (Jinja rewrites tracebacks to point there)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# what a template failing on Python-level errors raises; anything else is a bug of ours
_TEMPLATE_FAILURES = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    KeyError,
    AttributeError,
    IndexError,
    ZeroDivisionError,
    OverflowError,
    RecursionError,
    LookupError,
    ArithmeticError,
)
# how long past its own deadline a render may run before the server stops waiting for it
# (a single C-level operation the sandbox cannot interrupt)
ABANDON_GRACE_SECONDS = 5.0


class ChatRenderer:
    """Renders conversations for one model: its template, the server's override, the
    content format and the tokenizer's special tokens.

    :param trust_request_chat_template: accept a template in the request (``chat_template``);
        the server's ``--trust-request-chat-template``. The offline ``LLM`` trusts its caller.
    :param limits: the time and size bounds of one render.
    :param placeholders: modality -> the text an item renders as in a ``string``-format template
        (none: image parts are refused, the model takes text only).
    """

    def __init__(
        self,
        tokenizer: Any,
        server_template: str | None = None,
        content_format: str = "auto",
        *,
        trust_request_chat_template: bool = True,
        limits: RenderLimits | None = None,
        placeholders: dict[str, str] | None = None,
    ):
        if content_format not in CONTENT_FORMATS:
            raise ConfigError(
                f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}, got {content_format!r}",
                param="--chat-template-content-format",
            )
        self.tokenizer = tokenizer
        self.server_template = server_template
        self.content_format = content_format
        self.trust_request_chat_template = trust_request_chat_template
        self.limits = limits or DEFAULT_LIMITS
        # modality -> the text an item of it renders as (a model that sees: its processor's)
        self.placeholders = dict(placeholders or {})
        self.model_template = getattr(tokenizer, "chat_template", None)
        special_tokens = getattr(tokenizer, "special_tokens_map", None) or {}
        self.special_tokens = {name: value for name, value in special_tokens.items()}
        self._template_own_names = (
            frozenset(template_environment().globals) | SPECIAL_TOKEN_VARIABLES | frozenset(self.special_tokens)
        )
        if server_template is not None and not self._is_model_template_name(server_template):
            try:  # a broken --chat-template fails the start, not every request
                template_environment().from_string(server_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ConfigError(
                    f"--chat-template is not valid Jinja: {exc.message} (line {exc.lineno})", param="--chat-template"
                ) from None

    def _is_model_template_name(self, value: str) -> bool:
        return isinstance(self.model_template, dict) and value in self.model_template

    def template_source(self, request_template: str | None = None, has_tools: bool = False) -> str:
        """The template that applies: the request's, else ``--chat-template``, else the model's."""
        return self._template_source(request_template, has_tools)[0]

    def _template_source(self, request_template: str | None, has_tools: bool) -> tuple[str, bool]:
        """The template's text, and whether the request wrote it."""
        if request_template is not None:
            if self._is_model_template_name(request_template):
                return self.model_template[request_template], False  # one of the model's named templates
            if not self.trust_request_chat_template:
                raise InvalidRequestError(
                    "this server does not accept chat templates in requests: a template is code that runs on the "
                    'server. Leave out "chat_template" (the server\'s template applies), or start the server with '
                    "--trust-request-chat-template",
                    param="chat_template",
                )
            return request_template, True
        if self.server_template is not None:
            if self._is_model_template_name(self.server_template):
                return self.model_template[self.server_template], False
            return self.server_template, False
        template = self.model_template
        if isinstance(template, dict):
            template = template.get("tool_use") if has_tools and "tool_use" in template else template.get("default")
        if not template:
            raise InvalidRequestError(NO_TEMPLATE_MESSAGE, param="chat_template")
        return template, False

    def resolved_content_format(self, source: str) -> str:
        return detect_content_format(source) if self.content_format == "auto" else self.content_format

    async def render_async(self, messages: list[Any], **options: Any) -> str:
        """:meth:`render` in a worker thread, so that a slow template never stalls the event
        loop; the request is answered by the deadline even if the thread is stuck in one
        operation the sandbox cannot interrupt (it then finishes on its own)."""
        wait_seconds = self.limits.seconds + ABANDON_GRACE_SECONDS
        with anyio.move_on_after(wait_seconds):
            return await anyio.to_thread.run_sync(
                functools.partial(self.render, messages, **options), abandon_on_cancel=True
            )
        message = (
            f"the chat template did not finish rendering within {wait_seconds:g} s "
            f"(the limit is {self.limits.seconds:g} s)"
        )
        if options.get("chat_template") is not None and not self._is_model_template_name(options["chat_template"]):
            raise InvalidRequestError(message, param="chat_template")
        raise ChatTemplateError(message, param="messages")

    def render(
        self,
        messages: list[Any],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "add_generation_prompt and continue_final_message cannot both be true; set "
                "add_generation_prompt to false to continue the last message",
                param="continue_final_message",
            )
        extra = dict(chat_template_kwargs or {})
        clashing = sorted(RESERVED_TEMPLATE_VARIABLES & set(extra))
        if clashing:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(clashing)}: use the request fields of the same names",
                param="chat_template_kwargs",
            )
        # a request's variable would shadow the template's functions (raise_exception,
        # namespace, ...) and the model's special tokens: what the template relies on is not
        # the request's to replace
        shadowing = sorted(set(extra) & self._template_own_names)
        if shadowing:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(map(repr, shadowing[:8]))}: the chat template's own "
                "functions and the model's special tokens cannot be replaced by a request; remove them",
                param="chat_template_kwargs",
            )
        source, from_request = self._template_source(chat_template, has_tools=bool(tools))
        try:
            template = compile_template(source)
        except InvalidRequestError as exc:
            if from_request:
                raise
            raise ChatTemplateError(
                f"the server's chat template is not valid Jinja: {exc.message}", param="chat_template"
            ) from None
        chat = normalize_messages(messages, self.resolved_content_format(source), self.placeholders)
        continued_text = self._tag_final_message(chat) if continue_final_message else None
        variables = {**self.special_tokens, **extra}
        budget = _RenderBudget(
            self.limits,
            _input_chars([messages, tools, documents, extra]),
            {id(message): index for index, message in enumerate(chat)},
        )
        token = _active_budget.set(budget)
        try:
            pieces = []
            size = 0
            for piece in template.generate(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ):
                size += len(piece)
                if size > budget.max_chars:
                    raise TemplateBudgetExceeded(
                        f"the chat template wrote more than {budget.max_chars} characters (the limit for this request)"
                    )
                pieces.append(piece)
            rendered = "".join(pieces)
        except _RaisedByTemplate as exc:
            # the template's own refusal of this conversation (roles out of order, ...)
            raise InvalidRequestError(
                f"the chat template refused these messages: {exc.message}", param="messages"
            ) from None
        except TemplateBudgetExceeded as exc:
            if from_request:
                raise InvalidRequestError(
                    f"{exc}; simplify the request's chat_template", param="chat_template"
                ) from None
            logger.error("%s (the server's chat template)", exc)
            raise ChatTemplateError(
                f"{exc}; the server's chat template is at fault or the request is unusually large", param="messages"
            ) from None
        except _TEMPLATE_FAILURES as exc:
            raise self._failure(exc, budget, from_request) from None
        finally:
            _active_budget.reset(token)
        if continued_text is not None:
            rendered = self._cut_after_final_message(rendered, continued_text)
        return rendered

    @staticmethod
    def _failure(exc: BaseException, budget: _RenderBudget, from_request: bool) -> TokenloomError:
        """A template that failed on messages that passed validation: the request's fault when
        the request wrote the template, else the server's (a 500 saying where)."""
        line = _template_line(exc)
        where = []
        if budget.last_message_index is not None:
            where.append(f"messages[{budget.last_message_index}]")
        if line is not None:
            where.append(f"template line {line}")
        detail = f"{type(exc).__name__}: {exc}" if not isinstance(exc, jinja2.TemplateError) else str(exc)
        place = f" (at {', '.join(where)})" if where else ""
        if from_request:
            return InvalidRequestError(f"the request's chat_template failed{place}: {detail}", param="chat_template")
        logger.error("the chat template failed on a well-formed request%s: %s", place, detail)
        return ChatTemplateError(
            f"the server's chat template failed on a well-formed request{place}: {detail}. "
            "This is a bug in the template (--chat-template or the model's), not in the "
            "request",
            param="messages",
            code="chat_template_error",
        )

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
            raise InvalidRequestError(
                "continue_final_message: the last message has no text to continue", param="continue_final_message"
            )
        if not isinstance(content, str):
            raise InvalidRequestError(
                "continue_final_message: the last message has no content to continue", param="continue_final_message"
            )
        final["content"] = content + _CONTINUE_TAG
        return content

    @staticmethod
    def _cut_after_final_message(rendered: str, continued_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        position = rendered.rfind(tag)
        if position < 0 or continued_text.strip() not in rendered:
            raise InvalidRequestError(
                "continue_final_message: the chat template drops or changes the last "
                "message, so it cannot be continued",
                param="continue_final_message",
            )
        if rendered[position : position + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:position]
        # the template trimmed the message, and with it the tag's trailing space
        return rendered[:position].rstrip()
