"""The model runner's forward pass and what crosses a pipeline-stage boundary: the hidden
states and residual a stage sends to the next (one ``[2, tokens, hidden]`` tensor) and the
zeros a profile run feeds a later stage."""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.core.batch import AttentionMetadata
from tokenloom.core.model_interface import IntermediateTensors


class PipelineStageIO:
    """Runs the model for one step; sends and receives a stage's intermediate tensors.
    Mixed into :class:`~tokenloom.core.model_runner.ModelRunner`, which sets the attributes."""

    model: Any
    parallel: Any
    dtype: torch.dtype | None
    device: Any

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Any:
        if inputs_embeds is not None:  # a multimodal model's step that computes image placeholders
            return self.model(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)
        if self.parallel.place.pp_size == 1:
            return self.model(input_ids, positions, attn_metadata)  # models that know no stages
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors=intermediate)

    def _intermediate_shape(self, num_tokens: int) -> tuple[int, int, int]:
        # hidden states and residual travel as one [2, num_tokens, hidden_size] tensor: one
        # message per stage boundary instead of two
        return (2, num_tokens, self.model.config.hidden_size)

    def _activation_dtype(self) -> torch.dtype:
        if self.dtype is None:
            raise RuntimeError("a pipeline stage's activations follow the model's dtype: load the model first")
        return self.dtype

    def _zero_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        shape = self._intermediate_shape(num_tokens)
        both = torch.zeros(shape, dtype=self._activation_dtype(), device=self.device)
        return IntermediateTensors(both[0], both[1])

    def _send_intermediate_tensors(self, intermediate: IntermediateTensors) -> None:
        both = torch.stack([intermediate.hidden_states, intermediate.residual]).cpu()
        self.parallel.pp.send(both, dst=self.parallel.place.pp_rank + 1)

    def _recv_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        place = self.parallel.place
        shape = self._intermediate_shape(num_tokens)
        both = self.parallel.pp.recv(shape, self._activation_dtype(), src=place.pp_rank - 1)
        both = both.to(self.device)
        return IntermediateTensors(both[0], both[1])
