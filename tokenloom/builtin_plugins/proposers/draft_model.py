"""Draft-model speculation (``"method": "draft_model"``): a second, smaller model with the
target's tokenizer runs ``k`` decode steps per verifying step, and its proposals (with the
distribution each was drawn from) are verified by the target in one step.

The draft is resolved through the model-source plugins like the target (a packaged name such
as ``smollm2``, a GGUF file, a directory) and loaded in the target's worker. Its KV cache is
indexed by the target's block tables: one block of the engine's pool holds the target's and
the draft's KV of the same positions, so the block manager's allocation, prefix caching,
preemption and freeing cover both, and the scheduler's lookahead slots hold the KV the draft
writes for its own drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from tokenloom.errors import ConfigError, TokenloomError
from tokenloom.worker_api import (
    Draft,
    DraftRequest,
    EngineConfig,
    ModelInfo,
    Proposer,
    ProposerSpec,
    attention_backend_target,
    build_model,
    prepare_batch,
    resolve_model,
    resolve_target,
)

logger = logging.getLogger(__name__)

# added to --seed for the generator the drafts are drawn with (any constant but 0)
DRAFT_SEED_OFFSET = 0x5DEECE66D


def _bad(message: str) -> ConfigError:
    return ConfigError(f"--speculative-config: {message}", param="speculative-config")


def draft_engine_config(spec: ProposerSpec) -> EngineConfig:
    """The target's engine config with the draft model in its place: the draft's own
    quantization and context length, the target's dtype and load settings, no adapters."""
    speculative = spec.speculative
    if not speculative.model:
        raise _bad('method "draft_model" needs "model": the draft model (a path, a GGUF file or a packaged name)')
    model = dataclasses.replace(
        spec.config.model,
        model=speculative.model,
        tokenizer=None,
        revision=None,
        tokenizer_revision=None,
        quantization=speculative.quantization,
        max_model_len=speculative.max_model_len,
        served_model_name=None,
        hf_overrides=None,
        rope_scaling=None,
        rope_theta=None,
        runner="generate",
        task="auto",
        convert="auto",
        logits_processors=None,
    )
    lora = dataclasses.replace(spec.config.lora, enable_lora=False)
    return dataclasses.replace(spec.config, model=model, lora=lora, speculative=None)


def resolve_draft(spec: ProposerSpec, *, load_tokenizer: bool = True) -> tuple[EngineConfig, ModelInfo, Any]:
    """The draft model resolved to files, config and (unless ``load_tokenizer`` is false: only
    the vocabulary check needs it) tokenizer; errors name the draft."""
    config = draft_engine_config(spec)
    resolving = config
    if not load_tokenizer:
        resolving = dataclasses.replace(config, model=dataclasses.replace(config.model, skip_tokenizer_init=True))
    try:
        info, tokenizer = resolve_model(resolving, spec.plugins)
    except TokenloomError as exc:
        raise _bad(f"draft model {spec.speculative.model!r}: {exc}") from exc
    if info.runner != "generate":
        raise _bad(f"draft model {spec.speculative.model!r} is a pooling model; a draft must generate tokens")
    return config, info, tokenizer


def check_same_vocabulary(target: ModelInfo, target_tokenizer: Any, draft: ModelInfo, draft_tokenizer: Any) -> None:
    """A draft's token ids mean what the target's mean: same vocabulary size, and (when both
    have tokenizers) the same token -> id map. A ConfigError names both models otherwise."""
    names = f"the draft model {draft.name!r} ({draft.path}) and the target {target.name!r} ({target.path})"
    if draft.vocab_size != target.vocab_size:
        raise _bad(
            f"{names} have different vocabularies ({draft.vocab_size} and {target.vocab_size} tokens): "
            "a draft model must use the target's tokenizer"
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return  # --skip-tokenizer-init: the sizes are all there is to compare
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            (
                token
                for token in set(target_vocab) | set(draft_vocab)
                if target_vocab.get(token) != draft_vocab.get(token)
            ),
            key=lambda token: (min(target_vocab.get(token, 1 << 62), draft_vocab.get(token, 1 << 62)), token),
        )
        example = differing[0]
        raise _bad(
            f"{names} have different vocabularies ({len(differing)} tokens differ, e.g. {example!r}: "
            f"id {draft_vocab.get(example)} in the draft, {target_vocab.get(example)} in the target): "
            "a draft model must use the target's tokenizer"
        )


class DraftModelProposer(Proposer):
    """Runs the draft model over each request's tokens it has not seen yet, then ``k - 1``
    one-token steps, all requests batched; greedy requests take the draft's argmax, sampled
    ones draw from its distribution at the request's temperature (returned as ``probs``, so
    the rejection sampler keeps the target's distribution exactly)."""

    def __init__(self, spec: ProposerSpec):
        super().__init__(spec)
        self.num_speculative_tokens = spec.speculative.num_speculative_tokens
        self.block_size = spec.config.cache.block_size
        self.model: Any = None
        self.dtype: torch.dtype | None = None
        self.info: ModelInfo | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.attention_backend: Any = None
        # per request: the tokens whose KV the draft wrote, position by position; the next
        # proposal recomputes from the first one that differs from the request's tokens (a
        # rejected draft, or everything for a request the draft has not seen)
        self.computed_token_ids: dict[str, list[int]] = {}
        # the drafts' own random stream: seeded from --seed (repeatable runs) but never equal to
        # the sampler's, whose acceptance draws would otherwise repeat the drafts' draws and
        # bias the output (the chi-square test catches exactly that)
        self.generator = torch.Generator().manual_seed(((spec.config.model.seed or 0) + DRAFT_SEED_OFFSET) % 2**63)

    # -- set-up ----------------------------------------------------------------------------

    @classmethod
    def check(cls, spec: ProposerSpec, tokenizer: Any) -> None:
        _, info, draft_tokenizer = resolve_draft(spec)
        check_same_vocabulary(spec.model_info, tokenizer, info, draft_tokenizer)

    @classmethod
    def lookahead_slots(cls, speculative: Any) -> int:
        # the draft writes KV for its first k - 1 drafts after the step; one more slot is the
        # target's own next position, so k covers them
        return int(speculative.num_speculative_tokens)

    def load_model(self) -> None:
        # the engine checked the draft's vocabulary (check, with its tokenizer) before it
        # built the workers: loading the model needs its files and config only
        config, self.info, _ = resolve_draft(self.spec, load_tokenizer=False)
        platform = self.spec.platform
        self.device = platform.torch_device()
        self.model, self.dtype = build_model(config, self.info, self.spec.plugins, platform)
        self.attention_backend = resolve_target(
            attention_backend_target(
                self.spec.config.device.attention_backend, platform, self.spec.plugins.registry("attention_backend")
            )
        )()
        logger.info(
            "draft model %s (%s, quantization %s, context %d) proposes %d tokens per step",
            self.info.name,
            self.info.architecture,
            self.info.quantization or "none",
            self.info.max_model_len,
            self.num_speculative_tokens,
        )

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.model.kv_cache_spec
        return (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        assert self.dtype is not None, "load_model first"
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return int(self.model.kv_cache_spec.bytes_per_block(block_size, element_size))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # the draft's own dtype: an fp8 --kv-cache-dtype would need scales the draft has none of
        shape = self._kv_shape(num_blocks)
        self.kv_caches = [
            self.spec.platform.zeros(shape, self.dtype) for _ in range(self.model.kv_cache_spec.num_layers)
        ]

    def remove_requests(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.computed_token_ids.pop(req_id, None)

    # -- drafting --------------------------------------------------------------------------

    def _num_drafts(self, request: DraftRequest) -> int:
        """Drafts this request can get: the draft writes KV up to position ``L + m - 2`` (L
        tokens known), which must lie in its block table and inside the draft's context."""
        assert self.info is not None
        num_tokens = len(request.token_ids)
        capacity = len(request.block_ids) * self.block_size
        return max(
            0, min(request.max_draft_tokens, capacity - num_tokens + 1, self.info.max_model_len - num_tokens + 1)
        )

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        num_drafts = [self._num_drafts(request) for request in requests]
        active = [index for index, count in enumerate(num_drafts) if count > 0]
        if not active:
            return drafts
        probs: dict[int, list[torch.Tensor]] = {index: [] for index in active}
        # the first step: every token the draft has not computed, the last one included
        first_inputs: dict[int, tuple[int, list[int]]] = {}
        for index in active:
            request = requests[index]
            token_ids = request.token_ids
            known = self.computed_token_ids.get(request.req_id, [])
            start = 0
            limit = min(len(known), len(token_ids) - 1)
            while start < limit and known[start] == token_ids[start]:
                start += 1
            first_inputs[index] = (start, token_ids[start:])
        step_inputs = first_inputs
        for step in range(max(num_drafts)):
            rows = [index for index in active if num_drafts[index] > step]
            logits = self._run({index: step_inputs[index] for index in rows}, requests)
            for row, index in enumerate(rows):
                token_id, row_probs = self._choose(logits[row], requests[index].temperature)
                drafts[index].token_ids.append(token_id)
                if row_probs is not None:
                    probs[index].append(row_probs)
            step_inputs = {
                index: (len(requests[index].token_ids) + step, [drafts[index].token_ids[-1]]) for index in rows
            }
        for index in active:
            request = requests[index]
            # the KV written: the request's tokens, then each draft but the last (never fed)
            self.computed_token_ids[request.req_id] = list(request.token_ids) + drafts[index].token_ids[:-1]
            if probs[index]:
                drafts[index].probs = torch.stack(probs[index])
        return drafts

    def _choose(self, logits: torch.Tensor, temperature: float) -> tuple[int, torch.Tensor | None]:
        """Greedy: the argmax, a point mass. Sampled: a draw from softmax(logits / T), and that
        distribution (the rejection sampler's ``q``)."""
        if temperature <= 0:
            return int(logits.argmax()), None
        distribution = torch.softmax(logits.float() / temperature, dim=-1)
        token_id = int(torch.multinomial(distribution.cpu(), 1, generator=self.generator))
        return token_id, distribution

    def _run(self, inputs: dict[int, tuple[int, list[int]]], requests: list[DraftRequest]) -> torch.Tensor:
        """One draft forward pass: request ``index`` computes ``tokens`` from position
        ``start`` on; returns the logits at each request's last position, in order."""
        batch = prepare_batch(
            ((tokens, start, requests[index].block_ids) for index, (start, tokens) in inputs.items()),
            block_size=self.block_size,
            to_device=self.spec.platform.host_to_device,
            kv_caches=self.kv_caches,
            backend=self.attention_backend,
        )
        hidden_states = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        last_rows = batch.attn_metadata.query_start_loc[1:] - 1
        return self.model.compute_logits(hidden_states.index_select(0, last_rows)).float()
