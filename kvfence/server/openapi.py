"""The worker's OpenAPI document, complete: the routes read their bodies themselves (to answer
every malformed one with an OpenAI 400), so FastAPI alone would describe no request body, no
answer and a 422 nobody sends. This adds each operation's request model, the shape of its
answers (JSON or an event stream) and the error statuses of the README's table; the property
run (scripts/schemathesis.sh) checks every answer against it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvfence.server.lora_routes import LoadLoraRequest, UnloadLoraRequest
from kvfence.server.responses_schema import ResponsesRequest
from kvfence.server.schemas import ChatCompletionRequest, CompletionRequest
from kvfence.server.tokenize import DetokenizeRequest, TokenizeRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
_MODEL = {
    "type": "object",
    "required": ["id", "object"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}},
}


# One server-sent event: its data a JSON chunk (or [DONE]); /v1/responses names its events.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def _answer(obj: str | None, required: list[str]) -> dict[str, Any]:
    props: dict[str, Any] = {k: {} for k in required}
    if obj is not None:
        props["object"] = {"const": obj}
    return {"type": "object", "required": required, "properties": props}


_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index"]}}
_GENERATION = {
    "/v1/completions": (CompletionRequest, "text_completion"),
    "/v1/chat/completions": (ChatCompletionRequest, "chat.completion"),
    "/v1/responses": (ResponsesRequest, "response"),
}
_BODIES: dict[str, type[BaseModel]] = {
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraRequest,
    "/v1/unload_lora_adapter": UnloadLoraRequest,
    **{path: model for path, (model, _) in _GENERATION.items()},
}
_OK: dict[str, dict[str, Any]] = {
    "/health": _STATUS,
    "/live": _STATUS,
    "/pd/info": {"type": "object"},
    "/v1/models": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
    },
    "/v1/models/{model_id}": _MODEL,
    "/v1/completions": {
        **_answer("text_completion", ["id", "object", "created", "model", "choices"]),
        "properties": {"object": {"const": "text_completion"}, "choices": _CHOICES},
    },
    "/v1/chat/completions": {
        **_answer("chat.completion", ["id", "object", "created", "model", "choices"]),
        "properties": {"object": {"const": "chat.completion"}, "choices": _CHOICES},
    },
    "/v1/responses": _answer("response", ["id", "object", "status", "output"]),
    "/tokenize": _answer(None, ["tokens", "count"]),
    "/detokenize": _answer(None, ["prompt"]),
    "/v1/load_lora_adapter": _answer(None, ["status", "lora_name", "digest"]),
    "/v1/unload_lora_adapter": _answer(None, ["status", "lora_name"]),
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str, retry_after: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _json(_ERROR)}
    if retry_after:
        out["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    return out


def _responses(path: str, method: str) -> dict[str, Any]:
    ok: dict[str, Any] = _json(_OK.get(path, {"type": "object"}))
    if path in _GENERATION:
        # stream=true: server-sent events, each a JSON chunk, ended by [DONE] or an error event
        ok["text/event-stream"] = {"schema": _EVENT}
    if path == "/metrics":  # Prometheus' text format
        ok = {"text/plain": {"schema": {"type": "string"}}}
    out: dict[str, Any] = {
        "200": {"description": "the answer", "content": ok},
        "4XX": _error("the client's fault: fix the request (README: errors a client can act on)"),
        "503": _error("capacity, a drain or a KV transfer that failed closed: retry", True),
    }
    if path in ("/health", "/live"):
        out["503"] = {"description": "not ready (draining) or not alive", "content": _json(_ERROR)}
    return out


def document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (cached on the app, as FastAPI's own)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version="1", routes=app.routes)
    components: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            model = _BODIES.get(path) if method == "post" else None
            if model is not None:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                op["requestBody"] = {"required": True, "content": _json(ref)}
            op["responses"] = _responses(path, method)
    doc["components"] = {"schemas": components} if components else {}
    app.openapi_schema = doc
    return doc


def install(app: FastAPI) -> None:
    app.openapi = lambda: document(app)  # type: ignore[method-assign]
