"""Pydantic models of the HTTP API's generation routes: OpenAI's completions and chat
completions (requests, whole responses and stream chunks) with vLLM's documented extra
parameters, the request and response bases every API family builds on, and server-sent events.
The other routes' models are in :mod:`~tokenloom.api.server_protocol`.

Request models accept unknown fields (OpenAI clients send new ones all the time); the server
ignores them and names them in one log line per request, as vLLM does. Value checks beyond types are left to
:class:`~tokenloom.core.sampling_params.SamplingParams`, whose errors name the parameter.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from tokenloom.core.structured_output_constraints import MAX_CONSTRAINT_CHARS, MAX_CONSTRAINT_DEPTH
from tokenloom.errors import InvalidRequestError

# -- requests --------------------------------------------------------------------------


def find_unencodable_text(data: Any) -> str | None:
    """The JSON path of the first string (value or key) in ``data`` that cannot be encoded as
    UTF-8, e.g. a lone surrogate ``"\\ud800"``: JSON can carry one, but no tokenizer, template
    or hash can take it. None when all text is well-formed."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not key.isascii():
                    try:
                        key.encode("utf-8")
                    except UnicodeEncodeError:
                        return child.encode("utf-8", "backslashreplace").decode("utf-8")
                stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{index}" if path else str(index)) for index, item in enumerate(value))
    return None


class RequestModel(BaseModel):
    # NaN and Infinity (which Python's JSON reader accepts) are never a meaningful sampling
    # value: a NaN temperature or an infinite logit_bias only empties the output (a 400 instead)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _well_formed_text(cls, data: Any) -> Any:
        # One check for every text field (prompts, messages, stop strings, tool schemas,
        # templates, ...): a lone surrogate would otherwise fail deep in a tokenizer as a 500.
        path = find_unencodable_text(data)
        if path is not None:
            raise ValueError(
                f"{path} holds text that is not valid Unicode (an unpaired surrogate such as "
                "\\ud800); send well-formed UTF-8"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # many clients send "n": null, "stream": null, ... for "not set"
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(RequestModel):
    include_usage: bool = False
    """Send a last chunk (before [DONE]) with empty choices and the request's usage."""
    continuous_usage_stats: bool = False
    """Send the usage so far in every chunk."""


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    """OpenAI's ``{"name", "schema", "strict"}``; only ``schema`` matters here."""


class SamplingRequest(RequestModel):
    """Fields that completions and chat share: OpenAI's sampling options and vLLM's extras."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    """Lower runs first under ``--scheduling-policy priority``; under ``fcfs`` anything but 0
    is a 400, as in vLLM."""
    request_id: str | None = None
    use_beam_search: bool = False
    """vLLM's beam search: ``best_of`` (or ``n``) beams, the ``n`` best returned; not streamable."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores cumulative logprob / length ** length_penalty."""
    early_stopping: bool = False
    """Beam search: stop as soon as ``best_of`` (or ``n``) beams have finished, instead of
    searching on to ``max_tokens`` for better-scoring longer ones."""
    logits_processors: list[str | dict[str, Any]] | None = None
    """vLLM's per-request logits processors: registered names, or qualified names
    (``pkg.mod.Class``) that match ``--logits-processor-pattern``; each entry a string or
    ``{"qualname": ..., "args": [...], "kwargs": {...}}``."""
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    """vLLM's prefix-cache isolation: only requests with the same salt share cached KV blocks.
    A non-empty, unpredictable string (e.g. 256 random bits, base64) per tenant."""
    # guided decoding (vLLM's names), turned into SamplingParams.structured_outputs
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's newer form: ``{"json" | "regex" | "choice" | "grammar" | "json_object" |
    "structural_tag": ..., "disable_any_whitespace", "disable_additional_properties",
    "disable_fallback", "whitespace_pattern", "backend"}``."""

    def structured_output_constraint(self) -> dict[str, Any] | None:
        """The request's guided-decoding form, whichever it used, as one
        ``SamplingParams.structured_outputs`` dict (None when unconstrained); the engine checks
        the dict itself. Two forms in one request are a 400."""
        forms: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs:
            forms.append(("structured_outputs", dict(self.structured_outputs)))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                if len(schema) > MAX_CONSTRAINT_CHARS:  # refused unread: parsing it would hold the loop
                    raise InvalidRequestError(
                        f"guided_json is longer than {MAX_CONSTRAINT_CHARS} characters; send a smaller schema",
                        param="guided_json",
                    )
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(f"guided_json is not valid JSON: {exc}", param="guided_json") from None
                except RecursionError:
                    raise InvalidRequestError(
                        f"guided_json nests deeper than {MAX_CONSTRAINT_DEPTH} levels of objects and arrays",
                        param="guided_json",
                    ) from None
            forms.append(("guided_json", {"json": schema}))
        for param, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, param) is not None:
                forms.append((param, {kind: getattr(self, param)}))
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            forms.append(("response_format", _response_format_constraint(response_format)))
        if not forms:
            return None
        if len(forms) > 1:
            raise InvalidRequestError(
                "give one structured-output form, not " + " and ".join(p for p, _ in forms), param=forms[1][0]
            )
        constraint = forms[0][1]
        if self.guided_decoding_backend:
            constraint.setdefault("backend", self.guided_decoding_backend)
        if self.guided_whitespace_pattern is not None:
            constraint.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        return constraint


def _response_format_constraint(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        schema = (response_format.json_schema or {}).get("schema")
        if schema is None:
            raise InvalidRequestError(
                'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                param="response_format",
            )
        return {"json": schema}
    # structural_tag: the rest of the object is the tag (xgrammar's format or vLLM's structures/triggers)
    return {"structural_tag": dict(response_format.model_extra or {}, type="structural_tag")}


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    # vLLM's: each choice also carries prompt_token_ids and token_ids (a stream: the prompt's
    # in a choice's first chunk, each chunk's new ids); how a --skip-tokenizer-init server's
    # outputs are read, since their text is empty
    return_token_ids: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return prompt
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return prompt
            if all(
                isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompt
            ):
                return prompt
        raise ValueError(
            "prompt must be a string, a non-empty list of strings, a non-empty list of token ids, "
            "or a list of non-empty lists of token ids"
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each string or token-id list is one prompt."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # options for the model's multimodal processor, over the server's --mm-processor-kwargs
    mm_processor_kwargs: dict[str, Any] | None = None


# -- responses -------------------------------------------------------------------------


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def unix_now() -> int:
    return int(time.time())


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionLogProbs(ResponseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in a choice's first chunk
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's new ids


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatMessage(ResponseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(ResponseModel):
    """A streamed piece of the message; only the fields it carries are sent."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    system_fingerprint: str | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


def flat_tool_as_chat_tool(tool: dict[str, Any], index: int, schema_key: str) -> dict[str, Any]:
    """A tool sent flat (``name``, ``description`` and its JSON schema under ``schema_key``, as
    the Responses and Messages APIs send them) in chat completions' shape; ``index`` places it
    in the request's ``tools`` for the error."""
    if not tool.get("name"):
        raise InvalidRequestError(f"tools[{index}] needs a name", param=f"tools[{index}].name")
    function = {"name": tool["name"], "parameters": tool.get(schema_key) or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event; a chunk's ``usage`` is only sent when it has one."""
    exclude = {"usage"} if getattr(chunk, "usage", 1) is None else None
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
