"""What of a request body the cache-aware router matches on: the prompt as token ids, text, or
chat messages serialised so that a conversation's next turn extends its previous one, and the
request's `cache_salt`. The router has no tokenizer (nor the model), so text is matched by
characters, as SGLang's and llm-d's routers do. A body it cannot read routes by load alone; the
worker answers it with the proper 4xx."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"


class PromptKind(Enum):
    IDS = "ids"  # a completion's token ids
    TEXT = "text"  # a completion's text
    CHAT = "chat"  # chat messages, one JSON object per message


@dataclass(frozen=True)
class Prompt:
    kind: PromptKind
    symbols: str | tuple[int, ...]  # characters (TEXT, CHAT) or token ids (IDS)
    cache_salt: str | None = None


def read_prompt(path: str, body: bytes) -> Prompt | None:
    """The prompt a request carries, or None when there is none the router can match on."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    salt = obj.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    if path in (CHAT_PATH, RESPONSES_PATH):
        messages = obj.get("messages") if path == CHAT_PATH else _responses_items(obj)
        text = _chat_text(messages)
        return Prompt(PromptKind.CHAT, text, salt) if text else None
    return _completion_prompt(obj.get("prompt"), salt)


def _completion_prompt(prompt: Any, salt: str | None) -> Prompt | None:
    # A batch of prompts shares its first one's placement: one request goes to one decode.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return Prompt(PromptKind.TEXT, prompt, salt)
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return Prompt(PromptKind.IDS, tuple(prompt), salt)
    return None


def _is_id(t: Any) -> bool:
    # The index keys ids as int64; anything else is no token id (the worker says so with a 400).
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63


def chat_head(content: str) -> str:
    """How a chat whose first message's content starts with `content` starts once serialised
    below: a declared public text as the router meets it inside chat messages."""
    return '{"content":' + json.dumps(content, ensure_ascii=False)[:-1]


def _responses_items(obj: dict[str, Any]) -> Any:
    """A Responses API request's input as message-like items, its instructions first: the same
    conversation continued extends them as a chat's next turn extends its messages."""
    items = obj.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    instructions = obj.get("instructions")
    if isinstance(items, list) and isinstance(instructions, str) and instructions:
        items = [{"role": "system", "content": instructions}, *items]
    return items


def _chat_text(messages: Any) -> str | None:
    """One canonical JSON object per message, in order: turn k's messages are a prefix of turn
    k+1's, so its text is too, whatever the chat template does with them on the worker."""
    if not isinstance(messages, list) or not messages:
        return None
    if not all(isinstance(m, dict) for m in messages):
        return None
    return "".join(
        json.dumps(m, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"
        for m in messages
    )
