"""The model runner's side of speculative decoding: verifying the scheduled drafts with the
rejection sampler, asking the proposer for the next step's, and how long each request's drafts
should be (the draft-length policy)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.model_runner_outputs import OutputAssembly
from tokenloom.core.sampling_metadata import SamplingMetadata
from tokenloom.core.spec_decode.draft_length import DraftLengthPolicy
from tokenloom.core.spec_decode.proposer import DraftRequest, Proposer
from tokenloom.core.spec_decode.rejection_sampler import DraftPrefixState, RejectionSampler
from tokenloom.core.step_inputs import PreparedBatch

if TYPE_CHECKING:
    from tokenloom.core.model_runner import CachedRequestState

logger = logging.getLogger(__name__)


class SpeculativeSteps(OutputAssembly):
    """Verifies drafts and proposes the next ones. Mixed into
    :class:`~tokenloom.core.model_runner.ModelRunner`, which sets the attributes."""

    requests: dict[str, CachedRequestState]
    rejection_sampler: RejectionSampler
    proposer: Proposer | None
    draft_length_policy: DraftLengthPolicy | None

    @staticmethod
    def _draft_length_policy(speculative: Any, platform: Any) -> DraftLengthPolicy:
        adaptive = speculative.adaptive_num_speculative_tokens
        row_cost = speculative.verify_row_cost
        if adaptive and row_cost is None:
            row_cost = platform.verify_row_cost()
        if adaptive:
            logger.info(
                "speculative decoding: each request drafts 1 to %d tokens, as its acceptance pays for "
                "(a verified row costs %.3g of a decode step)",
                speculative.num_speculative_tokens,
                row_cost,
            )
        return DraftLengthPolicy(speculative.num_speculative_tokens, adaptive, float(row_cost or 0.0))

    def _verify(
        self,
        scheduler_output: SchedulerOutput,
        states: list[CachedRequestState],
        sampling_rows: list[int],
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Logits at each verified position (a request's last ``k + 1``), then the rejection
        sampler: each request gets its accepted drafts and one more token."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        row_indices: list[int] = []
        row_states: list[Any] = []
        row_req_ids: list[str] = []
        row_offsets: list[int] = []
        drafts_per_request: list[list[int]] = []
        draft_probs: list[torch.Tensor | None] = []
        for i in sampling_rows:
            state = states[i]
            drafts = spec_tokens.get(state.req_id, [])
            end = batch.query_start_loc[i + 1]
            row_indices.extend(range(end - len(drafts) - 1, end))
            for position in range(len(drafts) + 1):
                row_states.append(DraftPrefixState(state.sampling, drafts[:position]) if position else state.sampling)
                row_req_ids.append(state.req_id)
                row_offsets.append(position)
            drafts_per_request.append(drafts)
            probs = state.draft.probs if state.draft is not None and drafts else None
            draft_probs.append(probs[: len(drafts)] if probs is not None else None)
            state.draft = None
        index = torch.tensor(row_indices, device=self.device)
        self._select_lora_logit_rows(index)
        logits = self.model.compute_logits(hidden_states.index_select(0, index)).float()
        grammar_rows, grammar_bitmask = self._grammar_bitmask(
            scheduler_output.structured_output, row_req_ids, row_offsets
        )
        metadata = SamplingMetadata.build(
            row_states, logits.shape[-1], self.device, grammar_rows=grammar_rows, grammar_bitmask=grammar_bitmask
        )
        verified = self.rejection_sampler(logits, metadata, drafts_per_request, draft_probs)
        for position, i in enumerate(sampling_rows):
            state = states[i]
            if position in verified.errors:
                output.errors[state.req_id] = verified.errors[position]
                continue
            token_ids = verified.token_ids[position]
            state.token_ids.extend(token_ids)
            state.sampling.output_token_ids.extend(token_ids)
            output.sampled_token_ids[state.req_id] = token_ids
            token_logprobs = verified.logprobs[position]
            if token_logprobs is not None:
                output.logprobs[state.req_id] = token_logprobs
            state.acceptance.observe(len(drafts_per_request[position]), len(token_ids) - 1)
            # the KV computed this step covers the accepted drafts, not the rejected ones
            num_rejected = len(drafts_per_request[position]) + 1 - len(token_ids)
            batch.seq_lens[i] -= num_rejected

    def _propose(self, states: list[CachedRequestState], output: ModelRunnerOutput) -> None:
        """Ask the proposer for the next step's drafts of the requests that just sampled, each
        for as many as its acceptance so far makes worth verifying (the draft-length policy)."""
        assert self.proposer is not None and self.draft_length_policy is not None  # speculation is on
        requests = [
            DraftRequest(
                state.req_id,
                state.token_ids,
                state.num_prompt_tokens,
                self.draft_length_policy.next_length(state.acceptance),
                block_ids=state.block_ids,
                temperature=0.0 if state.sampling.is_greedy else state.sampling.sampling_params.temperature,
            )
            for state in states
            if state.req_id not in output.errors
        ]
        if not requests:
            return
        drafts = self.proposer.propose(requests)
        for request, draft in zip(requests, drafts, strict=True):
            if draft.token_ids:
                draft.token_ids = list(draft.token_ids[: request.max_draft_tokens])
                self.requests[request.req_id].draft = draft
                output.draft_token_ids[request.req_id] = draft.token_ids
