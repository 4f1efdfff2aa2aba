"""What a step gives back, built from the model's hidden states: sampled tokens (with their
grammar masks and the LoRA heads' rows), prompt logprobs, and a pooling request's vector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.sampler import Sampler, compute_prompt_logprobs
from tokenloom.core.sampling_metadata import SamplingMetadata
from tokenloom.core.step_inputs import PreparedBatch

if TYPE_CHECKING:
    from tokenloom.core.model_runner import CachedRequestState


class OutputAssembly:
    """Turns one step's hidden states into its :class:`ModelRunnerOutput`. Mixed into
    :class:`~tokenloom.core.model_runner.ModelRunner`, which sets the attributes."""

    model: Any
    device: Any
    sampler: Sampler
    lora_manager: Any

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        states: list[CachedRequestState],
        sampling_rows: list[int],
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Sample one token for each row whose known tokens are all computed after this step,
        from its last position's logits (with its grammar mask), into the request's state and
        the step's output."""
        last_token_index = torch.tensor([batch.query_start_loc[i + 1] - 1 for i in sampling_rows], device=self.device)
        self._select_lora_logit_rows(last_token_index)
        logits = self.model.compute_logits(hidden_states.index_select(0, last_token_index)).float()
        sampling_states = [states[i].sampling for i in sampling_rows]
        grammar_rows, grammar_bitmask = self._grammar_bitmask(
            scheduler_output.structured_output, [states[i].req_id for i in sampling_rows], None
        )
        metadata = SamplingMetadata.build(
            sampling_states,
            logits.shape[-1],
            self.device,
            grammar_rows=grammar_rows,
            grammar_bitmask=grammar_bitmask,
        )
        sampled = self.sampler(logits, metadata)
        for row, i in enumerate(sampling_rows):
            state = states[i]
            if row in sampled.errors:
                output.errors[state.req_id] = sampled.errors[row]
                continue
            token_id = sampled.token_ids[row]
            state.token_ids.append(token_id)
            state.sampling.output_token_ids.append(token_id)
            output.sampled_token_ids[state.req_id] = [token_id]
            token_logprobs = sampled.logprobs[row]
            if token_logprobs is not None:
                output.logprobs[state.req_id] = [token_logprobs]

    def _select_lora_logit_rows(self, token_index: torch.Tensor) -> None:
        """Before ``compute_logits`` of these tokens' hidden states: an adapter's LM head
        applies to the rows of its own requests only."""
        if self.lora_manager is not None:
            self.lora_manager.select_logit_rows(token_index)

    def _grammar_bitmask(
        self, masks: Any, req_ids: list[str], offsets: list[int] | None
    ) -> tuple[list[int] | None, torch.Tensor | None]:
        """The sampling rows a structured-output mask applies to, and their mask rows in order.
        A request verifying drafts has consecutive mask rows; ``offsets[row]`` is the sampling
        row's position among its request's (None: all 0)."""
        if masks is None:
            return None, None
        mask_row: dict[str, int] = {}
        for row, req_id in enumerate(masks.req_ids):
            mask_row.setdefault(req_id, row)
        rows = [row for row, req_id in enumerate(req_ids) if req_id in mask_row]
        if not rows:
            return None, None
        order = torch.tensor(
            [mask_row[req_ids[row]] + (offsets[row] if offsets else 0) for row in rows], dtype=torch.long
        )
        return rows, torch.from_numpy(masks.bitmask).index_select(0, order).to(self.device)

    def _prompt_logprobs(
        self,
        state: CachedRequestState,
        row: int,
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Logprobs of the prompt tokens computed this step (each predicted by the one before)."""
        num_logprobs = state.prompt_logprobs
        if num_logprobs is None:
            return
        start = state.num_computed_tokens
        end = min(batch.seq_lens[row], state.num_prompt_tokens - 1)  # positions that predict a prompt token
        if end <= start:
            return
        first = batch.query_start_loc[row]
        rows = torch.arange(first, first + (end - start), device=self.device)
        self._select_lora_logit_rows(rows)
        logits = self.model.compute_logits(hidden_states.index_select(0, rows)).float()
        targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
        output.prompt_logprobs[state.req_id] = compute_prompt_logprobs(logits, targets, num_logprobs)

    def _pool(
        self,
        states: list[CachedRequestState],
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Pool each request's prompt, which the scheduler schedules whole (never chunked)."""
        query_lens = batch.attn_metadata.query_lens_cpu
        for i, state in enumerate(states):
            state.num_computed_tokens = batch.seq_lens[i]
            if query_lens[i] != state.num_prompt_tokens:
                output.errors[state.req_id] = (
                    f"a pooling prompt must run whole in one step, but {query_lens[i]} "
                    f"of its {state.num_prompt_tokens} tokens were scheduled"
                )
        rows = [i for i, state in enumerate(states) if state.req_id not in output.errors]
        if not rows:
            return
        if len(rows) < len(states):
            hidden_states = torch.cat(
                [hidden_states[batch.query_start_loc[i] : batch.query_start_loc[i + 1]] for i in rows]
            )
        pooled = self.model.pooler(
            hidden_states, [query_lens[i] for i in rows], [states[i].pooling_params for i in rows]
        )
        for i, vector in zip(rows, pooled):
            output.pooled[states[i].req_id] = vector
