"""The HTTP side of ``bench serve``: one streamed request to an OpenAI-compatible
``/v1/completions`` or ``/v1/chat/completions`` endpoint, timed the way vLLM's client times it
(TTFT at the first chunk that carries choices, one inter-token latency per later chunk, the
output token count from the final ``usage`` chunk)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "completions"
CHAT = "chat"
API_KEY_ENV = "OPENAI_API_KEY"  # what vLLM's client sends as the bearer token
ERROR_TEXT_LIMIT = 500


@dataclass
class RequestResult:
    """One request's outcome (vLLM's ``RequestFuncOutput``); times in seconds."""

    prompt_len: int
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None  # completion_tokens of the usage chunk, when the server sent one
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    error: str = ""
    status_code: int | None = None  # the HTTP status of a refused request
    unreachable: bool = False  # no HTTP answer at all: connection refused, reset, timed out


def endpoint_kind(endpoint: str) -> str:
    return CHAT if endpoint.rstrip("/").endswith("chat/completions") else COMPLETIONS


def build_payload(
    kind: str,
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    ignore_eos: bool = False,
    sampling: dict[str, Any] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The streamed request body; ``sampling`` (temperature, top_p, ...) and ``extra_body`` are
    merged in last, so they may override anything."""
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if kind == CHAT:
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = max_tokens
    else:
        payload["prompt"] = prompt
        payload["max_tokens"] = max_tokens
        payload["repetition_penalty"] = 1.0
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(sampling or {})
    payload.update(extra_body or {})
    return payload


def request_headers() -> dict[str, str]:
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


async def send_request(
    client: Any, url: str, kind: str, payload: dict[str, Any], prompt_len: int, headers: dict[str, str] | None = None
) -> RequestResult:
    """POST ``payload`` with ``httpx.AsyncClient`` and read the SSE stream; never raises:
    a failure is ``success=False`` with the reason in ``error``."""
    result = RequestResult(prompt_len=prompt_len)
    started = time.perf_counter()
    result.start_time = started
    last_chunk_time = started
    first_chunk_seen = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers or {}) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(body)}"
                result.status_code = response.status_code
                return result
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if data is None:
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = _error_message(json.dumps(chunk))
                    return result
                choices = chunk.get("choices")
                if choices:
                    now = time.perf_counter()
                    if not first_chunk_seen:
                        first_chunk_seen = True
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last_chunk_time)
                    last_chunk_time = now
                    result.generated_text += _chunk_text(kind, choices[0]) or ""
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens")
    except Exception as exc:  # a dropped connection or a broken stream fails this request only
        import httpx

        result.error = f"{type(exc).__name__}: {exc}"
        result.unreachable = isinstance(exc, httpx.TransportError)
        return result
    if not first_chunk_seen:
        result.error = "the stream ended before any chunk with choices: no time to first token"
        return result
    result.success = True
    result.latency = last_chunk_time - started
    return result


def _sse_data(line: str) -> str | None:
    """The payload of one SSE line; None for blank lines, comments (pings) and ``[DONE]``."""
    line = line.strip()
    if not line or line.startswith(":") or not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    return None if data == "[DONE]" else data


def _chunk_text(kind: str, choice: dict[str, Any]) -> str | None:
    if kind == CHAT:
        return (choice.get("delta") or {}).get("content")
    return choice.get("text")


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:ERROR_TEXT_LIMIT]
    return body.strip()[:ERROR_TEXT_LIMIT] or "(empty body)"
