"""OpenAI-style error bodies: the one APIError type every HTTP failure becomes, and its handlers."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvfence.server")

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """A failure the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, code: str = "invalid_value", param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


# What a failed request's status says a client should do, one status per class of failure
# (README "Errors a client can act on"), as OpenAI's API and its clients read them: a 4xx is the
# client's to fix and is not retried; a 503 with Retry-After is capacity or a KV transfer that
# failed closed, so the same request may succeed on a retry (nothing of it was answered); a 500
# is a bug or a guard that caught corrupt state, for the operator. The engine and the PD
# protocol report failures by code; the status the client sees is decided here, nowhere else.
RETRY_AFTER_S = 1
RETRYABLE = frozenset(
    {
        "kv_transfer_incomplete",  # pages missing or failing their checksum: fails closed
        "kv_transfer_timeout",
        "kv_prefix_mismatch",  # prefill's cached prefix is not the one decode reused
        "prefill_unavailable",
        "room_collision",
        "request_aborted",  # aborted by the server (a drain, a lost peer), not by the client
        "engine_failed",
        "draining",
        "no_workers",
    }
)


def server_failure(code: str, message: str, status: int | None) -> APIError:
    """The client's error for a failure reported by `code` with the reporter's `status`: a 503
    with Retry-After for a RETRYABLE code, the reporter's 4xx for a client's fault, else 500."""
    if code in RETRYABLE:
        return APIError(
            503,
            message,
            code=code,
            type=SERVER_ERROR,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if status is not None and 400 <= status < 500:
        return APIError(status, message, code=code)
    return APIError(500, message, code=code, type=SERVER_ERROR)


# The router's own answers when it cannot reach or hear from a worker: retryable, no Retry-After
# (the next try may go to another worker at once).
UPSTREAM = {"upstream_unreachable": 502, "upstream_failed": 502, "upstream_timeout": 504}


def upstream_failure(code: str, message: str) -> APIError:
    """The router's error for an UPSTREAM code (any other code: a 500, the router's own bug)."""
    return APIError(UPSTREAM.get(code, 500), message, code=code, type=SERVER_ERROR)


def table_mismatch(
    status: int | None, code: str, type_: str, retry_after: str | None
) -> str | None:
    """Why an error answer disagrees with the one table of failure classes above (None: it
    agrees), rebuilt from server_failure / upstream_failure rather than restated: the chaos
    soaks assert it of every error they meet. status None: an error event of a stream already
    answered 200, whose reporter's 4xx is not on the wire (only a 5xx class can be checked)."""
    if code in UPSTREAM:
        want = upstream_failure(code, "")
    elif status is not None and 400 <= status < 500 and code not in RETRYABLE:
        want = server_failure(code, "", status)
        retry_after = None  # a 429 may say when to come back; the class does not
    else:
        want = server_failure(code, "", None)
    if status is None:
        if (code in RETRYABLE or code in UPSTREAM) and type_ != want.type:
            return f"stream error {code!r}: type {type_!r}, the table says {want.type!r}"
        return None
    expect_after = (want.headers or {}).get("Retry-After")
    got, table = (status, type_, retry_after), (want.status, want.type, expect_after)
    if got != table:
        return f"{code!r}: (status, type, Retry-After) {got}, the table says {table}"
    return None


# Union members and validators appear in pydantic locations as tags, not as fields.
_LOC_TAGS = {"body", "str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # pydantic locations such as ("messages", 0, "content") read as "messages[0].content"
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _LOC_TAGS or "[" in str(part) or "-" in str(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _code_for(err_type: str) -> str:
    if err_type == "json_invalid":
        return "invalid_json"
    if err_type == "missing":
        return "missing_required_parameter"
    if err_type.endswith("_type") or err_type.endswith("_parsing") or err_type.startswith("model_"):
        return "invalid_type"
    return "invalid_value"


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first validation failure as a 400 naming the field (FastAPI would say 422)."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    err_type = str(first.get("type", ""))
    param = _loc_to_param(tuple(first.get("loc", ())))
    if err_type == "json_invalid":
        return bad_request(
            f"We could not parse the JSON body of your request: {first.get('msg')}.",
            code="invalid_json",
        )
    if err_type in ("model_type", "model_attributes_type", "dict_type") and param is None:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    text = f"{param}: {msg}" if param else msg
    return bad_request(text, code=_code_for(err_type), param=param)


def _record_code(request: Request, code: str) -> None:
    record = request.scope.get("kvfence.record")
    if record is not None:
        record.error_code = code


def json_error(request: Request, err: APIError) -> JSONResponse:
    _record_code(request, err.code)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return json_error(request, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return json_error(request, from_validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = APIError(
            exc.status_code,
            message,
            code=_HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}"),
            type=INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR,
            headers=dict(exc.headers) if exc.headers else None,
        )
        return json_error(request, err)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return json_error(
            request,
            APIError(500, "Internal server error.", code="internal_error", type=SERVER_ERROR),
        )

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
