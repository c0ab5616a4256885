"""LoRA on the HTTP side: a model name resolved for the requesting tenant, the adapters a tenant
may see, and the operator's run-time load and unload (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), behind the operator key."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from kvfence.lora.config import LoraRegistryError, spec_from_fields
from kvfence.role import RoleService
from kvfence.server.errors import APIError, bad_request, from_validation_error
from kvfence.server.httpio import read_body
from kvfence.server.operator import OperatorGate

if TYPE_CHECKING:
    from kvfence.lora.checkpoint import LoraAdapter
    from kvfence.lora.registry import LoraRegistry

MAX_BODY = 64 * 1024
_M = TypeVar("_M", bound=BaseModel)


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    tenants: list[str] | None = None  # absent: every tenant may use it


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients send it; names identify adapters here


def _registry(engine: RoleService) -> LoraRegistry | None:
    return getattr(engine, "loras", None)


def resolve_lora(engine: RoleService, name: str, tenant: str) -> LoraAdapter | None:
    reg = _registry(engine)
    return reg.resolve(name, tenant) if reg is not None else None


def lora_names(engine: RoleService, tenant: str) -> list[str]:
    reg = _registry(engine)
    return reg.names_for(tenant) if reg is not None else []


def add_lora_routes(app: FastAPI, engine: RoleService, operator: OperatorGate) -> None:
    async def body(request: Request, model: type[_M]) -> tuple[_M, LoraRegistry]:
        operator.require(request.headers)  # before the body is read: tenants learn nothing
        reg = _registry(engine)
        if reg is None:
            raise bad_request("LoRA is not enabled on this node (--enable-lora).",
                              code="lora_disabled", param=None)
        try:
            return model.model_validate_json(await read_body(request, MAX_BODY)), reg
        except ValidationError as e:
            raise from_validation_error(e) from None

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        req, reg = await body(request, LoadLoraRequest)
        try:
            spec = spec_from_fields(
                {"name": req.lora_name, "path": req.lora_path, "tenants": req.tenants}, "body"
            )
            adapter = await asyncio.to_thread(reg.load, spec)
        except LoraRegistryError as e:
            raise APIError(e.status, str(e), code=e.code, param="lora_name") from None
        except ValueError as e:  # the spec or the checkpoint: say which and why
            raise bad_request(str(e), code="invalid_lora", param="lora_path") from None
        return JSONResponse({"status": "ok", "lora_name": adapter.name, "digest": adapter.digest})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        req, reg = await body(request, UnloadLoraRequest)
        try:
            reg.unload(req.lora_name)
        except LoraRegistryError as e:
            raise APIError(e.status, str(e), code=e.code, param="lora_name") from None
        return JSONResponse({"status": "ok", "lora_name": req.lora_name})
