"""`tokenloom serve --otlp-traces-endpoint` over OTLP HTTP/protobuf (as
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf asks), read by a real in-process collector
that decodes opentelemetry-proto's ExportTraceServiceRequest: a chat request with a W3C
``traceparent`` header becomes a child span of the caller's trace, a streamed one starts its
own; each span carries the request's id and the token counts its response reported."""

from __future__ import annotations

import http.server
import os
import threading
import time

import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.scripted import MODEL, scripted_model_dir, serve_args
from tests.plugins.scripted_model.model_dir import marker

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
ANSWER = "The traced answer."


class HttpCollector(http.server.ThreadingHTTPServer):
    """POST /v1/traces: OTLP's HTTP/protobuf traces endpoint, keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's method name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for resource_spans in request.resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            collector.spans.extend(scope_spans.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def span_of(self, request_id: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for span in self.spans:
                    if attributes(span).get("gen_ai.request.id") == request_id:
                        return span
            time.sleep(0.05)
        raise AssertionError(f"no span for {request_id} among {len(self.spans)}")


def attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, scripted_tokenizer):
    collector = HttpCollector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    directory = tmp_path_factory.mktemp("traced")
    model_dir = scripted_model_dir(str(directory / "model"), scripted_tokenizer, {"traced": ANSWER})
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    # the server's exporter: HTTP/protobuf, batches sent every 50 ms (the SDK's default is 5 s)
    saved = {name: os.environ.get(name) for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="50")
    try:
        server = start_server(
            serve_args(model_dir, "--otlp-traces-endpoint", endpoint, "--collect-detailed-traces", "all"),
            str(directory / "serve.log"),
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, collector, server
    stop_server(server)
    collector.shutdown()


def test_a_request_with_a_traceparent_is_a_child_span_with_its_counts(traced):
    client, collector, server = traced
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"{marker('traced')} go"}],
        temperature=0.25,
        max_tokens=64,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
    )
    assert response.choices[0].message.content == ANSWER
    span = collector.span_of(response.id)
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    found = attributes(span)
    assert found["gen_ai.response.model"] == MODEL
    assert found["gen_ai.usage.prompt_tokens"] == response.usage.prompt_tokens
    assert found["gen_ai.usage.completion_tokens"] == response.usage.completion_tokens
    assert (found["gen_ai.request.temperature"], found["gen_ai.request.max_tokens"]) == (0.25, 64)
    queue, ttft, e2e = (found[f"gen_ai.latency.{name}"] for name in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e
    assert found["gen_ai.latency.time_in_model_inference"] == pytest.approx(e2e - queue)
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, abs=1e6)
    assert "--collect-detailed-traces all: the request spans carry" in server.log()


def test_a_streamed_request_without_trace_headers_starts_its_own_trace(traced):
    client, collector, _ = traced
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{marker('traced')} again"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    span = collector.span_of(chunks[0].id)
    assert span.parent_span_id == b"" and span.trace_id.hex() != TRACE_ID
    assert attributes(span)["gen_ai.usage.completion_tokens"] == usage.completion_tokens
