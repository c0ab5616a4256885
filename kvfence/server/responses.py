"""The Responses API's answers: a chat format's body and chunks (tool calls included, read by
server/tools.py) turned into a `response` object and its typed stream events (created, output
items, text and function-call argument deltas, completed), as vLLM serves them."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvfence.server.responses_schema import ResponsesRequest
from kvfence.server.schemas import ChatFormat, ChoiceState, Delta


@dataclass
class _Item:
    """One output item being built: a message's text or a function call's arguments."""

    kind: str  # message | function_call
    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""

    def json(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
                "status": status,
            }
        content = [_text_part(self.text)] if self.text or status != "in_progress" else []
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _Output:
    """Reads chat deltas (content, tool-call heads and argument pieces, the finish) into output
    items and the Responses events they make. The non-stream body runs its message through the
    same reader, so a body and a stream of one answer hold the same items."""

    seq: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)  # finished, in order
    open: _Item | None = None
    finish: str | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        it, self.open = self.open, None
        if it is None:
            return []
        where = {"item_id": it.id, "output_index": it.index}
        if it.kind == "function_call":
            out = [self.event("response.function_call_arguments.done", arguments=it.text, **where)]
        else:
            part = _text_part(it.text)
            out = [
                self.event("response.output_text.done", content_index=0, text=it.text, **where),
                self.event("response.content_part.done", content_index=0, part=part, **where),
            ]
        item = it.json(status)
        self.items.append(item)
        out.append(self.event("response.output_item.done", output_index=it.index, item=item))
        return out

    def _open(self, it: _Item) -> list[dict[str, Any]]:
        self.open = it
        out = [
            self.event(
                "response.output_item.added", output_index=it.index, item=it.json("in_progress")
            )
        ]
        if it.kind == "message":
            where = {"item_id": it.id, "output_index": it.index, "content_index": 0}
            out.append(self.event("response.content_part.added", part=_text_part(""), **where))
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self.open is None or self.open.kind != "message":
            out += self._close("completed")
            out += self._open(_Item("message", f"msg_{secrets.token_hex(12)}", len(self.items)))
        it = self.open
        assert it is not None
        it.text += text
        where = {"item_id": it.id, "output_index": it.index, "content_index": 0}
        return [*out, self.event("response.output_text.delta", delta=text, logprobs=[], **where)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        fn = call.get("function") or {}
        if "id" in call:  # a new call's head: its id and name
            out += self._close("completed")
            it = _Item("function_call", f"fc_{secrets.token_hex(12)}", len(self.items))
            it.call_id, it.name = call["id"], fn.get("name", "")
            out += self._open(it)
        args = fn.get("arguments") or ""
        if args and self.open is not None and self.open.kind == "function_call":
            self.open.text += args
            where = {"item_id": self.open.id, "output_index": self.open.index}
            out.append(self.event("response.function_call_arguments.delta", delta=args, **where))
        return out

    def read(self, delta: dict[str, Any], finish: str | None) -> list[dict[str, Any]]:
        out = []
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        if finish is not None:
            self.finish = finish
            out += self._close("incomplete" if finish == "length" else "completed")
        return out


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


class ResponsesFormat:
    """The format generate() drives for /v1/responses: wraps the chat format the request would
    have on /v1/chat/completions and rewrites what it produces. A stream has no [DONE]: it ends
    with `response.completed` (status "incomplete" when max_output_tokens cut it, as vLLM's)."""

    end_of_stream = b""

    def __init__(self, chat: ChatFormat, req: ResponsesRequest, response_id: str) -> None:
        self.chat = chat
        self.req = req
        self.id = response_id
        self.created = int(time.time())
        self._out = _Output()

    def encode(self, obj: dict[str, Any]) -> bytes:
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {obj['type']}\ndata: {data}\n\n".encode()

    def response(
        self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None
    ) -> dict[str, Any]:
        r = self.req
        text = {"format": (r.text or {}).get("format") or {"type": "text"}}
        cut = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": cut,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.chat.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": r.temperature,
            "text": text,
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": responses_usage(use) if use is not None else None,
            "user": None,
            "metadata": r.metadata or {},
        }

    def _status(self) -> str:
        return "incomplete" if self._out.finish == "length" else "completed"

    def body(self, choices: list[ChoiceState], use: dict[str, Any]) -> dict[str, Any]:
        choice = self.chat.body(choices, use)["choices"][0]
        self._out.read(choice["message"], choice["finish_reason"])
        return self.response(self._status(), self._out.items, use)

    def start_chunks(self, n_choices: int) -> list[dict[str, Any]]:
        head = self.response("in_progress", [], None)
        return [
            self._out.event("response.created", response=head),
            self._out.event("response.in_progress", response=head),
        ]

    def delta_chunks(self, c: ChoiceState, d: Delta) -> list[dict[str, Any]]:
        out = []
        for chunk in self.chat.delta_chunks(c, d):
            for choice in chunk["choices"]:
                out += self._out.read(choice["delta"], choice["finish_reason"])
        return out

    def end_chunks(self, use: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
        final = self.response(self._status(), self._out.items, use)
        return [self._out.event("response.completed", response=final)]


__all__ = ["ResponsesFormat", "responses_usage"]
