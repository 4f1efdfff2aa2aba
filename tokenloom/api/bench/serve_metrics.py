"""``bench serve``'s figures from the per-request results, computed and printed as vLLM's
``bench serve`` does: throughputs over the benchmark duration; TTFT, TPOT (time per output
token after the first), ITL (inter-token latency) and E2EL (end-to-end latency) as mean,
median, standard deviation and chosen percentiles, in milliseconds; peak output tokens/s and
peak concurrent requests over one-second buckets."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenloom.api.bench.common import mean, percentile, percentile_label, std
from tokenloom.api.bench.serve_client import RequestResult

METRICS = {  # name -> (label, section heading)
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
WIDTH = 50


@dataclass
class MetricStats:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (percent, value)

    @classmethod
    def of(cls, seconds: Sequence[float], percents: Sequence[float]) -> MetricStats:
        values = [value * 1000 for value in seconds]
        return cls(
            mean(values),
            percentile(values, 50),
            std(values),
            [(percent, percentile(values, percent)) for percent in percents],
        )


@dataclass
class ServeMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]  # per request, 0 for a failed one
    stats: dict[str, MetricStats] = field(default_factory=dict)  # by METRICS name

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration

    @property
    def output_throughput(self) -> float:
        return self.total_output / self.duration

    @property
    def total_token_throughput(self) -> float:
        return (self.total_input + self.total_output) / self.duration


def calculate_metrics(
    results: Sequence[RequestResult], duration: float, percents: Sequence[float], count_tokens: Callable[[str], int]
) -> ServeMetrics:
    """Figures over the successful requests. ``count_tokens`` counts a generated text's tokens
    for servers that send no usage chunk."""
    output_lens: list[int] = []
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = 0
    for result in results:
        if not result.success:
            output_lens.append(0)
            continue
        output_len = result.output_tokens or count_tokens(result.generated_text)
        output_lens.append(output_len)
        total_input += result.prompt_len
        if output_len > 1:
            tpots.append((result.latency - result.ttft) / (output_len - 1))
        itls.extend(result.itl)
        ttfts.append(result.ttft)
        e2els.append(result.latency)
    successful = [result for result in results if result.success]
    peak_tokens, peak_requests = peaks(successful)
    samples = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    return ServeMetrics(
        completed=len(successful),
        failed=len(results) - len(successful),
        total_input=total_input,
        total_output=sum(output_lens),
        duration=duration,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
        output_lens=output_lens,
        stats={name: MetricStats.of(values, percents) for name, values in samples.items()},
    )


def peaks(results: Sequence[RequestResult]) -> tuple[float, int]:
    """The most streamed chunks (tokens) in any one-second bucket from the first request's
    start, and the most requests in flight during any such second."""
    if not results:
        return 0.0, 0
    origin = min(result.start_time for result in results)
    end = max(result.start_time + result.latency for result in results)
    num_buckets = int(math.ceil(end - origin)) + 1
    tokens = [0] * num_buckets
    in_flight = [0] * num_buckets
    for result in results:
        arrival = result.start_time + result.ttft
        for gap in [0.0, *result.itl]:
            arrival += gap
            bucket = int(arrival - origin)
            if 0 <= bucket < num_buckets:
                tokens[bucket] += 1
        first = int(result.start_time - origin)
        last = min(int(result.start_time + result.latency - origin), num_buckets - 1)
        for bucket in range(first, last + 1):
            in_flight[bucket] += 1
    return float(max(tokens)), max(in_flight)


def summary_lines(
    metrics: ServeMetrics, selected: Sequence[str], *, max_concurrency: int | None, request_rate: float
) -> list[str]:
    """The summary table, line for line as vLLM prints it."""

    def row(label: str, value: Any, decimals: bool = True) -> str:
        return f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}"

    lines = [" Serving Benchmark Result ".center(WIDTH, "="), row("Successful requests:", metrics.completed, False)]
    if metrics.failed:
        lines.append(row("Failed requests:", metrics.failed, False))
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency, False))
    if request_rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", request_rate))
    lines += [
        row("Benchmark duration (s):", metrics.duration),
        row("Total input tokens:", metrics.total_input, False),
        row("Total generated tokens:", metrics.total_output, False),
        row("Request throughput (req/s):", metrics.request_throughput),
        row("Output token throughput (tok/s):", metrics.output_throughput),
        row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        row("Peak concurrent requests:", float(metrics.max_concurrent_requests)),
        row("Total Token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for name in selected:
        label, heading = METRICS[name]
        stats = metrics.stats[name]
        lines += [
            f"{heading:-^{WIDTH}}",
            row(f"Mean {label} (ms):", stats.mean),
            row(f"Median {label} (ms):", stats.median),
        ]
        lines += [row(f"P{percentile_label(percent)} {label} (ms):", value) for percent, value in stats.percentiles]
    lines.append("=" * WIDTH)
    return lines


def result_json(metrics: ServeMetrics, results: Sequence[RequestResult], selected: Sequence[str]) -> dict[str, Any]:
    """The benchmark's JSON figures under vLLM's keys; the per-request lists (``input_lens``,
    ``output_lens``, ``ttfts``, ``itls``, ``generated_texts``, ``errors``) are what
    ``--save-detailed`` keeps."""
    figures: dict[str, Any] = {
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "input_lens": [result.prompt_len for result in results],
        "output_lens": metrics.output_lens,
        "ttfts": [result.ttft for result in results],
        "itls": [result.itl for result in results],
        "generated_texts": [result.generated_text for result in results],
        "errors": [result.error for result in results],
    }
    for name in selected:
        stats = metrics.stats[name]
        figures[f"mean_{name}_ms"] = stats.mean
        figures[f"median_{name}_ms"] = stats.median
        figures[f"std_{name}_ms"] = stats.std
        for percent, value in stats.percentiles:
            figures[f"p{percentile_label(percent)}_{name}_ms"] = value
    return figures


DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
