"""Disaggregated prefill through the SharedStorageConnector: a proxy in front of two tokenloom
servers that share a KV store directory.

    DIR=/var/cache/tokenloom-kv
    tokenloom serve smollm2 --port 8100 \\
        --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": "'$DIR'"}}'
    tokenloom serve smollm2 --port 8200 \\
        --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
                               "kv_connector_extra_config": {"shared_storage_path": "'$DIR'"}}'
    python examples/disaggregated_prefill_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Each completion or chat request goes first to the prefill server with ``max_tokens`` 1 (it
computes the prompt and stores its full blocks), then unchanged to the decode server, which
loads those blocks, computes only the prompt's tail and generates (streamed when asked). Any
other route goes to the decode server. Errors of either server come back as they were.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def build_app(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    app = FastAPI(title="tokenloom disaggregated-prefill proxy")
    client = httpx.AsyncClient(timeout=timeout)  # one for the proxy's life

    async def generate(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        headers = {key: value for key, value in request.headers.items() if key.lower() == "authorization"}
        prefill_body = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
        prefill_body["max_tokens"] = 1
        prefill_body.pop("max_completion_tokens", None)
        prefill = await client.post(prefill_url + request.url.path, json=prefill_body, headers=headers)
        if prefill.status_code != 200:
            return Response(prefill.content, prefill.status_code, media_type=prefill.headers.get("content-type"))
        if not body.get("stream"):
            decode = await client.post(decode_url + request.url.path, json=body, headers=headers)
            return Response(decode.content, decode.status_code, media_type=decode.headers.get("content-type"))
        upstream = await client.send(
            client.build_request("POST", decode_url + request.url.path, json=body, headers=headers), stream=True
        )
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), media_type=upstream.headers.get("content-type"))

    for route in GENERATION_ROUTES:
        app.add_api_route(route, generate, methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def to_decode(path: str, request: Request) -> Response:
        upstream = await client.request(
            request.method,
            f"{decode_url}/{path}",
            content=await request.body(),
            headers={"content-type": "application/json"},
        )
        if upstream.headers.get("content-type", "").startswith("application/json"):
            return JSONResponse(upstream.json(), upstream.status_code)
        return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the kv_producer server")
    parser.add_argument("--decode", required=True, help="base URL of the kv_consumer server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
