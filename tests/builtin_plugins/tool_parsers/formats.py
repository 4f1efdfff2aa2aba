"""Model outputs in each tool parser's real format, written from abstract calls, and the
cases every parser is checked on: single call, parallel calls, text before the calls,
unicode and nested JSON arguments, plain text, and malformed output that must come back
as plain content. The e2e tests replay the same texts through the scripted model."""

from __future__ import annotations

import json
from dataclasses import dataclass

Call = tuple[str, dict]

WEATHER: Call = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME: Call = ("get_time", {"zone": "Europe/Paris"})
TRANSLATE: Call = ("translate", {"text": "Grüße aus Zürich 👋", "target": "日本語"})
SEARCH: Call = (
    "search",
    {
        "query": "a {b} [c]",
        "quote": 'she said "hi"\n',
        "filters": {"tags": ["x", "y"], "range": {"min": 1, "max": 2.5}, "exact": True, "missing": None},
    },
)
EMPTY: Call = ("list_files", {})

PLAIN_TEXT = "The weather in Paris is sunny, 22 °C. Braces {like these} and [brackets] stay text."
TEXT_BEFORE = "Let me check that for you."


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def hermes(calls: list[Call]) -> str:
    return "\n".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {dumps(arguments)}}}\n</tool_call>' for name, arguments in calls
    )


def mistral(calls: list[Call]) -> str:
    return "[TOOL_CALLS]" + dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


def mistral_v11(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{name}[ARGS]{dumps(arguments)}" for name, arguments in calls)


def llama3_json(calls: list[Call]) -> str:
    return "; ".join(dumps({"name": name, "parameters": arguments}) for name, arguments in calls)


def llama4_json(calls: list[Call]) -> str:
    return "<|python_start|>" + llama3_json(calls) + "<|python_end|>"


def pythonic(calls: list[Call]) -> str:
    written = [
        f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})" for name, arguments in calls
    ]
    return "[" + ", ".join(written) + "]"


def granite(calls: list[Call]) -> str:
    return "<|tool_call|>" + dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


def granite_20b_fc(calls: list[Call]) -> str:
    return "\n".join(f"<function_call> {dumps({'name': name, 'arguments': arguments})}" for name, arguments in calls)


def internlm(calls: list[Call]) -> str:
    return "".join(
        f"<|action_start|><|plugin|>\n{dumps({'name': name, 'parameters': arguments})}<|action_end|>"
        for name, arguments in calls
    )


def jamba(calls: list[Call]) -> str:
    return (
        "<tool_calls>" + dumps([{"name": name, "arguments": arguments} for name, arguments in calls]) + "</tool_calls>"
    )


def phi4_mini_json(calls: list[Call]) -> str:
    return "functools" + dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


def deepseek_v3(calls: list[Call]) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{dumps(arguments)}\n```<｜tool▁call▁end｜>"
        for name, arguments in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def function_tags(calls: list[Call]) -> str:
    """Llama 3.1's custom-tool format, parsed by the example plugin file examples/my_tool_parser.py."""
    return "".join(f"<function={name}>{dumps(arguments)}</function>" for name, arguments in calls)


# the parser registered by the example --tool-parser-plugin file
EXAMPLE_PARSER = "llama3_function_tags"


def llama4_pythonic(calls: list[Call]) -> str:
    return "<|python_start|>" + pythonic(calls) + "<|python_end|>"


# how each parser's model writes calls after some text (the bare formats need their marker),
# and that text as the parser returns it: verbatim up to the call, whitespace included, as
# vLLM returns it (its parsers take the content as ``model_output[:start of the first call]``)
FORMATS = {
    "hermes": (hermes, lambda calls: TEXT_BEFORE + "\n" + hermes(calls), TEXT_BEFORE + "\n"),
    "mistral": (mistral, lambda calls: TEXT_BEFORE + mistral(calls), TEXT_BEFORE),
    "llama3_json": (llama3_json, lambda calls: TEXT_BEFORE + "<|python_tag|>" + llama3_json(calls), TEXT_BEFORE),
    "llama4_json": (llama4_json, lambda calls: TEXT_BEFORE + "\n\n" + llama4_json(calls), TEXT_BEFORE + "\n\n"),
    "pythonic": (
        pythonic,
        lambda calls: TEXT_BEFORE + "<|python_start|>" + pythonic(calls) + "<|python_end|>",
        TEXT_BEFORE,
    ),
    "llama4_pythonic": (llama4_pythonic, lambda calls: TEXT_BEFORE + " " + llama4_pythonic(calls), TEXT_BEFORE + " "),
    "granite": (granite, lambda calls: TEXT_BEFORE + " " + granite(calls), TEXT_BEFORE + " "),
    "granite-20b-fc": (granite_20b_fc, lambda calls: TEXT_BEFORE + "\n" + granite_20b_fc(calls), TEXT_BEFORE + "\n"),
    "internlm": (internlm, lambda calls: TEXT_BEFORE + internlm(calls), TEXT_BEFORE),
    "jamba": (jamba, lambda calls: TEXT_BEFORE + "\n" + jamba(calls), TEXT_BEFORE + "\n"),
    "phi4_mini_json": (phi4_mini_json, lambda calls: TEXT_BEFORE + " " + phi4_mini_json(calls), TEXT_BEFORE + " "),
    "deepseek_v3": (deepseek_v3, lambda calls: TEXT_BEFORE + deepseek_v3(calls), TEXT_BEFORE),
    EXAMPLE_PARSER: (function_tags, lambda calls: TEXT_BEFORE + function_tags(calls), TEXT_BEFORE),
}


@dataclass(frozen=True)
class Case:
    """One model output and what the parser must make of it."""

    parser: str
    name: str
    output: str
    content: str | None
    calls: tuple[Call, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.parser}-{self.name}"


def standard_cases(parser: str) -> list[Case]:
    write, write_after_text, text_before = FORMATS[parser]
    return [
        Case(parser, "single", write([WEATHER]), None, (WEATHER,)),
        Case(parser, "parallel", write([WEATHER, TIME]), None, (WEATHER, TIME)),
        Case(parser, "text_before", write_after_text([WEATHER]), text_before, (WEATHER,)),
        Case(parser, "unicode_nested", write([TRANSLATE, SEARCH, EMPTY]), None, (TRANSLATE, SEARCH, EMPTY)),
        Case(parser, "plain_text", PLAIN_TEXT, PLAIN_TEXT),
    ]


def malformed_case(parser: str, name: str, output: str) -> Case:
    """Output that is no call: it all comes back as content."""
    return Case(parser, name, output, output)


MALFORMED = [
    malformed_case(
        "hermes", "bad_json", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
    ),
    malformed_case("hermes", "truncated", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    malformed_case("hermes", "no_name", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),
    # vLLM's mistral parser returns a malformed call as content without its [TOOL_CALLS] marker,
    # trimmed: model_output.replace("[TOOL_CALLS]", "").strip()
    Case(
        "mistral",
        "bad_json",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}]',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}]',
    ),
    Case("mistral", "truncated_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', 'get_weather[ARGS]{"city": "Par'),
    Case("mistral", "no_args_v11", "[TOOL_CALLS]get_weather and more", "get_weather and more"),
    Case("mistral", "spaced_bad_json", "[TOOL_CALLS] [{bad json}] \n", "[{bad json}]"),
    Case("mistral", "text_then_bad_json", "Checking. [TOOL_CALLS][{bad", "Checking. [{bad"),
    malformed_case("llama3_json", "not_a_call", '{"answer": 42, "unit": "apples"}'),
    malformed_case("llama3_json", "truncated", '{"name": "get_weather", "parameters": {"city": "Par'),
    malformed_case(
        "llama4_json", "bad_json", '<|python_start|>{"name": "get_weather", "parameters": {city}}<|python_end|>'
    ),
    malformed_case("pythonic", "not_calls", "[1, 2, 3] are the first numbers."),
    malformed_case("pythonic", "positional", '[get_weather("Paris")]'),
    malformed_case("pythonic", "truncated", '[get_weather(city="Par'),
    malformed_case("llama4_pythonic", "not_calls", "<|python_start|>[1, 2, 3]<|python_end|>"),
    malformed_case("llama4_pythonic", "truncated", '<|python_start|>[get_weather(city="Par'),
    malformed_case("granite", "object_not_array", '<|tool_call|>{"name": "get_weather", "arguments": {}}'),
    malformed_case("granite", "truncated", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa'),
    malformed_case(
        "granite-20b-fc", "bad_json", '<function_call> {"name": "get_weather", "arguments": {"city": Paris}}'
    ),
    malformed_case("internlm", "interpreter", "<|action_start|><|interpreter|>\nprint(1)<|action_end|>"),
    malformed_case("internlm", "unclosed", '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {}}'),
    malformed_case(
        "jamba", "bad_json", '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}</tool_calls>'
    ),
    malformed_case("phi4_mini_json", "prose", "Python's functools module has lru_cache."),
    malformed_case("phi4_mini_json", "truncated", 'functools[{"name": "get_weather", "arguments": {'),
    malformed_case(
        "deepseek_v3",
        "bad_json",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": Paris}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    ),
    malformed_case(EXAMPLE_PARSER, "bad_json", '<function=get_weather>{"city": Paris}</function>'),
    malformed_case(EXAMPLE_PARSER, "unclosed", '<function=get_weather>{"city": "Paris"}'),
    malformed_case(
        "deepseek_v3",
        "truncated",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{",
    ),
]

EXTRA = [
    Case("mistral", "v11_parallel", mistral_v11([WEATHER, TIME]), None, (WEATHER, TIME)),
    Case("mistral", "v11_text_before", TEXT_BEFORE + mistral_v11([SEARCH]), TEXT_BEFORE, (SEARCH,)),
    Case(
        "llama3_json",
        "trailing_text",
        llama3_json([WEATHER]) + "\nI will tell you soon.",
        "I will tell you soon.",
        (WEATHER,),
    ),
    Case("llama4_json", "bare", llama3_json([WEATHER, TIME]), None, (WEATHER, TIME)),
    Case(
        "hermes",
        "text_between_calls",
        f"First:\n{hermes([WEATHER])}\nthen:\n{hermes([TIME])}\nDone.",
        "First:\n\nthen:\n\nDone.",
        (WEATHER, TIME),
    ),
    Case(
        "hermes",
        "one_bad_one_good",
        '<tool_call>{"name": 1}</tool_call>' + hermes([TIME]),
        '<tool_call>{"name": 1}</tool_call>',
        (TIME,),
    ),
    Case("deepseek_v3", "no_end_marker", deepseek_v3([WEATHER]).removesuffix("<｜tool▁calls▁end｜>"), None, (WEATHER,)),
    Case("granite", "bare_array", dumps([{"name": WEATHER[0], "arguments": WEATHER[1]}]), None, (WEATHER,)),
    Case("llama4_pythonic", "bare", pythonic([WEATHER, TIME]), None, (WEATHER, TIME)),
    # text before a call comes back byte for byte as vLLM returns it (model_output[:index of the
    # first call marker]; None only when that is empty), whitespace included
    Case("hermes", "newline_before", "\n" + hermes([WEATHER]), "\n", (WEATHER,)),
    Case(
        "hermes",
        "blank_line_before",
        "I'll check the weather for you.\n\n" + hermes([WEATHER, TIME]),
        "I'll check the weather for you.\n\n",
        (WEATHER, TIME),
    ),
    Case(
        "granite-20b-fc",
        "text_newline_before",
        "Sure, calling it for you.\n" + granite_20b_fc([WEATHER, TIME]),
        "Sure, calling it for you.\n",
        (WEATHER, TIME),
    ),
    Case(
        "internlm",
        "text_newline_before",
        "Let me look it up for you.\n" + internlm([WEATHER]),
        "Let me look it up for you.\n",
        (WEATHER,),
    ),
    Case("mistral", "text_newline_before", "Checking.\n" + mistral([WEATHER]), "Checking.\n", (WEATHER,)),
    Case("pythonic", "dotted_name", "[weather.current(city='Paris')]", None, (("weather.current", {"city": "Paris"}),)),
]


def tool_definition(call: Call) -> dict:
    name, arguments = call
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Calls {name}.",
            "parameters": {"type": "object", "properties": {key: {} for key in arguments}},
        },
    }


# the tools a request offers for the calls the cases make
TOOLS_FOR_CASES = [tool_definition(call) for call in (WEATHER, TIME, TRANSLATE, SEARCH, EMPTY)]

CASES = [case for parser in FORMATS for case in standard_cases(parser)] + MALFORMED + EXTRA
