"""Prometheus metrics under vLLM's names, in a private registry per app, and the periodic
one-line stats log.

Engine gauges and counters (running, waiting, KV usage, token and prefix-cache totals,
preemptions) are read from ``engine.stats()`` at scrape time; request latencies (TTFT,
inter-token, end-to-end) are observed here, in the API layer, from the output stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from tokenloom.core.engine.engine_stats import EngineStats
    from tokenloom.core.engine.protocol import EngineClient
    from tokenloom.core.scheduler_stats import SpecDecodingStats

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STATS_LOG_INTERVAL_S = 10.0


class EngineStatsCollector:
    """Reads ``engine.stats()`` when Prometheus scrapes."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception as exc:  # a dead engine must not break the rest of /metrics
            logger.debug("engine.stats() failed during a scrape: %s", exc)
            return
        labels = [self.model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        kv_usage = float(stats.kv_cache_usage)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (the old name, kept for dashboards).", kv_usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens_total)
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", stats.prefix_cache_queries)
        max_lora = getattr(stats, "max_lora", 0)
        if max_lora:
            # vLLM's info gauge: the adapters in use are labels, the value the time they were read
            lora_info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora_info.add_metric(
                [str(max_lora), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)],
                time.time(),
            )
            yield lora_info
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        # the encoder cache of a model that sees (vLLM's multimodal cache names), in items
        yield counter("vllm:mm_cache_queries", "Multimodal cache queries, in items.", stats.mm_cache_queries)
        yield counter("vllm:mm_cache_hits", "Multimodal cache hits, in items.", stats.mm_cache_hits)
        kv_connector = getattr(stats, "kv_connector", None)
        if kv_connector is not None:
            # vLLM's names for the lookups; the transfers under kv_connector_*
            yield counter(
                "vllm:external_prefix_cache_queries", "KV-connector lookups, in tokens.", kv_connector.queries
            )
            yield counter("vllm:external_prefix_cache_hits", "KV-connector hits, in tokens.", kv_connector.hits)
            for name, documentation, value in (
                ("blocks_loaded", "KV blocks loaded from the connector.", kv_connector.num_blocks_loaded),
                ("bytes_loaded", "Bytes of KV loaded from the connector.", kv_connector.num_bytes_loaded),
                ("load_seconds", "Time spent loading KV blocks (loader thread).", kv_connector.load_seconds),
                (
                    "load_failures",
                    "KV blocks that failed their checks and were recomputed.",
                    kv_connector.num_load_failures,
                ),
                ("blocks_stored", "KV blocks stored by the connector.", kv_connector.num_blocks_stored),
                ("bytes_stored", "Bytes of KV stored by the connector.", kv_connector.num_bytes_stored),
                (
                    "blocks_not_stored",
                    "KV blocks offered but not stored (saver busy or failed).",
                    kv_connector.num_blocks_not_stored,
                ),
            ):
                yield counter(f"vllm:kv_connector_{name}", documentation, value)
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens
            )
            per_position = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=["model_name", "position"],
            )
            for position, count in enumerate(spec.num_accepted_tokens_per_pos or []):
                per_position.add_metric([self.model_name, str(position)], count)
            yield per_position


class ServerMetrics:
    """The app's metrics; one instance (and one CollectorRegistry) per app."""

    def __init__(self, engine: EngineClient, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Time between tokens, seconds.")
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds", "Time per output token, seconds (the older name)."
        )
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.")
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(EngineStatsCollector(engine, model_name))

    def count_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one engine request's latencies as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics | None, num_prompt_tokens: int):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_generated_tokens = 0

    def on_output(self, num_new_tokens: int) -> None:
        if self.metrics is None or num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
        else:
            # one engine step can add several tokens (n > 1): spread the step over them
            per_token = (now - self.last_token_time) / num_new_tokens
            for _ in range(num_new_tokens):
                self.metrics.inter_token_latency.observe(per_token)
                self.metrics.time_per_output_token.observe(per_token)
        self.last_token_time = now
        self.num_generated_tokens += num_new_tokens

    def on_finish(self, finish_reasons: list[str]) -> None:
        if self.metrics is None:
            return
        self.metrics.e2e_latency.observe(time.monotonic() - self.arrival)
        self.metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        self.metrics.request_generation_tokens.observe(self.num_generated_tokens)
        for reason in finish_reasons:
            self.metrics.count_finished(reason)


def format_stats_line(
    stats: EngineStats,
    previous_totals: tuple[int, int] | None,
    elapsed_s: float,
    previous_spec: SpecDecodingStats | None = None,
) -> str:
    """One line: throughput since the previous line (``previous_totals`` are its prompt and
    generation token totals), queue sizes, KV usage, prefix-cache hit rate; with speculative
    decoding, the draft acceptance rate since the previous line (``previous_spec``: its
    counters)."""
    if previous_totals is not None and elapsed_s > 0:
        prompt_tps = (stats.prompt_tokens_total - previous_totals[0]) / elapsed_s
        generation_tps = (stats.generation_tokens_total - previous_totals[1]) / elapsed_s
    else:
        prompt_tps = generation_tps = 0.0
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    return (
        f"prompt throughput: {prompt_tps:.1f} tokens/s, generation throughput: {generation_tps:.1f} tokens/s, "
        f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
        f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, prefix cache hit rate: {100 * hit_rate:.1f}%"
        + _spec_decoding_summary(getattr(stats, "spec_decoding", None), previous_spec)
    )


def _spec_decoding_summary(spec: SpecDecodingStats | None, previous: SpecDecodingStats | None) -> str:
    if spec is None:
        return ""
    drafts = spec.num_drafts - (previous.num_drafts if previous else 0)
    draft_tokens = spec.num_draft_tokens - (previous.num_draft_tokens if previous else 0)
    accepted = spec.num_accepted_tokens - (previous.num_accepted_tokens if previous else 0)
    rate = accepted / draft_tokens if draft_tokens else 0.0
    # tokens a verifying step yields on average: the accepted drafts plus the one it always samples
    mean_length = 1 + accepted / drafts if drafts else 1.0
    return (
        f", spec decode draft acceptance rate: {100 * rate:.1f}%, mean acceptance length: {mean_length:.2f} "
        f"({accepted} of {draft_tokens} draft tokens accepted)"
    )


async def log_stats_periodically(engine: EngineClient, interval_s: float = STATS_LOG_INTERVAL_S) -> None:
    """Runs until cancelled (the app's lifespan owns the task)."""
    previous: tuple[int, int] | None = None
    previous_time = time.monotonic()
    previous_spec: SpecDecodingStats | None = None
    while True:
        await asyncio.sleep(interval_s)
        try:
            stats = engine.stats()
        except Exception as exc:
            logger.warning("could not read engine stats: %s", exc)
            continue
        now = time.monotonic()
        logger.info(format_stats_line(stats, previous, now - previous_time, previous_spec))
        # copy the totals: the engine may update its stats object in place
        previous, previous_time = (stats.prompt_tokens_total, stats.generation_tokens_total), now
        spec = getattr(stats, "spec_decoding", None)
        previous_spec = spec.copy() if spec is not None else None
