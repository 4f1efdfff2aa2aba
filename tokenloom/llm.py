"""The offline API, shaped like vLLM's: ``LLM(model=..., **engine_args).generate(prompts,
sampling_params)`` returning one :class:`RequestOutput` per prompt, in order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import LLMEngine
from tokenloom.core.outputs import EmbeddingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput
from tokenloom.core.pooling import cosine_similarity, score_inputs
from tokenloom.core.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from tokenloom.errors import TokenloomError
from tokenloom.plugins.manager import load_plugins

if TYPE_CHECKING:
    from tokenloom.core.beam_search import BeamSearchOutput, BeamSearchParams


class LLM:
    """An engine for batch generation in this process.

    :param model: a model tag (path, .gguf file, Hugging Face repo id, packaged model name).
    :param plugins: extra plugin modules to load (like ``--plugin``).
    :param engine_args: engine arguments by their vLLM names (``max_model_len``,
        ``num_gpu_blocks_override``, ``max_num_batched_tokens``, ``enable_prefix_caching``...).
    """

    def __init__(self, model: str = "smollm2", *, plugins: Sequence[str] = (), **engine_args: Any):
        self.plugins = load_plugins(modules=plugins)
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **engine_args), self.plugins)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling parameters ``generate`` uses when given none, with the
        request defaults of the model's generation config (``generation_config``,
        ``override_generation_config``)."""
        return SamplingParams(**self.engine.model_info.generation_defaults)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or ``{"prompt_token_ids": [...]}``).

        ``lora_request``: a :class:`~tokenloom.lora.request.LoRARequest` for every prompt, or a
        list with one (or None for the base model) per prompt; needs ``enable_lora=True``."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        lora_requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(lora_requests) != len(prompts):
            raise ValueError(f"got {len(lora_requests)} LoRA requests for {len(prompts)} prompts")
        # every adapter is checked before any prompt is queued, so a bad one leaves nothing behind
        lora_requests = [self.engine.resolve_lora(request) for request in lora_requests]
        request_ids = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            self.engine.add_request(
                request_id,
                prompt,
                params,
                priority=priority[index] if priority else 0,
                lora_request=lora_requests[index],
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = False,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template and generate (with ``lora_request``'s
        adapter, as :meth:`generate`)."""
        from tokenloom.chat_template import ChatRenderer

        renderer = ChatRenderer(self.engine.tokenizer)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            prompt_text = renderer.render(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt_token_ids": self.engine.tokenizer.encode(prompt_text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt (pooling models: ``--runner pooling``); ``outputs.data`` is a tensor."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = params.clone(truncate_prompt_tokens=truncate_prompt_tokens)
        # every prompt is checked before any is queued, so a bad one leaves nothing behind
        prepared_prompts = [self.engine.prepare_pooling_prompt(prompt, params) for prompt in prompts]
        request_ids = []
        for prepared in prepared_prompts:
            request_id = str(next(self._request_counter))
            self.engine.add_pooling_request(request_id, None, params, prepared=prepared)
            request_ids.append(request_id)
        outputs = self._run(request_ids, use_tqdm)
        failed = next((output for output in outputs if output.error), None)
        if failed is not None:
            raise TokenloomError(f"pooling request {failed.request_id} failed: {failed.error}")
        return outputs

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput]:
        """Embed each prompt: ``outputs[i].outputs.embedding`` is a list of floats, as in vLLM."""
        results = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        for result in results:
            result.outputs = EmbeddingOutput(embedding=result.outputs.data.tolist())
        return results

    def score(
        self, text_1: Any, text_2: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
    ) -> list[PoolingRequestOutput]:
        """Cosine similarity of embeddings: one ``text_1`` against each ``text_2``, or two
        lists pair by pair; ``outputs[i].outputs.score`` is a float, as in vLLM."""
        first, second, pairs = score_inputs(text_1, text_2)
        embedded = self.encode(first + second, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
        first_vectors, second_vectors = embedded[: len(first)], embedded[len(first) :]
        results = []
        for first_index, second_index in pairs:
            first_output, second_output = first_vectors[first_index], second_vectors[second_index]
            results.append(
                PoolingRequestOutput(
                    request_id=f"{first_output.request_id}-{second_output.request_id}",
                    outputs=ScoringOutput(
                        score=cosine_similarity(first_output.outputs.data, second_output.outputs.data)
                    ),
                    prompt_token_ids=first_output.prompt_token_ids + second_output.prompt_token_ids,
                    finished=True,
                )
            )
        return results

    def beam_search(self, prompts: Any, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` most likely continuations of each
        prompt (text, token ids, or ``{"prompt_token_ids": [...]}``), best first."""
        from tokenloom.core.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        probe = SamplingParams(max_tokens=1)
        prompts_token_ids = [self.engine.prepare_prompt(prompt, probe).prompt_token_ids for prompt in prompts]
        tokenizer = self.engine.tokenizer
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None
        return beam_search(
            lambda token_ids, step_params: self.generate([{"prompt_token_ids": ids} for ids in token_ids], step_params),
            prompts_token_ids,
            params,
            set(self.engine.model_info.eos_token_ids),
            decode,
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts")
        try:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                if pending and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)} vanished from the engine")
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]
