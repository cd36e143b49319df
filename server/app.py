"""HTTP routes: thin. Each one checks nothing itself, calls `OpenAIServing`, and returns JSON or an
SSE stream; errors from anywhere go through `errors.error_for`. Auth, the body size limit, compact
request logging and the per-route request counter are one ASGI middleware, which (unlike
BaseHTTPMiddleware) leaves streaming and disconnect detection alone. /openapi.json describes what
is sent: errors in OpenAI's shape with 400 (never FastAPI's 422) for invalid requests.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.engine_loop import EngineLoop

from . import errors, tokenization
from .anthropic import AnthropicServing, MessagesRequest
from .limits import RequestLimits
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, LoadLoRAAdapterRequest, ModelList, UnloadLoRAAdapterRequest)
from .serving import OpenAIServing
from .tokenization import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("layerstream.server")

_ROUTES = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
           "/detokenize", "/v1/messages", "/openapi.json", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in logs and metrics only


class ClientDisconnected(Exception):
    pass


def check_api_key(key: str) -> None:
    """A key clients can send: HTTP header values are ASCII in practice (httpx and the openai
    client refuse anything else), so a non-ASCII key could never match; refuse it at start-up."""
    if not key or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError("--api-key must be non-empty printable ASCII without spaces")


class _Gate:
    """ASGI middleware: API key check on /v1, the body size limit, one log line and one counter per
    request. body_limit() is asked per request: it follows the model's context once loaded."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, body_limit=lambda: None):
        if api_key:
            check_api_key(api_key)
        self.app, self.metrics, self.body_limit = app, metrics, body_limit
        self.api_key = api_key.encode("ascii") if api_key else None

    def _auth_error(self, scope, path: str) -> errors.APIError | None:
        headers = scope.get("headers") or []
        values = [v for k, v in headers if k == b"authorization"]
        keys = [v for k, v in headers if k == b"x-api-key"]  # how Anthropic's clients send it
        if len(values) > 1 or len(keys) > 1:
            # Proxies and frameworks disagree on which of two wins; refusing is the only answer
            # that cannot be read differently by the proxy in front and by us.
            return errors.APIError(400, "send one Authorization (or x-api-key) header, not several", param=None)
        scheme, _, token = (values[0] if values else b"").partition(b" ")
        if scheme.lower() != b"bearer":
            token = keys[0] if keys else b""
        if token.strip() and hmac.compare_digest(token.strip(), self.api_key):
            return None
        if path == "/v1/messages":  # Anthropic's clients send the key in x-api-key
            return errors.AuthError("missing or invalid API key: send 'x-api-key: <key>' "
                                    "(or 'Authorization: Bearer <key>')")
        return errors.AuthError("missing or invalid API key: send 'Authorization: Bearer <key>'")

    def _limited(self, scope, receive):
        """receive, failing with 413 once the body passes the limit (for a body sent without a
        Content-Length, or one longer than it said)."""
        limit = self.body_limit()
        seen = [0]

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if limit is not None and seen[0] > limit:
                    raise StarletteHTTPException(413, f"request body larger than {limit} bytes (--max-body-bytes)",
                                                 headers={"Connection": "close"})
            return message

        return limit, limited_receive

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
            refusal = None
            if self.api_key and path.startswith("/v1"):
                refusal = self._auth_error(scope, path)
            limit, receive = self._limited(scope, receive)
            declared = dict(scope.get("headers") or []).get(b"content-length")
            if refusal is None and limit is not None and declared and declared.isdigit() and int(declared) > limit:
                # Refused from the header alone: the body is never read.
                # Connection: close, or the unread body would be read as the next request.
                refusal = StarletteHTTPException(413, f"request body of {int(declared)} bytes is larger than the "
                                                      f"limit of {limit} bytes (--max-body-bytes)",
                                                 headers={"Connection": "close"})
            if refusal is not None:
                await errors.error_for(refusal).response_for(path)(scope, receive, send_status)
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
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # The route itself was cancelled from outside (a server or proxy may cancel the handler of a
        # client that went away rather than deliver http.disconnect): the generation must not run on.
        work.cancel()
        watch.cancel()
        raise
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    raise ClientDisconnected()


# What the generation routes may answer besides 200; every error body is OpenAI's ErrorResponse.
_ERRORS = {400: "invalid request (param names the field)", 401: "missing or invalid API key",
           404: "unknown model", 413: "request body too large", 500: "internal error (message has an error id)",
           503: "loading, overloaded (Retry-After), or not ready"}


def _generation_responses(model) -> dict:
    return {200: {"model": model, "description": "the result, or with stream: true server-sent events",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **{code: {"model": ErrorResponse, "description": why} for code, why in _ERRORS.items()}}


def _openapi_without_422(app: FastAPI):
    """FastAPI documents 422 + HTTPValidationError for every body; this server answers 400 with
    ErrorResponse instead (errors.install), so the schema says that."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi


def build_app(engine: EngineLoop, served_model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None, limits: RequestLimits | None = None,
              tool_call_parser: str = "auto") -> FastAPI:
    metrics = metrics or ServerMetrics(served_model_name)
    serving = OpenAIServing(engine, served_model_name, limits, tool_call_parser)
    anthropic = AnthropicServing(serving)
    app = FastAPI(title="layerstream", version="0.1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = _openapi_without_422(app)
    errors.install(app)
    app.add_middleware(_Gate, api_key=api_key, metrics=metrics, body_limit=serving.body_limit)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    def respond(result):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(result.model_dump(mode="json"))

    @app.get("/health")
    async def health():
        if engine.ready and not engine.draining:
            return {"status": "ok"}
        if engine.draining:
            detail = "shutting down"
        elif engine.state == "loading":
            detail = f"loading ({engine.reason})" if engine.reason else "loading"  # e.g. the kernels being built
        else:
            detail = f"{engine.state}: {engine.reason}"
        return JSONResponse({"status": detail}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return JSONResponse(serving.models().model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return JSONResponse(serving.model(model_id).model_dump(mode="json"))

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return PlainTextResponse(await serving.load_lora(body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return PlainTextResponse(await serving.unload_lora(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        result = await serving.off_loop(tokenization.tokenize, serving, body)  # tokenizing: off the event loop
        return JSONResponse(result.model_dump(mode="json"))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return JSONResponse(tokenization.detokenize(serving, body).model_dump(mode="json"))

    async def generate(request: Request, work):
        try:
            return respond(await _unless_disconnected(request, work))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/completions", responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        return await generate(request, serving.completions(body))

    @app.post("/v1/chat/completions", responses=_generation_responses(ChatCompletionResponse))
    async def chat(body: ChatCompletionRequest, request: Request):
        return await generate(request, serving.chat(body))

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        return await generate(request, anthropic.messages(body))

    return app
