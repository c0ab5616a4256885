"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes (a prompt or chat messages to token ids,
count and max_model_len; token ids back to text). Clients use them to align token counts with the
server's. They need a tenant's key but touch no engine state and nothing of any tenant: the
answer depends on the model's tokenizer alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from kvfence.role import RoleService
from kvfence.server.errors import bad_request
from kvfence.server.schemas import ChatMessage, _Strict

# A prompt is bounded by the body limit; this bounds what one detokenize call may decode.
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(_Strict):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest: exactly one of prompt, messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE_TOKENS)

    @field_validator("tokens", mode="before")
    @classmethod
    def _no_bools(cls, v: Any) -> Any:
        if isinstance(v, list) and any(type(t) is bool for t in v):
            raise ValueError("tokens must be integer token ids")
        return v


def add_tokenize_routes(
    app: FastAPI,
    engine: RoleService,
    *,
    authenticate: Callable[[Request], str],
    read_json: Callable[[Request, type[Any]], Any],
    check_model: Callable[[str, str], object],
    require_text: Callable[[str], None],
) -> None:
    """Registers both routes. The callables are the app's own first door, bounded body parser,
    model check and tokenizer check (--skip-tokenizer-init), so these routes refuse exactly what
    the generation routes refuse."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        tenant = authenticate(request)
        req: TokenizeRequest = await read_json(request, TokenizeRequest)
        if req.model is not None:
            check_model(req.model, tenant)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Send exactly one of `prompt` and `messages`.", param="prompt")
        if req.return_token_strs:
            raise bad_request(
                "return_token_strs is not supported by this server",
                code="unsupported_parameter",
                param="return_token_strs",
            )
        tok = engine.tokenizer
        if req.prompt is not None:
            require_text("prompt")
            add = True if req.add_special_tokens is None else req.add_special_tokens
            prompt = req.prompt
            ids = await asyncio.to_thread(lambda: tok.encode(prompt, add_special_tokens=add))
        else:
            require_text("messages")
            for name in ("continue_final_message", "add_special_tokens"):
                if getattr(req, name):
                    # The chat template writes its own special tokens; the chat routes never
                    # add more or continue a message, so counting them here would mislead.
                    raise bad_request(
                        f"{name} is not supported with messages by this server",
                        code="unsupported_parameter",
                        param=name,
                    )
            messages = [m.template_dict() for m in req.messages or ()]
            try:
                ids = await asyncio.to_thread(tok.encode_chat, messages, req.add_generation_prompt)
            except ValueError as e:  # the template refuses some message orders
                raise bad_request(
                    f"The chat template rejected these messages: {e}",
                    code="invalid_messages",
                    param="messages",
                ) from e
        return JSONResponse(
            {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        tenant = authenticate(request)
        req: DetokenizeRequest = await read_json(request, DetokenizeRequest)
        if req.model is not None:
            check_model(req.model, tenant)
        require_text("tokens")
        tok = engine.tokenizer
        bad = next((t for t in req.tokens if t >= tok.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Token id {bad} is outside the vocabulary (size {tok.vocab_size}).",
                param="tokens",
            )
        text = await asyncio.to_thread(tok.decode, list(req.tokens))
        return JSONResponse({"prompt": text})


__all__ = ["DetokenizeRequest", "TokenizeRequest", "add_tokenize_routes"]
