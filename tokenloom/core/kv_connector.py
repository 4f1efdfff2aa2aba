"""KV connectors (``--kv-transfer-config``, plugin kind ``register_kv_connectors``): a store of
KV-cache blocks outside the engine's own cache (a directory, another instance, a cache
server), keyed by the prefix cache's sha256 block hashes, so a prefix computed before a restart
or by another instance is loaded instead of recomputed.

The split follows vLLM's KV connector V1. A plugin subclasses :class:`KVConnector` and
implements three storage calls; the core here runs them at the right moments:

- scheduler side (the engine's process), :class:`KVConnectorScheduler`: for a new request, after
  the local prefix-cache hit, :meth:`~KVConnectorScheduler.get_num_new_matched_tokens` asks the
  connector how many more leading blocks it holds (``KVConnector.num_stored_blocks``); once the
  scheduler has allocated blocks for them, :meth:`~KVConnectorScheduler.update_state_after_alloc`
  records which block ids to fill from which hashes; every scheduled step offers the full prompt
  blocks it computes for saving; :meth:`~KVConnectorScheduler.build_connector_meta` puts loads
  and saves into the step's :class:`KVConnectorMetadata` (plain data, so the ``mp`` executor
  ships it to the worker process with the rest of the step).
- worker side, :class:`KVConnectorWorker`: ``start_load_kv`` hands a step's loads to a loader
  thread (``KVConnector.load_block`` per block, copied into the KV cache), ``save_kv`` copies the
  blocks the step computed out of the cache after the forward and hands them to a saver thread
  (``KVConnector.save_block``; a ``kv_producer`` waits for it, so the blocks are stored when its
  response returns), and ``get_finished`` reports the requests whose loads are done.

A request whose blocks load waits outside the scheduler's queues (it holds its blocks, nothing
runs for it) while the other requests keep stepping; when the worker reports its load, it goes
back to the head of the waiting queue with the loaded tokens counted as computed and prefills
only the tail. A block that fails to load (missing, corrupt, another layout) ends the loaded
run there: the rest of the prefix is recomputed like any uncached prompt.

Only generation requests without LoRA, prompt logprobs or pooling use the connector: LoRA ids
are given out per process, so a stored block's adapter could not be told apart after a restart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.core.config import KVTransferConfig
from tokenloom.errors import ConfigError, TokenloomError

if TYPE_CHECKING:
    import torch

    from tokenloom.core.block_manager import BlockManager
    from tokenloom.core.config import EngineConfig
    from tokenloom.core.model_loader import ModelInfo
    from tokenloom.core.sequence import EngineSequence
    from tokenloom.plugins.manager import PluginSet

logger = logging.getLogger(__name__)

# the saver copies a step's computed blocks out of the cache; past this many bytes waiting to be
# stored, a step's blocks are skipped (counted) rather than letting host memory grow
MAX_PENDING_SAVE_BYTES = 512 * 2**20
# when a step has nothing to run but loads are in flight, how long the worker waits for one to end
IDLE_LOAD_WAIT_SECONDS = 0.01
# files whose bytes name the model's weights in the store's namespace
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


class KVBlockCorruptError(TokenloomError):
    """A stored block failed its checks (checksum, length, namespace, layout): never served."""


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector is built with, the same in the engine's process and in the worker.

    ``namespace`` is a digest of everything a block's bytes depend on (the model's files,
    architecture and config, dtype, KV-cache dtype, block size, tokenizer): a connector keeps
    blocks of different namespaces apart, so a block written for one model is never loaded
    into another. ``namespace_parts`` is what the digest was taken of (for a manifest)."""

    config: KVTransferConfig
    namespace: str
    namespace_parts: dict[str, Any]
    block_size: int

    @property
    def extra_config(self) -> dict[str, Any]:
        return self.config.kv_connector_extra_config


class KVConnector:
    """A KV-connector plugin: stores and returns whole KV-cache blocks by their prefix hash.

    Built once in the engine's process (scheduler side) and once in the worker, each as
    ``Connector(context)`` with a :class:`KVConnectorContext`; check ``context.extra_config``
    in ``__init__`` and raise ``ConfigError`` for a bad option.

    A block is a CPU tensor of shape ``[num_layers, 2, block_size, num_kv_heads, head_size]``
    (keys then values of every attention layer) in the KV cache's dtype. Block hashes are
    32-byte sha256 digests of a chain that covers every token before the block, the request's
    ``cache_salt`` and its LoRA adapter, so equal hashes mean equal prefixes.
    """

    def __init__(self, context: KVConnectorContext):
        self.context = context

    # -- scheduler side (the engine's process) ------------------------------------------------

    def num_stored_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes`` (consecutive blocks of one prompt), from the first on,
        this connector can load. Called in the step loop: answer from an index or the file
        system's metadata, never by reading blocks."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the start-up log: where the blocks live and any bound."""
        return type(self).__name__

    # -- worker side (called on the connector's loader and saver threads) ---------------------

    def load_block(self, block_hash: bytes) -> torch.Tensor | None:
        """The stored block, or None when it is not (or no longer) stored. Raise
        :class:`KVBlockCorruptError` for a block that fails its checks: it is recomputed."""
        raise NotImplementedError

    def save_block(self, block_hash: bytes, kv: torch.Tensor) -> int:
        """Store one computed block (``kv`` is the connector's own copy); returns the bytes
        written (0 when the block was stored already)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the connector holds (called once, after the last save)."""


# -- what crosses the executor each step ---------------------------------------------------------


@dataclass
class KVConnectorMetadata:
    """One step's connector work, as plain data: the blocks to load per request (block id,
    hash; in token order) and the blocks this step computes, to save after its forward."""

    loads: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    saves: list[tuple[int, bytes]] = field(default_factory=list)
    # requests still waiting on a load: while any does, the worker is called even for a step
    # that runs nothing, to report loads that end
    num_loads_in_flight: int = 0

    @property
    def has_work(self) -> bool:
        return bool(self.loads or self.saves or self.num_loads_in_flight)


@dataclass
class KVConnectorOutput:
    """What the worker's connector did since the last step."""

    # request id -> how many of its blocks loaded, from the first (fewer than asked: a block
    # was missing or corrupt, and the rest of the prefix is recomputed)
    finished_loads: dict[str, int] = field(default_factory=dict)
    num_blocks_loaded: int = 0
    num_bytes_loaded: int = 0
    load_seconds: float = 0.0
    num_load_failures: int = 0
    num_blocks_stored: int = 0
    num_bytes_stored: int = 0
    num_blocks_not_stored: int = 0


@dataclass
class KVConnectorStats:
    """Since start: lookups in tokens (like the prefix cache's) and the worker's transfers."""

    queries: int = 0
    hits: int = 0
    num_blocks_loaded: int = 0
    num_bytes_loaded: int = 0
    load_seconds: float = 0.0
    num_load_failures: int = 0
    num_blocks_stored: int = 0
    num_bytes_stored: int = 0
    num_blocks_not_stored: int = 0

    def add(self, output: KVConnectorOutput) -> None:
        self.num_blocks_loaded += output.num_blocks_loaded
        self.num_bytes_loaded += output.num_bytes_loaded
        self.load_seconds += output.load_seconds
        self.num_load_failures += output.num_load_failures
        self.num_blocks_stored += output.num_blocks_stored
        self.num_bytes_stored += output.num_bytes_stored
        self.num_blocks_not_stored += output.num_blocks_not_stored


# -- building -------------------------------------------------------------------------------------


def kv_connector_context(config: EngineConfig, model_info: ModelInfo) -> KVConnectorContext:
    """The context of the configured connector: its namespace from the model, its files, the
    dtypes, the block layout and the tokenizer."""
    assert config.kv_transfer is not None  # only built when a connector is configured
    hf_config = model_info.hf_config
    try:
        hf_config_text = hf_config.to_json_string(use_diff=False)
    except AttributeError:
        hf_config_text = repr(hf_config)
    parts = {
        "format": 1,
        "model": model_info.path,
        "weights": _weight_files(model_info.path),
        "architecture": model_info.architecture,
        "quantization": model_info.quantization,
        "hf_config": hashlib.sha256(hf_config_text.encode("utf-8")).hexdigest(),
        "dtype": config.model.dtype,
        "kv_cache_dtype": config.cache.cache_dtype,
        "block_size": config.cache.block_size,
        "tokenizer": config.model.tokenizer or model_info.path,
        "vocab_size": model_info.vocab_size,
    }
    namespace = hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:32]
    return KVConnectorContext(config.kv_transfer, namespace, parts, config.cache.block_size)


def _weight_files(path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the model's weight files: other weights at the same path give
    another namespace."""
    if os.path.isfile(path):
        stat = os.stat(path)
        return [(os.path.basename(path), stat.st_size, stat.st_mtime_ns)]
    if not os.path.isdir(path):
        return []
    files = []
    for entry in sorted(os.scandir(path), key=lambda entry: entry.name):
        if entry.is_file() and entry.name.endswith(WEIGHT_SUFFIXES):
            stat = entry.stat()
            files.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return files


def check_kv_transfer(config: EngineConfig, plugins: PluginSet) -> None:
    """``--kv-transfer-config`` names a registered connector, and the engine's settings let a
    stored block stand for the same prefix later (before the model loads)."""
    kv_transfer = config.kv_transfer
    if kv_transfer is None:
        return
    plugins.registry("kv_connector").get(kv_transfer.kv_connector)
    if config.cache.prefix_caching_hash_algo != "sha256":
        raise ConfigError(
            "--kv-transfer-config stores blocks under their sha256 prefix hash, which outlives the process; "
            "--prefix-caching-hash-algo builtin is salted per process: use sha256 (the default)",
            param="prefix-caching-hash-algo",
        )
    if config.parallel.tensor_parallel_size > 1 or config.parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            "--kv-transfer-config runs with one worker: tensor and pipeline parallelism split a block's layers "
            "and heads over workers; drop -tp/-pp or the connector",
            param="kv-transfer-config",
        )


def build_kv_connector(config: EngineConfig, model_info: ModelInfo, plugins: PluginSet) -> KVConnector:
    """The configured connector plugin, built (its options checked) for this process."""
    assert config.kv_transfer is not None  # only built when a connector is configured
    connector_class = plugins.registry("kv_connector").get(config.kv_transfer.kv_connector)
    connector = connector_class(kv_connector_context(config, model_info))
    if not isinstance(connector, KVConnector):
        raise ConfigError(
            f"KV connector {config.kv_transfer.kv_connector!r} is a {type(connector).__name__}, "
            "not a tokenloom.plugin_api.KVConnector",
            param="kv-transfer-config",
        )
    return connector


# -- scheduler side ---------------------------------------------------------------------------------


class KVConnectorScheduler:
    """The scheduler's half: which blocks to load for a new request, which to save each step."""

    def __init__(self, connector: KVConnector, block_manager: BlockManager):
        self.connector = connector
        self.config = connector.context.config
        self.block_manager = block_manager
        self.stats = KVConnectorStats()
        self._loads: dict[str, list[tuple[int, bytes]]] = {}
        self._saves: list[tuple[int, bytes]] = []
        # request id -> tokens its last lookup asked the connector about (counted on admission)
        self._queried: dict[str, int] = {}

    @staticmethod
    def applies_to(seq: EngineSequence) -> bool:
        """Generation requests without LoRA (whose ids are per process), prompt logprobs or
        pooling (which need every prompt position computed)."""
        return seq.lora_request is None and seq.pooling_params is None and seq.sampling_params.prompt_logprobs is None

    def get_num_new_matched_tokens(self, seq: EngineSequence, num_local_tokens: int) -> int:
        """Tokens past the local hit of ``num_local_tokens`` the connector can load: whole
        blocks, stopping one token short of the sequence (its last token is always computed)."""
        self._queried.pop(seq.seq_id, None)
        if not self.config.loads or not self.applies_to(seq):
            return 0
        block_size = self.block_manager.block_size
        first = num_local_tokens // block_size
        last = (seq.num_tokens - 1) // block_size
        if last <= first:
            return 0
        hashes = self._hashes(seq, first, last)
        num_blocks = min(len(hashes), max(0, self.connector.num_stored_blocks(hashes)))
        self._queried[seq.seq_id] = (last - first) * block_size
        return num_blocks * block_size

    def update_state_after_alloc(self, seq: EngineSequence, num_local_tokens: int, num_external_tokens: int) -> None:
        """The request was admitted with the lookup's answer (counted in :attr:`stats` now, once
        per admission) and holds blocks for the tokens to load: queue their loads."""
        self.stats.queries += self._queried.pop(seq.seq_id, 0)
        self.stats.hits += num_external_tokens
        if not num_external_tokens:
            return
        block_size = self.block_manager.block_size
        first = num_local_tokens // block_size
        last = first + num_external_tokens // block_size
        table = self.block_manager.get_block_table(seq.seq_id)
        hashes = self._hashes(seq, first, last)
        self._loads[seq.seq_id] = [(table[index], hashes[index - first]) for index in range(first, last)]

    def request_scheduled(self, seq: EngineSequence, num_new_tokens: int) -> None:
        """Offer the full prompt blocks this step computes for ``seq`` for saving."""
        if not self.config.saves or not self.applies_to(seq):
            return
        block_size = self.block_manager.block_size
        first = seq.num_computed_tokens // block_size
        last = min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens) // block_size
        if last <= first:
            return
        table = self.block_manager.get_block_table(seq.seq_id)
        # a block stored already is the connector's to skip (a recomputed one: after a preemption,
        # a failed load, or a save the worker had to drop)
        for index, block_hash in enumerate(self._hashes(seq, first, last), start=first):
            self._saves.append((table[index], block_hash))

    def _hashes(self, seq: EngineSequence, first: int, last: int) -> list[bytes]:
        hashes = self.block_manager.block_hashes(seq, first, last)
        # the sha256 chain's digests (check_kv_transfer refuses the per-process builtin hash)
        assert all(isinstance(block_hash, bytes) for block_hash in hashes)
        return hashes  # type: ignore[return-value]

    def request_finished(self, seq_id: str) -> None:
        """The request left the scheduler: forget its lookup."""
        self._queried.pop(seq_id, None)

    def build_connector_meta(self, num_loads_in_flight: int) -> KVConnectorMetadata:
        """This step's loads and saves (taken: the next step starts empty)."""
        metadata = KVConnectorMetadata(self._loads, self._saves, num_loads_in_flight)
        self._loads, self._saves = {}, []
        return metadata


# -- worker side --------------------------------------------------------------------------------------


class KVConnectorWorker:
    """The worker's half: loads on one thread, saves on another, never in the step's way."""

    def __init__(self, connector: KVConnector, kv_caches: list[torch.Tensor]):
        self.connector = connector
        self.kv_caches = kv_caches
        first = kv_caches[0]
        # [num_layers, 2, block_size, num_kv_heads, head_size]
        self.block_shape = (len(kv_caches), first.shape[0], *first.shape[2:])
        self.block_dtype = first.dtype
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-kv-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-kv-save")
        self._done: queue.Queue[tuple[str, int, int, float, int]] = queue.Queue()
        self._num_loading = 0
        self._lock = threading.Lock()
        self._pending_save_bytes = 0
        self._stored = KVConnectorOutput()
        # a producer exists to store: its step returns once the blocks are stored, so a consumer
        # sent the request next finds them all (vLLM's shared-storage producer does the same)
        self.synchronous_save = connector.context.config.kv_role == "kv_producer"

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for req_id, blocks in metadata.loads.items():
            self._num_loading += 1
            self._loader.submit(self._load, req_id, blocks)

    def _load(self, req_id: str, blocks: list[tuple[int, bytes]]) -> None:
        started = time.perf_counter()
        num_loaded = num_bytes = num_failures = 0
        try:
            for block_id, block_hash in blocks:
                try:
                    kv = self.connector.load_block(block_hash)
                    if kv is not None and (tuple(kv.shape) != self.block_shape or kv.dtype != self.block_dtype):
                        raise KVBlockCorruptError(
                            f"shape {tuple(kv.shape)} {kv.dtype}, the cache's is {self.block_shape} {self.block_dtype}"
                        )
                except Exception as exc:
                    logger.warning("KV block %s not loaded (it is recomputed): %s", block_hash.hex()[:16], exc)
                    num_failures += 1
                    break
                if kv is None:
                    break
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, block_id].copy_(kv[layer])
                num_loaded += 1
                num_bytes += kv.numel() * kv.element_size()
        finally:
            self._done.put((req_id, num_loaded, num_bytes, time.perf_counter() - started, num_failures))

    def save_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """After the step's forward: copy its computed blocks out, store them on the saver thread."""
        if metadata is None or not metadata.saves:
            return
        import torch

        block_ids = [block_id for block_id, _ in metadata.saves]
        index = torch.tensor(block_ids, dtype=torch.int64)
        # [num_blocks, num_layers, 2, block_size, heads, head_size], the connector's own copy
        kv = torch.stack([cache.index_select(1, index) for cache in self.kv_caches]).permute(2, 0, 1, 3, 4, 5)
        kv = kv.contiguous()
        num_bytes = kv.numel() * kv.element_size()
        with self._lock:
            if self._pending_save_bytes + num_bytes > MAX_PENDING_SAVE_BYTES:
                self._stored.num_blocks_not_stored += len(block_ids)
                return
            self._pending_save_bytes += num_bytes
        saved = self._saver.submit(self._save, [block_hash for _, block_hash in metadata.saves], kv, num_bytes)
        if self.synchronous_save:
            saved.result()

    def _save(self, hashes: list[bytes], kv: torch.Tensor, num_bytes: int) -> None:
        for position, block_hash in enumerate(hashes):
            try:
                written = self.connector.save_block(block_hash, kv[position])
            except Exception as exc:
                logger.warning("KV block %s not stored: %s", block_hash.hex()[:16], exc)
                with self._lock:
                    self._stored.num_blocks_not_stored += 1
                continue
            with self._lock:
                if written:
                    self._stored.num_blocks_stored += 1
                    self._stored.num_bytes_stored += written
        with self._lock:
            self._pending_save_bytes -= num_bytes

    def get_finished(self, wait: bool = False) -> KVConnectorOutput:
        """Loads that ended and saves done since the last call. ``wait``: the step ran nothing,
        so wait briefly for a load in flight to end rather than spin."""
        with self._lock:
            output, self._stored = self._stored, KVConnectorOutput()
        if wait and self._num_loading and self._done.empty():
            try:
                self._record(output, self._done.get(timeout=IDLE_LOAD_WAIT_SECONDS))
            except queue.Empty:
                return output
        while True:
            try:
                self._record(output, self._done.get_nowait())
            except queue.Empty:
                return output

    def _record(self, output: KVConnectorOutput, done: tuple[str, int, int, float, int]) -> None:
        req_id, num_loaded, num_bytes, seconds, num_failures = done
        self._num_loading -= 1
        output.finished_loads[req_id] = num_loaded
        output.num_blocks_loaded += num_loaded
        output.num_bytes_loaded += num_bytes
        output.load_seconds += seconds
        output.num_load_failures += num_failures

    def wait_for_save(self) -> None:
        """Block until every queued save is stored (tests, benchmarks)."""
        self._saver.submit(lambda: None).result()

    def wait_for_load(self) -> None:
        """Block until every started load has written its blocks (tests)."""
        self._loader.submit(lambda: None).result()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self.connector.close()
