"""Pydantic models of the routes the server answers without running the model (OpenAI's model
list; vLLM's /tokenize, /detokenize and runtime LoRA adapter loading and unloading) and of the
error body every route may answer with.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenloom.api.protocol import RequestModel, ResponseModel, unix_now

# -- requests --------------------------------------------------------------------------


class TokenizeRequest(RequestModel):
    """POST /tokenize: either ``prompt`` (completions style) or ``messages`` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter`` (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None


# -- responses -------------------------------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "tokenloom"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
