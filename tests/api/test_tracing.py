"""OpenTelemetry traces: the span a finished request makes, sent over OTLP/gRPC (the default
protocol) to a real in-process collector (opentelemetry-proto's gRPC service), with vLLM's
attribute names, exact latencies from the engine's timestamps, and the caller's W3C trace as
its parent; and the start-up checks of the two flags."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tokenloom.api.serve_args import parse_serve_args
from tokenloom.api.tracing import RequestTracer
from tokenloom.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import ConfigError

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list = []
        self.resources: list = []
        self.received = threading.Event()

    def Export(self, request, context):  # noqa: N802 (the gRPC service's method name)
        for resource_spans in request.resource_spans:
            self.resources.append(resource_spans.resource)
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        self.received.set()
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


def attributes(span) -> dict:
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        values[attribute.key] = getattr(value, value.WhichOneof("value"))
    return values


def finished_output(metrics: RequestMetrics) -> RequestOutput:
    return RequestOutput(
        request_id="chatcmpl-1",
        prompt=None,
        prompt_token_ids=[1, 2, 3, 4, 5],
        prompt_logprobs=None,
        outputs=[CompletionOutput(index=0, text="hi", token_ids=[7, 8], cumulative_logprob=None, logprobs=None)],
        finished=True,
        metrics=metrics,
    )


def test_a_finished_request_makes_one_server_span_with_vllms_attributes(collector, monkeypatch):
    servicer, endpoint = collector
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tokenloom-test")
    tracer = RequestTracer(endpoint, "smollm2")
    metrics = RequestMetrics(
        arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0, finished_time=103.0
    )
    params = SamplingParams(n=1, temperature=0.5, top_p=0.75, max_tokens=16)
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    tracer.record("chatcmpl-1", params, 5, 2, finished_output(metrics), headers)
    tracer.shutdown()  # flushes the batch

    assert servicer.received.is_set()
    (span,) = servicer.spans
    assert span.name == "llm_request"
    assert span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_SPAN_ID
    assert abs((span.end_time_unix_nano - span.start_time_unix_nano) - 3_000_000_000) < 1_000
    assert attributes(span) == {
        "gen_ai.response.model": "smollm2",
        "gen_ai.request.id": "chatcmpl-1",
        "gen_ai.request.n": 1,
        "gen_ai.usage.num_sequences": 1,
        "gen_ai.usage.prompt_tokens": 5,
        "gen_ai.usage.completion_tokens": 2,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.75,
        "gen_ai.request.max_tokens": 16,
        "gen_ai.latency.time_in_queue": 0.5,
        "gen_ai.latency.time_to_first_token": 1.0,
        "gen_ai.latency.e2e": 3.0,
        "gen_ai.latency.time_in_model_prefill": 0.5,
        "gen_ai.latency.time_in_model_decode": 2.0,
        "gen_ai.latency.time_in_model_inference": 2.5,
    }
    (resource,) = servicer.resources
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "tokenloom-test"


def test_a_request_without_trace_headers_starts_a_trace_of_its_own(collector, monkeypatch):
    servicer, endpoint = collector
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    tracer = RequestTracer(endpoint, "m")
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.25, finished_time=1.5)
    tracer.record("cmpl-2", SamplingParams(max_tokens=None), 5, 2, finished_output(metrics), None)
    tracer.shutdown()
    (span,) = servicer.spans
    assert span.parent_span_id == b"" and len(span.trace_id) == 16 and any(span.trace_id)
    assert "gen_ai.request.max_tokens" not in attributes(span)


# -- the flags -----------------------------------------------------------------------------------


def test_detailed_traces_need_an_endpoint_and_known_modules():
    with pytest.raises(ConfigError, match="--collect-detailed-traces needs --otlp-traces-endpoint"):
        parse_serve_args(["m", "--collect-detailed-traces", "model"], {})
    with pytest.raises(ConfigError, match="unknown module.*'gpu'.*model, worker, all"):
        parse_serve_args(["m", "--otlp-traces-endpoint", "http://c:4317", "--collect-detailed-traces", "model,gpu"], {})
    args = parse_serve_args(
        ["m", "--otlp-traces-endpoint", "http://c:4317", "--collect-detailed-traces", "model,worker", "all"], {}
    )
    assert args.server.otlp_traces_endpoint == "http://c:4317"
    assert args.server.collect_detailed_traces == ["model,worker", "all"]


def test_an_unknown_otlp_protocol_is_refused_naming_the_variable():
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'.*grpc, http/protobuf"):
        parse_serve_args(
            ["m", "--otlp-traces-endpoint", "http://c:4318"], {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}
        )


def test_missing_opentelemetry_packages_name_the_extra(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def without_exporters(name, *args):
        if name.startswith("opentelemetry.exporter"):
            return None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_exporters)
    with pytest.raises(ConfigError, match=r"pip install 'tokenloom\[otel\]'"):
        parse_serve_args(["m", "--otlp-traces-endpoint", "http://c:4317"], {})
