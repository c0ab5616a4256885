"""RoleService: what every role (unified, prefill, decode) offers the HTTP layer and the CLI, and
UnifiedService, the role that serves requests on one engine from prompt to last token.

The HTTP layer talks to a RoleService only; it never asks which role it serves. The PD roles are
`kvfence.pd.prefill.PrefillService` and `kvfence.pd.decode.DecodeService`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import Metric

from kvfence.engine.admission import Admitted, Rejected
from kvfence.engine.request import GenerateRequest, RequestOutput

if TYPE_CHECKING:  # the HTTP layer imports this module; torch loads with the engine, not here
    from kvfence.engine.engine import Engine, EngineStats
    from kvfence.lora.registry import LoraRegistry


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


class RoleService(Protocol):
    @property
    def model_name(self) -> str: ...
    @property
    def context_length(self) -> int: ...
    @property
    def tokenizer(self) -> TokenizerLike: ...
    @property
    def alive(self) -> bool: ...  # the engine loop thread is running

    def start(self) -> None: ...
    def shutdown(self) -> None: ...
    def stop_admitting(self) -> None:
        """Graceful drain: admit nothing new (a 503 at every door); finish what is admitted."""
        ...

    def submit(
        self, req: GenerateRequest, sink: Callable[[RequestOutput], None]
    ) -> Admitted | Rejected: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
    def info(self) -> dict[str, Any]:
        """What /pd/info shows: "role", "bootstrap_host", "bootstrap_port", "model", ..."""
        ...

    def metrics(self) -> Iterable[Metric]:
        """The role's own metric families, beyond the pool gauges every role has."""
        ...


class EngineRole:
    """What the roles share: one engine, whose lifetime and facts they pass through."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def tokenizer(self) -> TokenizerLike:
        return self.engine.tokenizer

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stop_admitting(self) -> None:
        self.engine.stop_admitting()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def loras(self) -> LoraRegistry | None:
        """The adapters this engine serves (None: --enable-lora is off)."""
        return self.engine.lora.registry if self.engine.lora is not None else None

    @property
    def prefix_caching(self) -> bool:
        """Answers report usage.prompt_tokens_details.cached_tokens: the tokens this engine's
        cache held for the request (a PD decode's: what prefill did not have to send)."""
        return self.engine.prefix_caching


class UnifiedService(EngineRole):
    """Prefill and decode on the same engine and pool: no hand-off, no transfer."""

    def start(self) -> None:
        self.engine.start()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def submit(
        self, req: GenerateRequest, sink: Callable[[RequestOutput], None]
    ) -> Admitted | Rejected:
        return self.engine.submit(req, sink)

    def info(self) -> dict[str, Any]:
        return {
            "role": "unified",
            "bootstrap_host": None,
            "bootstrap_port": None,
            "model": self.engine.model_name,
            "context_length": self.engine.context_length,
        }

    def metrics(self) -> Iterable[Metric]:
        return ()
