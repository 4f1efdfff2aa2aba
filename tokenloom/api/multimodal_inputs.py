"""The server's multimodal side: a chat request's image parts (OpenAI ``image_url``, Responses
``input_image``, and vLLM's ``image_embeds``: an image's embeddings, base64 of a
``torch.save``'d tensor, accepted with ``--enable-mm-embeds``) found and replaced by the
internal ``{"type": "image"}`` part the chat template renders as the model's placeholder; the
per-prompt limits (``--limit-mm-per-prompt``); the images fetched and decoded off the event
loop (:mod:`~tokenloom.api.media`); and the model's multimodal processor run on the rendered
prompt (``--mm-processor-kwargs`` updated by the request's ``mm_processor_kwargs``), giving the
prompt the engine takes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
from dataclasses import dataclass
from typing import Any

from tokenloom.api.media import MediaPolicy, load_image
from tokenloom.api.server_config import ServerConfig
from tokenloom.core.multimodal.processor import (
    ImageEmbeddings,
    MultiModalProcessor,
    ProcessorContext,
    worst_case_items,
)
from tokenloom.errors import ConfigError, InvalidRequestError
from tokenloom.plugins.registry import resolve_target

logger = logging.getLogger(__name__)

# content part types that carry an image: by URL, or as its embeddings
IMAGE_PART_TYPES = ("image_url", "input_image", "image_embeds")
# items of a modality one prompt may hold when neither the flag nor the model says (vLLM's default)
DEFAULT_LIMIT_PER_PROMPT = 999


@dataclass(frozen=True)
class ImagePart:
    """One image part of a request: where it is (for errors) and its URL, or for an
    ``image_embeds`` part its base64 embeddings (and no URL)."""

    where: str
    url: str
    embeds: str | None = None


def extract_image_parts(messages: list[Any]) -> tuple[list[Any], list[ImagePart]]:
    """The messages with each image part replaced by ``{"type": "image"}``, and the image parts
    in prompt order. Messages without images come back unchanged (the same objects)."""
    parts: list[ImagePart] = []
    result: list[Any] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image_part(part) for part in content):
            result.append(message)
            continue
        new_content = []
        for part_index, part in enumerate(content):
            if not _is_image_part(part):
                new_content.append(part)
                continue
            where = f"messages[{index}].content[{part_index}]"
            new_content.append({"type": "image"})
            if part["type"] == "image_embeds":
                embeds = part.get("image_embeds")
                if not isinstance(embeds, str):
                    raise InvalidRequestError(
                        f'{where}: an image_embeds part needs "image_embeds": "<base64 of a torch.save\'d tensor>"',
                        param=where,
                    )
                parts.append(ImagePart(where, "", embeds))
                continue
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str):
                raise InvalidRequestError(
                    f'{where}: an {part["type"]} part needs "image_url": {{"url": "data:image/png;base64,..."}}',
                    param=where,
                )
            parts.append(ImagePart(where, url))
        result.append({**message, "content": new_content})
    return result, parts


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


class MultiModalInputs:
    """What one server knows of its model's media: its processor (None: text only), the limits
    per prompt, the processor options and where media may come from."""

    def __init__(self, processor: MultiModalProcessor | None, config: ServerConfig, model_name: str):
        self.processor = processor
        self.model_name = model_name
        self.policy = MediaPolicy(config.allowed_local_media_path, tuple(config.allowed_media_domains or ()))
        self.processor_kwargs = dict(config.mm_processor_kwargs or {})
        self.enable_mm_embeds = config.enable_mm_embeds
        self.limits = self._limits(dict(config.limit_mm_per_prompt or {}))

    @classmethod
    def for_engine(cls, engine: Any, plugins: Any, config: ServerConfig) -> MultiModalInputs:
        """The model's registered processor (``register_models``' ``multimodal_processor=``),
        built and tried once on its worst-case input; text only when it registered none."""
        processor = None
        architectures = getattr(engine.hf_config, "architectures", None) or [""]
        models = plugins.registry("model") if plugins is not None else None
        if models is not None and architectures[0] in models and engine.tokenizer is not None:
            target = models.entry(architectures[0]).options.get("multimodal_processor")
            if target is not None:
                processor_class = resolve_target(target) if isinstance(target, str) else target
                processor = processor_class(
                    ProcessorContext(
                        hf_config=engine.hf_config,
                        model_path=engine.hf_config.name_or_path,
                        tokenizer=engine.tokenizer,
                        processor_kwargs=dict(config.mm_processor_kwargs or {}),
                    )
                )
        inputs = cls(processor, config, engine.served_model_names[0])
        inputs.check_processor()
        return inputs

    @property
    def placeholders(self) -> dict[str, str]:
        return dict(self.processor.placeholders) if self.processor is not None else {}

    def _limits(self, flag_limits: dict[str, Any]) -> dict[str, int]:
        if self.processor is None:
            if flag_limits:
                logger.warning("--limit-mm-per-prompt has no effect: %s takes text only", self.model_name)
            return {}
        model_limits = self.processor.max_items_per_prompt()
        limits = {}
        for modality, model_limit in model_limits.items():
            limit = flag_limits.pop(modality, None)
            if limit is None:
                limit = model_limit if model_limit is not None else DEFAULT_LIMIT_PER_PROMPT
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ConfigError(
                    f"--limit-mm-per-prompt: {modality} must be a whole number of at least 0, got {limit!r}",
                    param="limit-mm-per-prompt",
                )
            if model_limit is not None and limit > model_limit:
                raise ConfigError(
                    f"--limit-mm-per-prompt: {self.model_name} takes at most {model_limit} {modality}(s) per prompt, "
                    f"not {limit}",
                    param="limit-mm-per-prompt",
                )
            limits[modality] = limit
        if flag_limits:
            raise ConfigError(
                f"--limit-mm-per-prompt names {', '.join(sorted(flag_limits))}, which {self.model_name} does not take "
                f"(it takes: {', '.join(model_limits) or 'text only'})",
                param="limit-mm-per-prompt",
            )
        return limits

    def check_processor(self) -> None:
        """Run the processor once on its worst-case input, so bad ``--mm-processor-kwargs`` or a
        missing image-processor file fail the start and not every request."""
        if self.processor is None:
            return
        try:
            worst_case_items(self.processor)
        except InvalidRequestError as exc:
            raise ConfigError(f"the multimodal processor refused its own test input: {exc.message}") from None

    def check_parts(self, parts: list[ImagePart]) -> None:
        """400 for an image to a text-only model, or one past the limit, naming the part."""
        if not parts:
            return
        if self.processor is None or "image" not in self.limits:
            raise InvalidRequestError(
                f"{parts[0].where}: {self.model_name} takes text only; remove the image parts", param=parts[0].where
            )
        for part in parts:
            if part.embeds is None:
                continue
            if not self.enable_mm_embeds:
                raise InvalidRequestError(
                    f"{part.where}: this server takes no image_embeds; start it with --enable-mm-embeds (only for "
                    "trusted clients: the embeddings go straight into the model)",
                    param=part.where,
                )
            if not self.processor.takes_image_embeds:
                raise InvalidRequestError(
                    f"{part.where}: {self.model_name} takes images, not image_embeds", param=part.where
                )
        limit = self.limits["image"]
        if len(parts) > limit:
            where = parts[limit].where
            raise InvalidRequestError(
                f"{where}: at most {limit} image(s) per prompt (--limit-mm-per-prompt), this request has {len(parts)}",
                param=where,
            )

    async def take_images(self, request: Any) -> tuple[Any, list[Any]]:
        """A chat request with its image parts replaced by image parts the template renders
        (checked against the limits), and their images, loaded; the same request and no images
        when it has none."""
        messages, parts = extract_image_parts(request.messages)
        if not parts:
            return request, []
        self.check_parts(parts)
        if request.use_beam_search:
            raise InvalidRequestError("beam search does not take images yet", param="use_beam_search")
        return request.model_copy(update={"messages": messages}), await self.load_images(parts)

    async def load_images(self, parts: list[ImagePart]) -> list[Any]:
        """The parts' images (or :class:`ImageEmbeddings`), fetched and decoded in a worker thread."""
        return await asyncio.to_thread(lambda: [self.load_image(part) for part in parts])

    def load_image(self, part: ImagePart) -> Any:
        if part.embeds is not None:
            return load_image_embeds(part.embeds, part.where)
        return load_image(part.url, part.where, self.policy)

    async def prompt(
        self, prompt_ids: list[int], images: list[Any], request_kwargs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The engine's prompt: the placeholders expanded and the images' items, processed in a
        worker thread."""
        assert self.processor is not None  # check_parts refused images to a text-only model
        if request_kwargs is not None and not isinstance(request_kwargs, dict):
            raise InvalidRequestError("mm_processor_kwargs must be an object", param="mm_processor_kwargs")
        kwargs = {**self.processor_kwargs, **(request_kwargs or {})}
        processed = await asyncio.to_thread(self.processor.process, prompt_ids, images, kwargs)
        return {"prompt_token_ids": processed.prompt_token_ids, "mm_items": processed.items}


def load_image_embeds(encoded: str, where: str) -> ImageEmbeddings:
    """An ``image_embeds`` part's tensor: base64 of ``torch.save(tensor)`` (vLLM's format), read
    without unpickling anything but tensors; a 400 naming the part when it is not one."""
    import torch

    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: image_embeds is not valid base64", param=where) from None
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises whatever its unpickler meets
        raise InvalidRequestError(
            f"{where}: image_embeds is not a torch.save'd tensor ({type(exc).__name__})", param=where
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"{where}: image_embeds holds a {type(tensor).__name__}, not a tensor", param=where)
    return ImageEmbeddings(tensor, where)
