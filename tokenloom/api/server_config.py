"""``ServerConfig``: the options of the HTTP front end (vLLM's frontend flags), separate from
the engine's. Attribute docstrings are the CLI help texts. Importing this is cheap (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    """Host name or address to listen on."""
    port: int = 8000
    """Port to listen on."""
    uvicorn_log_level: str = "info"
    """Log level of uvicorn: critical, error, warning, info, debug, trace."""
    disable_uvicorn_access_log: bool = False
    """Do not write uvicorn's access log (one line per HTTP request)."""
    api_key: list[str] | None = None
    """API key(s) clients must present as ``Authorization: Bearer KEY`` (also TOKENLOOM_API_KEY).
    Every route needs it except /health, /ping, /version (and /metrics unless
    --metrics-require-key)."""
    metrics_require_key: bool = False
    """Require the API key on /metrics too."""
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    """CORS allowed origins."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    """CORS allowed methods."""
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    """CORS allowed headers."""
    allow_credentials: bool = False
    """CORS: allow credentials."""
    middleware: list[str] = field(default_factory=list)
    """Import paths of extra ASGI middleware: a function becomes ``@app.middleware("http")``, a
    class is added with ``app.add_middleware``; added after tokenloom's own."""
    root_path: str | None = None
    """FastAPI root_path when behind a path-based proxy."""
    ssl_keyfile: str | None = None
    """The TLS key file."""
    ssl_certfile: str | None = None
    """The TLS certificate file."""
    ssl_ca_certs: str | None = None
    """The CA certificates file."""
    ssl_cert_reqs: int = 0
    """Whether a client certificate is required (see Python's ssl module)."""
    disable_fastapi_docs: bool = False
    """Disable FastAPI's /docs, /redoc and /openapi.json."""
    enable_request_id_headers: bool = False
    """Add an X-Request-Id header to responses."""
    return_tokens_as_token_ids: bool = False
    """Represent tokens in logprobs as ``token_id:N`` strings."""
    max_log_len: int | None = None
    """Maximum prompt characters (and prompt token ids) printed per request when
    --enable-log-requests logs requests; unlimited by default."""
    enable_log_requests: bool = False
    """Log each request's prompt, prompt token ids and sampling parameters at INFO (off by
    default, as in vLLM: prompts in server logs are private data)."""
    disable_log_stats: bool = False
    """Do not log the periodic engine stats line."""
    headless: bool = False
    """Run this node's share of a head node's engines without an API server: its data-parallel
    replicas (--data-parallel-size-local of them, ranks from --data-parallel-start-rank), which
    connect to the head's --data-parallel-address and --data-parallel-rpc-port; or, with
    --nnodes and --node-rank, its workers of node 0's engine, which connect to --master-addr.
    Every node needs the same TOKENLOOM_NODE_AUTHKEY secret."""
    otlp_traces_endpoint: str | None = None
    """The OpenTelemetry collector to send a trace span per request to (OTLP over gRPC, or
    HTTP/protobuf with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); needs the ``otel``
    extra. A request's W3C ``traceparent`` header makes its span a child of the caller's."""
    collect_detailed_traces: list[str] | None = None
    """Modules to trace in detail (model, worker, all; needs --otlp-traces-endpoint). As in
    vLLM's V1 engine, the request span already carries the queue, prefill, decode and inference
    times; no per-module spans are added."""
    chat_template: str | None = None
    """A chat template file path or the template itself; overrides the model's."""
    chat_template_content_format: str = "auto"
    """How message content is given to the template: auto, string or openai."""
    trust_request_chat_template: bool = False
    """Accept a chat template sent in a request (``chat_template`` in chat and /tokenize);
    off by default, since a template is code the server runs. Every template renders under a
    time and size limit either way."""
    response_role: str = "assistant"
    """The role of generated chat messages when add_generation_prompt is true."""
    enable_auto_tool_choice: bool = False
    """Let the model choose to call tools (needs --tool-call-parser)."""
    tool_call_parser: str | None = None
    """The tool-call parser plugin that turns model output into tool calls."""
    tool_parser_plugin: list[str] = field(default_factory=list)
    """.py files that define and register tool parsers."""
    plugins: list[str] = field(default_factory=list)
    """Importable modules to load as tokenloom plugins (besides the installed entry points)."""
    strict_plugins: bool = False
    """Refuse to start when an installed plugin fails to load (named plugins always do)."""
    enable_prompt_tokens_details: bool = False
    """Report cached prompt tokens in usage.prompt_tokens_details."""
    enable_server_load_tracking: bool = False
    """Count the requests in flight on the generation and pooling routes; GET /load answers
    ``{"server_load": N}`` (vLLM's route: a load balancer's view of this server)."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    """Largest accepted request body; larger ones get 413."""
    responses_store_max_bytes: int = 128 * 1024 * 1024
    """Bytes the Responses API's in-memory store of responses (``store: true``, the default)
    may hold, each counted as its response and conversation in JSON; the least recently used
    are dropped beyond it (and beyond TOKENLOOM_RESPONSES_STORE_SIZE entries, 1000). A response
    larger than all of it is not stored (it says ``"store": false``). 0 stores nothing."""
    limit_mm_per_prompt: dict[str, Any] | None = None
    """The most media items one prompt may hold, per modality, as JSON (``'{"image": 2}'``);
    a model that sees states its own maximum, and 999 applies where neither says."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Options for the model's multimodal processor (its image processor's arguments, e.g.
    ``'{"do_center_crop": false}'``); a request's ``mm_processor_kwargs`` update them."""
    enable_mm_embeds: bool = False
    """Accept ``image_embeds`` content parts: an image's embeddings (base64 of a
    ``torch.save``'d tensor, ``[feature tokens, hidden size]``) in place of the image, skipping
    the vision encoder. For trusted clients only."""
    allowed_local_media_path: str = ""
    """A directory requests may read images from as ``file://`` URLs (none by default)."""
    allowed_media_domains: list[str] | None = None
    """Host names requests may fetch ``http(s)://`` images from; without it, images come as
    ``data:`` URLs (or files) only. Fetches are limited to 20 MiB and 10 seconds."""
    lora_modules: list[str] = field(default_factory=list)
    """LoRA adapters to serve (needs --enable-lora), each ``name=path`` or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}``; the path is a folder, a packaged
    adapter or a Hub id (resolved like a model). Requests pick one by its name as ``model``."""
