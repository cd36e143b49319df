"""The one place exceptions become OpenAI error bodies and HTTP statuses.

Every error the server returns, from a route, from validation, or inside an SSE stream, goes
through `error_for` so the shape is always {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.engine_loop import EngineDeadError, EngineNotReadyError, RequestFailedError
from engine.llm_engine import PromptTooLongError
from engine.lora_serving import UnknownAdapterError
from engine.sampling_params import InvalidParameter
from engine.scheduler import QueueFullError

from .protocol import ErrorInfo, ErrorResponse, random_id, sse

log = logging.getLogger("layerstream.server")

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error the server raises itself with a known status (bad model name, bad field...)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


class ModelNotFoundError(APIError):
    def __init__(self, name: str, served: list[str]):
        names = ", ".join(f"`{n}`" for n in served)
        super().__init__(404, f"The model `{name}` does not exist; this server serves {names}.",
                         param="model", type_="NotFoundError")


class AuthError(APIError):
    def __init__(self, message: str):
        super().__init__(401, message, type_="AuthenticationError")


@dataclass
class MappedError:
    status: int
    body: ErrorResponse
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return sse(self.body)

    def anthropic_body(self) -> dict:
        """The same error in Anthropic's shape (for /v1/messages); the field, if any, is named in
        the message since that shape has no param."""
        message = self.body.error.message
        if self.body.error.param and self.body.error.param not in message:
            message = f"{self.body.error.param}: {message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": message}}

    def response_for(self, path: str) -> JSONResponse:
        if path.startswith(ANTHROPIC_PREFIX):
            return JSONResponse(self.anthropic_body(), status_code=self.status, headers=self.headers)
        return self.response()


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _type_for(status: int) -> str:
    return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            422: "BadRequestError", 429: "RateLimitError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError")


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field_path(loc) -> list[str]:
    """A validation error's location without "body" and without the tags pydantic adds for union
    branches ("str", "list[int]", "TextPart", "function-after[...]"): "messages.0.content.1.text"."""
    out = []
    for part in loc:
        if isinstance(part, int):
            out.append(str(part))
        elif part != "body" and part not in _TYPE_TAGS and "[" not in part and not part[:1].isupper():
            out.append(part)
    return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return f"malformed JSON body: {errors[0].get('msg')}", None
    # A value that matches no branch of a union gets one error per branch; the deepest one is the
    # branch the client meant (a content part whose text is not a string, not "content is not a
    # string").
    # Among equally deep ones, the branch with the fewest errors came closest: [1, true] as a
    # prompt is one wrong element of a token-id list, not two of a list of strings.
    paths = [_field_path(e.get("loc", ())) for e in errors]
    branches = [tuple(p for p in e.get("loc", ()) if isinstance(p, str) and p not in paths[i])
                for i, e in enumerate(errors)]
    size = {b: branches.count(b) for b in branches}
    best = max(range(len(errors)), key=lambda i: (len(paths[i]), -size[branches[i]]))
    param = ".".join(paths[best]) or None
    if errors[best].get("type") == "extra_forbidden":
        # OpenAI's wording: a field this server would not honour is refused, never ignored.
        return f"Unrecognized request argument supplied: {param}", param
    parts = []
    for i in [best] + [i for i in range(len(errors)) if i != best][:2]:
        where = ".".join(paths[i])
        parts.append(f"{where}: {errors[i].get('msg')}" if where else str(errors[i].get("msg")))
    return "; ".join(dict.fromkeys(parts)), param


def error_for(exc: BaseException) -> MappedError:
    headers: dict[str, str] = {}
    param = None
    type_ = None
    if isinstance(exc, APIError):
        status, message, param, type_ = exc.status, exc.message, exc.param, exc.type
    elif isinstance(exc, RequestValidationError):
        status = 400
        message, param = _validation_message(exc)
    elif isinstance(exc, json.JSONDecodeError):
        status, message = 400, f"malformed JSON body: {exc}"
    elif isinstance(exc, UnknownAdapterError):
        # Unloaded between the model check and the engine taking the request, or an unload of an unknown name.
        status, message, param, type_ = 404, str(exc), "lora_name", "NotFoundError"
    elif isinstance(exc, InvalidParameter):
        status, message, param = 400, str(exc), exc.param
    elif isinstance(exc, PromptTooLongError):
        status, message, param = 400, str(exc), "max_tokens"
    elif isinstance(exc, QueueFullError):
        status, message = 503, f"server overloaded: {exc}; retry later"
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    elif isinstance(exc, EngineNotReadyError):
        status, message = 503, f"{exc}; retry later"
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    elif isinstance(exc, EngineDeadError):
        status, message = 503, str(exc)
    elif isinstance(exc, StarletteHTTPException):
        status, message = exc.status_code, str(exc.detail)
        headers.update(exc.headers or {})
    elif isinstance(exc, ValueError):
        # The engine's own input checks (empty prompt, token id out of range) are user mistakes.
        status, message = 400, str(exc)
    else:
        # A bug, or the engine failing one request: the client gets an id to quote, the log gets
        # the exception under that id; internal text never reaches the client.
        error_id = random_id("err")
        log.error("internal error %s", error_id, exc_info=exc)
        status, message = 500, f"internal server error (error id {error_id}; the server log has the details)"
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_ or _type_for(status), param=param,
                                         code=status))
    return MappedError(status, body, headers)


async def handle_exception(request: Request, exc: Exception) -> JSONResponse:
    return error_for(exc).response_for(request.url.path)


def install(app) -> None:
    # Starlette sends a handler registered for bare Exception from its outermost middleware and
    # then re-raises (the connection is dropped): so every expected class is registered by name
    # and only a real bug reaches the Exception handler (500, logged with its traceback).
    for exc_type in (APIError, RequestValidationError, StarletteHTTPException, ValueError, QueueFullError,
                     EngineNotReadyError, EngineDeadError, RequestFailedError, UnknownAdapterError, Exception):
        app.add_exception_handler(exc_type, handle_exception)
