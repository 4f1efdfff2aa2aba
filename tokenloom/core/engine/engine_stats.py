"""What an engine reports about itself (:class:`EngineStats`: queue sizes, KV-cache usage,
prefix-cache, token, LoRA, speculative-decoding, encoder-cache and KV-connector counters, read by
the server's /metrics and stats line), and how the stats of data-parallel replicas add up to one
engine's (:func:`sum_stats`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from tokenloom.core.kv_connector import KVConnectorStats
from tokenloom.core.scheduler_stats import SpecDecodingStats


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # LoRA (vLLM's lora_requests_info): the adapters of running and waiting requests, by name
    running_lora_adapters: list[str] = dataclasses.field(default_factory=list)
    waiting_lora_adapters: list[str] = dataclasses.field(default_factory=list)
    max_lora: int = 0
    # speculative decoding counters since start (None when it is off)
    spec_decoding: SpecDecodingStats | None = None
    # the encoder cache since start: images looked up, and found (a model that sees)
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    # KV-connector lookups and transfers since start (None without --kv-transfer-config)
    kv_connector: KVConnectorStats | None = None


def sum_stats(replica_stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts and counters summed, KV-cache usage the mean
    (every replica has a cache of the same size), LoRA adapters merged."""
    count = max(len(replica_stats), 1)
    spec_stats = [stats.spec_decoding for stats in replica_stats if stats.spec_decoding is not None]
    spec_decoding = None
    if spec_stats:
        per_position = [
            sum(values)
            for values in itertools.zip_longest(
                *(spec.num_accepted_tokens_per_pos or [] for spec in spec_stats), fillvalue=0
            )
        ]
        spec_decoding = dataclasses.replace(
            spec_stats[0],
            num_drafts=sum(spec.num_drafts for spec in spec_stats),
            num_draft_tokens=sum(spec.num_draft_tokens for spec in spec_stats),
            num_accepted_tokens=sum(spec.num_accepted_tokens for spec in spec_stats),
            num_accepted_tokens_per_pos=per_position,
        )

    connector_stats = [stats.kv_connector for stats in replica_stats if stats.kv_connector is not None]
    kv_connector = None
    if connector_stats:
        kv_connector = KVConnectorStats(
            **{
                f.name: sum(getattr(connector, f.name) for connector in connector_stats)
                for f in dataclasses.fields(KVConnectorStats)
            }
        )

    def merged(name: str) -> list[str]:
        return sorted({adapter for stats in replica_stats for adapter in getattr(stats, name)})

    return EngineStats(
        num_running=sum(stats.num_running for stats in replica_stats),
        num_waiting=sum(stats.num_waiting for stats in replica_stats),
        kv_cache_usage=sum(stats.kv_cache_usage for stats in replica_stats) / count,
        prefix_cache_queries=sum(stats.prefix_cache_queries for stats in replica_stats),
        prefix_cache_hits=sum(stats.prefix_cache_hits for stats in replica_stats),
        num_preemptions=sum(stats.num_preemptions for stats in replica_stats),
        prompt_tokens_total=sum(stats.prompt_tokens_total for stats in replica_stats),
        generation_tokens_total=sum(stats.generation_tokens_total for stats in replica_stats),
        running_lora_adapters=merged("running_lora_adapters"),
        waiting_lora_adapters=merged("waiting_lora_adapters"),
        max_lora=max((stats.max_lora for stats in replica_stats), default=0),
        spec_decoding=spec_decoding,
        mm_cache_queries=sum(stats.mm_cache_queries for stats in replica_stats),
        mm_cache_hits=sum(stats.mm_cache_hits for stats in replica_stats),
        kv_connector=kv_connector,
    )
