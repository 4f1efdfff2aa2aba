"""OpenTelemetry traces, as vLLM sends them (``--otlp-traces-endpoint``): one ``llm_request``
span of kind SERVER per finished engine request, with vLLM's ``gen_ai.*`` attribute names (the
request's id and sampling limits, its prompt and completion token counts, and the time it spent
queued, in prefill, in decode and in all), a child of the caller's span when the HTTP request
carried a W3C ``traceparent`` header.

The exporter speaks OTLP over gRPC (the default, as in vLLM) or HTTP/protobuf, as
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says; the other ``OTEL_*`` variables (headers, TLS,
``OTEL_SERVICE_NAME``) work as the OpenTelemetry SDK reads them. Spans are batched and sent by
the SDK's own thread, so a slow or absent collector never delays a request. The
``opentelemetry-*`` packages are the optional ``otel`` extra; asking for traces without them
is a start-up error that names the extra.
"""

from __future__ import annotations

import contextvars
import importlib.util
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenloom.errors import ConfigError

if TYPE_CHECKING:
    from tokenloom.core.outputs import RequestOutput
    from tokenloom.core.sampling_params import SamplingParams

logger = logging.getLogger("tokenloom.api")

TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
SPAN_NAME = "llm_request"
DETAILED_TRACE_MODULES = ("model", "worker", "all")
INSTALL_HINT = "pip install 'tokenloom[otel]'"
# the W3C trace headers of the HTTP request being served, set by TraceContextMiddleware
REQUEST_TRACE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "tokenloom_request_trace_headers", default=None
)


class SpanAttributes:
    """vLLM's attribute names (OpenTelemetry's GenAI conventions and vLLM's additions)."""

    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def check_tracing_options(
    endpoint: str | None, detailed_modules: Iterable[str] | None, environ: Mapping[str, str] = os.environ
) -> None:
    """The start-up checks of ``--otlp-traces-endpoint`` and ``--collect-detailed-traces``, before
    any model is loaded."""
    modules = [name.strip() for entry in detailed_modules or () for name in entry.split(",") if name.strip()]
    unknown = sorted(set(modules) - set(DETAILED_TRACE_MODULES))
    if unknown:
        raise ConfigError(
            f"--collect-detailed-traces: unknown module(s) {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(DETAILED_TRACE_MODULES)}",
            param="--collect-detailed-traces",
        )
    if modules and not endpoint:
        raise ConfigError(
            "--collect-detailed-traces needs --otlp-traces-endpoint (the collector to send the traces to)",
            param="--collect-detailed-traces",
        )
    if not endpoint:
        return
    protocol = environ.get(PROTOCOL_ENV, "grpc")
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"{PROTOCOL_ENV}={protocol!r} is not an OTLP traces protocol tokenloom sends; use one of {', '.join(PROTOCOLS)}",
            param="--otlp-traces-endpoint",
        )
    exporter = "grpc" if protocol == "grpc" else "http"
    for module in ("opentelemetry.sdk.trace", f"opentelemetry.exporter.otlp.proto.{exporter}.trace_exporter"):
        try:
            installed = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            installed = False
        if not installed:
            raise ConfigError(
                f"--otlp-traces-endpoint needs the OpenTelemetry packages ({module} is not installed): {INSTALL_HINT}",
                param="--otlp-traces-endpoint",
            )


def _wall_clock_ns(monotonic_time: float, now_monotonic: float, now_ns: int) -> int:
    """A ``time.monotonic()`` reading as nanoseconds since the epoch (what spans carry)."""
    return now_ns - int((now_monotonic - monotonic_time) * 1e9)


class RequestTracer:
    """Sends one span per finished request to an OTLP collector."""

    def __init__(self, endpoint: str, model_name: str):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        check_tracing_options(endpoint, None)
        if os.environ.get(PROTOCOL_ENV, "grpc") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        self.model_name = model_name
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tokenloom")})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("tokenloom")
        logger.info("sending a trace span per request to %s (%s)", endpoint, os.environ.get(PROTOCOL_ENV, "grpc"))

    def record(
        self,
        request_id: str,
        params: SamplingParams,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        output: RequestOutput,
        trace_headers: Mapping[str, str] | None,
    ) -> None:
        """The span of ``output``, a finished request's last output (its metrics carry the
        engine's monotonic timestamps)."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        metrics = output.metrics
        if metrics is None:
            return
        now_monotonic, now_ns = time.monotonic(), time.time_ns()
        finished = metrics.finished_time if metrics.finished_time is not None else now_monotonic
        scheduled = metrics.first_scheduled_time if metrics.first_scheduled_time is not None else finished
        first_token = metrics.first_token_time if metrics.first_token_time is not None else finished
        attributes: dict[str, Any] = {
            SpanAttributes.RESPONSE_MODEL: self.model_name,
            SpanAttributes.REQUEST_ID: request_id,
            SpanAttributes.REQUEST_N: params.n,
            SpanAttributes.USAGE_NUM_SEQUENCES: len(output.outputs) or params.n,
            SpanAttributes.USAGE_PROMPT_TOKENS: num_prompt_tokens,
            SpanAttributes.USAGE_COMPLETION_TOKENS: num_completion_tokens,
            SpanAttributes.LATENCY_TIME_IN_QUEUE: scheduled - metrics.arrival_time,
            SpanAttributes.LATENCY_TIME_TO_FIRST_TOKEN: first_token - metrics.arrival_time,
            SpanAttributes.LATENCY_E2E: finished - metrics.arrival_time,
            SpanAttributes.LATENCY_TIME_IN_MODEL_PREFILL: first_token - scheduled,
            SpanAttributes.LATENCY_TIME_IN_MODEL_DECODE: finished - first_token,
            SpanAttributes.LATENCY_TIME_IN_MODEL_INFERENCE: finished - scheduled,
            SpanAttributes.REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.REQUEST_TOP_P: params.top_p,
        }
        if params.max_tokens is not None:
            attributes[SpanAttributes.REQUEST_MAX_TOKENS] = params.max_tokens
        context = TraceContextTextMapPropagator().extract(dict(trace_headers or {}))
        span = self._tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=_wall_clock_ns(metrics.arrival_time, now_monotonic, now_ns),
        )
        span.end(end_time=_wall_clock_ns(finished, now_monotonic, now_ns))

    def shutdown(self) -> None:
        """Sends the spans still batched (the SDK waits up to its export timeout) and stops."""
        self._provider.shutdown()


class TraceContextMiddleware:
    """Keeps the HTTP request's W3C trace headers for the spans of the engine requests it makes."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        wanted = {name.encode() for name in TRACE_HEADERS}
        found = {
            key.decode("latin-1").lower(): value.decode("latin-1")
            for key, value in scope.get("headers", ())
            if key.lower() in wanted
        }
        token = REQUEST_TRACE_HEADERS.set(found or None)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_TRACE_HEADERS.reset(token)
