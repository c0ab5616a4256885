"""Property-based fuzzing of the OpenAI HTTP surface from the server's own OpenAPI document
(schemathesis, issue 47): every operation, positive and negative inputs, against the tiny model
on a unified worker and through the router in front of it. Checks per answer: not a 5xx, a status
the document lists, a content type it lists, a body its schema admits. Used by
tests/test_openapi_props.py (a few examples per operation) and scripts/schemathesis.sh (long)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import hypothesis
import schemathesis
from conftest import TINY_MODEL
from fake_workers import ServerThread, stop_all
from hypothesis import HealthCheck, given
from pd_harness import PDPair
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from waiting import wait_for

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.server.router import build_router_app

TENANT_KEY = "sk-fuzz-tenant"
OPERATOR_KEY = "op-fuzz-0123456789abcdef0123"
OPERATOR_PATHS = ("/metrics", "/pd/info", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@dataclass
class Tally:
    calls: int = 0
    by_status: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def line(self, where: str) -> str:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_status.items()))
        return (
            f"{where}: {self.calls} responses ({statuses}); "
            f"{sum(1 for s in self.by_status.elements() if s >= 500)} 5xx; "
            f"{len(self.failures)} failed checks"
        )


@contextlib.contextmanager
def worker_and_router() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(worker url, router url, the worker's OpenAPI document): the tiny model on a unified
    worker, and a router in front of a prefill/decode pair of it (in-process, over mutual TLS)."""
    cfg: dict[str, Any] = {
        "kv_pool_tokens": 4096, "context_length": 256, "served_model_name": "tiny"
    }
    engine = Engine(EngineConfig(model=str(TINY_MODEL), **cfg))
    engine.start()
    pair = PDPair(str(TINY_MODEL), **cfg)
    keys = {TENANT_KEY: "fuzz"}
    servers: list[ServerThread] = []
    try:
        app = build_app(UnifiedService(engine), api_keys=keys, operator_key=OPERATOR_KEY)
        for service in (app, pair.prefill, pair.decode):
            if service is not app:
                service = build_app(service, api_keys=keys, operator_key=OPERATOR_KEY)
            servers.append(ServerThread(service).start())
        router = build_router_app(
            [servers[1].url], [servers[2].url], api_keys=keys, operator_key=OPERATOR_KEY,
            health_interval=0.2,
        )
        servers.append(ServerThread(router).start())
        wait_for(
            lambda: httpx.get(servers[3].url + "/health", timeout=5).status_code == 200,
            60,
            "the router never saw its prefill and decode healthy",
        )
        yield servers[0].url, servers[3].url, app.openapi()
    finally:
        stop_all(servers)
        pair.close()
        engine.shutdown()


def run(doc: dict[str, Any], base_url: str, examples: int, seed: int = 47) -> Tally:
    """Each operation of `doc`, `examples` inputs per generation mode, sent to base_url."""
    schema = schemathesis.openapi.from_dict(doc)
    tally = Tally()
    for result in schema.get_all_operations():
        op = result.ok()
        operator = op.path in OPERATOR_PATHS
        headers = {"Authorization": f"Bearer {OPERATOR_KEY if operator else TENANT_KEY}"}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run_operation(op, mode, base_url, headers, examples, seed, tally)
    return tally


# Valid by the schema is not yet servable: a random model name is a 404 and a random max_tokens
# a 400 past the context. Positive inputs name the served model and ask for a few tokens, so
# they reach generation, its answers and its streams instead of stopping at the first check.
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


_TOKEN_FIELD = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def _servable(case: Any) -> Any:
    body = case.body
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = "tiny"
        field = _TOKEN_FIELD.get(case.operation.path)
        if field is not None and not any(k in body for k in _TOKEN_FIELDS):
            body[field] = 8  # the default is the rest of the context: minutes on a loaded CPU
        for name in _TOKEN_FIELDS:
            if isinstance(body.get(name), int):
                body[name] = 1 + body[name] % 8
        if isinstance(body.get("n"), int):
            body["n"] = 1 + body["n"] % 2
    return case


def _run_operation(
    op: Any, mode: Any, base_url: str, headers: dict[str, str], examples: int, seed: int,
    tally: Tally,
) -> None:
    strategy = op.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(_servable)

    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.seed(seed)
    @given(case=strategy)
    def one(case: Any) -> None:
        try:
            # call() reads an event stream and checks each event against the document too
            response = case.call(base_url=base_url, headers=headers, timeout=120)
            tally.calls += 1
            tally.by_status[response.status_code] += 1
            case.validate_response(response, checks=CHECKS, headers=headers)
        except Exception as e:  # noqa: BLE001 - counted, reported with the input
            first = str(e).strip().splitlines()[:6]
            tally.failures.append(f"{op.method.upper()} {op.path}: {' | '.join(first)}")

    try:
        one()
    except hypothesis.errors.Unsatisfiable:
        pass  # an operation with no parameters has no negative inputs
