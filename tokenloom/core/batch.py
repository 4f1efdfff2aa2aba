"""The data that crosses the core's boundaries each step, as dataclasses of plain values:
scheduler -> executor (:class:`SchedulerOutput`), executor -> engine
(:class:`ModelRunnerOutput`), and model runner -> model (:class:`AttentionMetadata`).

Executors may send :class:`SchedulerOutput` and :class:`ModelRunnerOutput` to other
processes: they hold no live objects and no device tensors (only pooled outputs, as CPU
tensors, which pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from tokenloom.core.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # tokens already generated: non-empty when a preempted request is resumed (recomputed)
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # a pooling request's PoolingParams (None for generation): the worker pools, never samples
    pooling_params: Any = None
    # the LoRA adapter it runs with (a tokenloom.lora.request.LoRARequest, plain data; None: the base model)
    lora_request: Any = None
    # the prompt's images (tokenloom.core.multimodal.inputs.MultiModalItem: CPU tensors, which pickle)
    mm_items: list[Any] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # the tokens this step computes (from num_computed_tokens on, drafts excluded), sent only
    # under pipeline parallelism: a stage before the last never samples, so it learns the
    # tokens the last stage sampled from here (vLLM V1 does the same)
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class StructuredOutputMasks:
    """A step's guided-decoding masks: row ``i`` of ``bitmask`` (a numpy int32 array of shape
    ``[len(req_ids), ceil(vocab_size / 32)]``, bit set = token allowed) is for ``req_ids[i]``."""

    req_ids: list[str]
    bitmask: Any


@dataclass
class SchedulerOutput:
    """One scheduling decision: which requests run this step, and how many tokens each.

    One mechanism covers prefill, chunked prefill, decode and prefix-cache hits: a request
    computes ``num_scheduled_tokens[req_id]`` tokens starting at its ``num_computed_tokens``.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # requests the worker must forget (finished, aborted or preempted since the last step)
    finished_req_ids: set[str] = field(default_factory=set)
    # those of finished_req_ids that were preempted: they come back as new requests carrying
    # their output so far, and a seeded one keeps drawing from where its generator stood
    preempted_req_ids: set[str] = field(default_factory=set)
    # allowed-token masks of the constrained requests that sample this step (set by the engine);
    # a request verifying k draft tokens has k + 1 consecutive rows, one per position
    structured_output: StructuredOutputMasks | None = None
    # speculative decoding: the draft tokens each request verifies this step (its scheduled
    # tokens are its one pending token plus these)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # speculation is on at this batch size: the worker drafts for the requests that sample
    propose_drafts: bool = False
    # the KV connector's loads and saves for this step (None: no connector)
    kv_connector_metadata: KVConnectorMetadata | None = None

    def trim_draft_tokens(self, req_id: str, num_kept: int) -> None:
        """Verify only the first ``num_kept`` drafts of ``req_id`` (e.g. the grammar rejects
        the next one): its scheduled tokens shrink with them. The block slots stay allocated
        and are reused by the next step."""
        drafts = self.scheduled_spec_decode_tokens.get(req_id)
        if not drafts or num_kept >= len(drafts):
            return
        self.num_scheduled_tokens[req_id] -= len(drafts) - num_kept
        if num_kept:
            self.scheduled_spec_decode_tokens[req_id] = drafts[:num_kept]
        else:
            del self.scheduled_spec_decode_tokens[req_id]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def needs_worker(self) -> bool:
        """The worker has something to do: tokens to run, requests to forget, or KV-connector
        loads and saves (a step that runs nothing still collects loads that ended)."""
        metadata = self.kv_connector_metadata
        return bool(self.num_scheduled_tokens or self.finished_req_ids or (metadata is not None and metadata.has_work))


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    # rank of the chosen token among all tokens (1 = most likely)
    rank: int


@dataclass
class ModelRunnerOutput:
    """What one step produced, per request id."""

    # the token(s) sampled this step; empty for a request still in (chunked) prefill
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # logprobs of the prompt positions computed this step (only requests that asked)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # for pooling models: the pooled output of requests whose prompt finished this step
    pooled: dict[str, Any] = field(default_factory=dict)
    # requests that failed inside the worker (e.g. a sampler error): id -> message
    errors: dict[str, str] = field(default_factory=dict)
    # speculative decoding: the tokens proposed for each request to verify next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # the encoder cache this step: images looked up, and those found (not encoded again)
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    # what the KV connector loaded and stored since the last step (None: no connector)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class KVCacheScales:
    """One attention layer's fp8 KV-cache scales (vLLM's ``k_scale``/``v_scale``): a cached
    key element ``q`` stands for ``q * k_scale``, a value element for ``q * v_scale``. Both are
    1.0 unless ``--calculate-kv-scales`` asks the layer to set them from the first step that
    writes its cache (``pending`` until then); the model runner keeps one per layer, beside
    the layer's cache."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    pending: bool = False


@dataclass
class AttentionMetadata:
    """How the flat batch of tokens maps onto sequences and KV-cache slots.

    The batch holds ``num_tokens`` tokens of ``num_seqs`` sequences, sequence ``i`` owning
    the tokens ``query_start_loc[i]:query_start_loc[i+1]``. Tensors live on the model's
    device; the ``*_cpu`` lists are the same values for Python-side loops.
    """

    # [num_tokens] flat index (block_id * block_size + offset) where each token's K/V go
    slot_mapping: Any
    # [num_seqs + 1] cumulative query lengths
    query_start_loc: Any
    # [num_seqs] tokens in the KV cache after this step (computed before + this step's)
    seq_lens: Any
    # [num_seqs, max_blocks] block ids of each sequence, padded with 0
    block_tables: Any
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # one tensor per attention layer: [2, num_blocks, block_size, num_kv_heads, head_size]
    kv_caches: list[Any]
    # the platform's attention backend (an object with ``forward``), chosen by the runner
    backend: Any = None
    # True when sequences attend both ways (encoder models); no KV cache is written then
    bidirectional: bool = False
    # one per attention layer when the cache is fp8 (--kv-cache-dtype fp8*), else None
    kv_scales: list[KVCacheScales] | None = None
    # per sequence, how many of its query's last tokens are drafts being verified (speculative
    # decoding; None when no sequence verifies): such a query, the pending token and its drafts,
    # is a decode of each row in turn, which a backend may run as that many decode rows
    num_draft_tokens_cpu: list[int] | None = None
    # per sequence, the [start, end) position ranges of its prompt whose tokens attend to each
    # other both ways on top of the causal mask (a Gemma 3 image's tokens, computed whole in one
    # step); None when no sequence of the step has one
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # per sequence, how many of its query's first tokens are at positions inside its prompt (the
    # rest are generated tokens: decodes, drafts, a preempted request's recomputed outputs); None
    # when the runner did not say (a draft model's step, an encoder's). Kernels that multiply
    # prompt rows another way (layers/row_roles.py) read it.
    prompt_query_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def encoder_attention_metadata(sequence_lengths: list[int], backend: Any) -> AttentionMetadata:
    """The metadata of a batch of sequences that attend both ways within themselves and keep no
    KV cache: a vision encoder's images, ``sequence_lengths[i]`` tokens each, run through the
    platform's attention ``backend``."""
    max_length = max(sequence_lengths)
    return AttentionMetadata(
        slot_mapping=None,
        query_start_loc=None,
        seq_lens=None,
        block_tables=None,
        query_lens_cpu=list(sequence_lengths),
        seq_lens_cpu=list(sequence_lengths),
        max_query_len=max_length,
        max_seq_len=max_length,
        block_size=1,
        kv_caches=[],
        backend=backend,
        bidirectional=True,
    )
