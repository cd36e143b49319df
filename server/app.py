"""HTTP routes: thin. Each one checks nothing itself, calls `OpenAIServing`, and returns JSON or an
SSE stream; errors from anywhere go through `errors.error_for`. Auth, compact request logging and
the per-route request counter are one ASGI middleware, which (unlike BaseHTTPMiddleware) leaves
streaming and disconnect detection alone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.engine_loop import EngineLoop

from . import errors, tokenization
from .anthropic import AnthropicServing, MessagesRequest
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing
from .tokenization import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("layerstream.server")

_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
           "/detokenize", "/v1/messages"}
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in logs and metrics only


class ClientDisconnected(Exception):
    pass


class _Gate:
    """ASGI middleware: API key check on /v1, one log line and one counter per request."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get(b"x-api-key", b"").decode("latin-1")  # how Anthropic's clients send it
        return bool(token) and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        t0 = time.perf_counter()
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and path.startswith("/v1") and not self._authorized(scope):
                msg = "missing or invalid API key: send 'Authorization: Bearer <key>'"
                await errors.error_for(errors.AuthError(msg)).response_for(path)(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            code = status[0]
            self.metrics.count_request(path if path in _ROUTES else "other", code)
            if path not in ("/health", "/metrics") or code >= 400:
                log.info("%s %s %d %.3fs", scope["method"], path, code, time.perf_counter() - t0)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, coro):
    """Run coro (a whole non-streamed generation) but cancel it, which aborts its engine requests,
    if the client goes away first."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    raise ClientDisconnected()


def build_app(engine: EngineLoop, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or ServerMetrics(served_model_name)
    serving = OpenAIServing(engine, served_model_name)
    anthropic = AnthropicServing(serving)
    app = FastAPI(title="layerstream", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    app.add_middleware(_Gate, api_key=api_key, metrics=metrics)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    def respond(result):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(result.model_dump(mode="json"))

    @app.get("/health")
    async def health():
        if engine.ready:
            return {"status": "ok"}
        detail = "loading" if engine.state == "loading" else f"{engine.state}: {engine.reason}"
        return JSONResponse({"status": detail}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(serving.models().model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return JSONResponse(serving.model(model_id).model_dump(mode="json"))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return JSONResponse(tokenization.tokenize(serving, body).model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return JSONResponse(tokenization.detokenize(serving, body).model_dump(mode="json"))

    async def generate(request: Request, work):
        try:
            return respond(await _unless_disconnected(request, work))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await generate(request, serving.chat(body))

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await generate(request, anthropic.messages(body))

    return app
