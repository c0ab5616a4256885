"""The bundled tiny model on a real engine behind the real app, in-process: the module-scoped
`engine` and `client` fixtures of the files whose answers need real generation (structured
outputs, tool calls): `engine, client = tiny_app_fixtures(...)` at a test module's top level."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import TINY_MODEL
from fastapi.testclient import TestClient

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.role import UnifiedService
from kvfence.server.api import build_app

MODEL = "tiny"  # the name the engine serves the bundled model under


def tiny_app_fixtures(**app_options: Any) -> tuple[Any, Any]:
    """`engine`: the bundled model, started once per module; `client`: build_app over it, with
    no API keys and `app_options` (e.g. tool_call_parser)."""

    @pytest.fixture(scope="module", name="engine")
    def engine_() -> Iterator[Engine]:
        cfg = EngineConfig(
            model=str(TINY_MODEL), kv_pool_tokens=4096, context_length=512, served_model_name=MODEL
        )
        e = Engine(cfg)
        e.start()
        yield e
        e.shutdown()

    @pytest.fixture(scope="module", name="client")
    def client_(engine: Engine) -> Iterator[TestClient]:
        with TestClient(build_app(UnifiedService(engine), api_keys=None, **app_options)) as c:
            yield c

    return engine_, client_
