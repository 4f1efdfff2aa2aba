"""The offline API, shaped like vLLM's: ``LLM(model=..., **engine_args).generate(prompts,
sampling_params)`` returning one :class:`RequestOutput` per prompt, in order."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import LLMEngine
from tokenloom.core.request import RequestOutput, RequestOutputKind, SamplingParams
from tokenloom.plugins.manager import load_plugins


class LLM:
    """An engine for batch generation in this process.

    :param model: a model tag (path, .gguf file, Hugging Face repo id, packaged model name).
    :param plugins: extra plugin modules to load (like ``--plugin``).
    :param engine_args: engine arguments by their vLLM names (``max_model_len``,
        ``num_gpu_blocks_override``, ``max_num_batched_tokens``, ``enable_prefix_caching``...).
    """

    def __init__(self, model: str = "smollm2", *, plugins: Sequence[str] = (), **engine_args: Any):
        self.plugins = load_plugins(modules=plugins)
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args), self.plugins)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or ``{"prompt_token_ids": [...]}``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        request_ids = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            self.engine.add_request(request_id, prompt, params, priority=priority[index] if priority else 0)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the chat template and generate."""
        from tokenloom.api.chat_template import ChatRenderer

        renderer = ChatRenderer(self.engine.tokenizer)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            prompt_text = renderer.render(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt_token_ids": self.engine.tokenizer.encode(prompt_text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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
