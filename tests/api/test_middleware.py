"""Serving options on the request path: API keys and public routes, CORS, request ids,
body size limits and ``--middleware`` import paths."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.api.conftest import client_for
from tokenloom.errors import ConfigError

pytestmark = pytest.mark.anyio

KEY = "sk-test-123"
COMPLETION = {"prompt": "Hi", "max_tokens": 1}


async def test_api_key_is_required_except_on_public_routes(make_app):
    async with client_for(make_app(api_key=[KEY, "other-key"])) as http_client:
        missing = await http_client.post("/v1/completions", json=COMPLETION)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "AuthenticationError"
        wrong = await http_client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        for key in (KEY, "other-key"):
            ok = await http_client.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert (await http_client.get(path)).status_code == 200, path
        assert (await http_client.post("/ping")).status_code == 200
        for path in ("/tokenize", "/detokenize"):
            assert (await http_client.post(path, json={})).status_code == 401
        # unknown routes do not reveal themselves without a key
        assert (await http_client.get("/nope")).status_code == 401


async def test_metrics_can_require_the_key(make_app):
    async with client_for(make_app(api_key=[KEY], metrics_require_key=True)) as http_client:
        assert (await http_client.get("/metrics")).status_code == 401
        assert (await http_client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
        assert (await http_client.get("/health")).status_code == 200


async def test_api_key_from_the_environment(make_app, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_API_KEY", "env-key")
    async with client_for(make_app()) as http_client:
        assert (await http_client.get("/v1/models")).status_code == 401
        assert (await http_client.get("/v1/models", headers={"Authorization": "Bearer env-key"})).status_code == 200


@pytest.mark.parametrize("given", [[""], ["  "], ["", ""]])
async def test_an_empty_api_key_is_no_key_and_says_so(make_app, caplog, given):
    # issue 37: `--api-key "$UNSET"` made "" a key, so "Authorization: Bearer" with nothing
    # after it got in, and the server said nothing about running without a key
    with caplog.at_level("WARNING", logger="tokenloom.api"):
        app = make_app(api_key=given)
    messages = [record.getMessage() for record in caplog.records]
    assert any("empty key" in message and "WITHOUT an API key" in message for message in messages), messages
    assert any("CORS origin" in message for message in messages)
    async with client_for(app) as http_client:
        # no key is in force: the route answers as on a server started without --api-key
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer "}):
            assert (await http_client.get("/v1/models", headers=headers)).status_code == 200


async def test_an_empty_api_key_beside_real_ones_is_dropped(make_app, monkeypatch):
    async with client_for(make_app(api_key=["", KEY])) as http_client:
        assert (await http_client.get("/v1/models", headers={"Authorization": "Bearer"})).status_code == 401
        assert (await http_client.get("/v1/models", headers={"x-api-key": ""})).status_code == 401
        ok = await http_client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
    # an empty --api-key is absent, so TOKENLOOM_API_KEY applies
    monkeypatch.setenv("TOKENLOOM_API_KEY", "env-key")
    async with client_for(make_app(api_key=[""])) as http_client:
        assert (await http_client.get("/v1/models", headers={"Authorization": "Bearer"})).status_code == 401
        assert (await http_client.get("/v1/models", headers={"Authorization": "Bearer env-key"})).status_code == 200


async def test_cors_headers_and_preflight(make_app):
    app = make_app(api_key=[KEY], allowed_origins=["https://ui.example"])
    async with client_for(app) as http_client:
        preflight = await http_client.options(
            "/v1/completions",
            headers={
                "Origin": "https://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
        unauthorized = await http_client.post(
            "/v1/completions", json=COMPLETION, headers={"Origin": "https://ui.example"}
        )
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == "https://ui.example"
        other = await http_client.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


async def test_request_id_headers(make_app, engine):
    async with client_for(make_app(enable_request_id_headers=True)) as http_client:
        echoed = await http_client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "client-7"})
        assert echoed.headers["x-request-id"] == "client-7"
        assert engine.requests[-1].request_id == "cmpl-client-7"
        generated = await http_client.get("/health")
        assert len(generated.headers["x-request-id"]) == 32
        error = await http_client.get("/missing")
        assert error.headers["x-request-id"]
    async with client_for(make_app()) as http_client:
        plain = await http_client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "client-8"})
        assert "x-request-id" not in plain.headers
        assert plain.json()["id"] == "cmpl-client-8"


async def test_body_too_large_by_content_length(make_app):
    async with client_for(make_app(max_request_body_bytes=200)) as http_client:
        response = await http_client.post("/v1/completions", json={"prompt": "x" * 500})
        assert response.status_code == 413
        assert "200" in response.json()["error"]["message"]
        assert (await http_client.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_body_too_large_when_streamed_without_length(make_app):
    async def chunks():
        for _ in range(10):
            yield b"x" * 50

    async with client_for(make_app(max_request_body_bytes=200)) as http_client:
        response = await http_client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 413


async def test_small_streamed_body_is_replayed_to_the_app(make_app):
    async def chunks():
        yield b'{"prompt": "Hi",'
        yield b' "max_tokens": 1}'

    async with client_for(make_app(max_request_body_bytes=200)) as http_client:
        response = await http_client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 200, response.text


@pytest.fixture
def middleware_module(tmp_path, monkeypatch):
    (tmp_path / "my_middleware.py").write_text(
        textwrap.dedent("""
        async def add_header(request, call_next):
            response = await call_next(request)
            response.headers["X-From-Function"] = "yes"
            return response


        class AddHeader:
            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                async def send_with_header(message):
                    if message["type"] == "http.response.start":
                        message.setdefault("headers", []).append((b"x-from-class", b"yes"))
                    await send(message)
                await self.app(scope, receive, send_with_header)


        not_middleware = 42
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_middleware"
    sys.modules.pop("my_middleware", None)


async def test_custom_middleware_function_and_class(make_app, middleware_module):
    app = make_app(middleware=[f"{middleware_module}.add_header", f"{middleware_module}:AddHeader"], api_key=[KEY])
    async with client_for(app) as http_client:
        response = await http_client.post(
            "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert response.status_code == 200
        assert response.headers["x-from-function"] == "yes" and response.headers["x-from-class"] == "yes"
        # outermost: they see our 401s too
        assert (await http_client.get("/v1/models")).headers["x-from-class"] == "yes"


@pytest.mark.parametrize(
    "path, words",
    [
        ("no_such_module_xyz.thing", "cannot import"),
        ("my_middleware.missing", "no attribute"),
        ("my_middleware.not_middleware", "expected an ASGI middleware"),
        ("nodots", "import path"),
    ],
)
def test_bad_middleware_path_is_a_start_up_error_naming_it(make_app, middleware_module, path, words):
    with pytest.raises(ConfigError, match=words) as info:
        make_app(middleware=[path])
    assert path in str(info.value)


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ({}, True),  # no key, every origin: vLLM's defaults
        ({"api_key": [KEY]}, False),
        ({"allowed_origins": ["https://app.example"]}, False),
    ],
)
async def test_start_up_warns_when_any_origin_can_use_a_server_without_a_key(make_app, caplog, options, warned):
    with caplog.at_level("WARNING", logger="tokenloom.api"):
        make_app(**options)
    messages = [record.getMessage() for record in caplog.records if "CORS origin" in record.getMessage()]
    assert bool(messages) == warned
    if warned:
        assert "--api-key" in messages[0] and "--allowed-origins" in messages[0]


@pytest.mark.parametrize(
    ("keyed", "headers", "expected"),
    [
        (True, [(b"authorization", b"Bearer sk-a")], "key:"),
        (True, [(b"x-api-key", b"sk-a")], "key:"),
        # without --api-key a made-up key names nobody: the peer address does
        (False, [(b"authorization", b"Bearer anything")], "peer:10.1.2.3"),
        (True, [], "peer:10.1.2.3"),
    ],
)
async def test_client_middleware_names_the_client_for_the_request(keyed, headers, expected):
    import hashlib

    from tokenloom.api.middleware import ClientMiddleware
    from tokenloom.core.structured_output_compile import REQUEST_CLIENT

    seen = []

    async def app(scope, receive, send):
        seen.append(REQUEST_CLIENT.get())

    scope = {"type": "http", "path": "/v1/completions", "headers": headers, "client": ("10.1.2.3", 5000)}
    await ClientMiddleware(app, keyed=keyed)(scope, None, None)
    if expected == "key:":
        assert seen == ["key:" + hashlib.sha256(b"sk-a").hexdigest()[:16]]
    else:
        assert seen == [expected]
    assert REQUEST_CLIENT.get() is None  # reset after the request
