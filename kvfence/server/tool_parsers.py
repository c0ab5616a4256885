"""Tool-call parsers (`--tool-call-parser`): find the function calls a model wrote in its own
format and split them from the text around them, as vLLM's parsers of the same names do."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


def _call(obj: object, declared: frozenset[str], args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in declared:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Hermes, Qwen 2.5 / Qwen 3."""

    START = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, declared: frozenset[str]) -> tuple[str, list[ToolCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for m in self._CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), declared, ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # a malformed call: the client gets the text as written
            calls.append(call)
        return text[: text.index(self.START)].strip(), calls

    def may_start_call(self, text: str) -> int | None:
        """Where a call may begin in text (held back while streaming), or None."""
        pos = text.find(self.START)
        if pos != -1:
            return pos
        for k in range(len(self.START) - 1, 0, -1):  # a marker still forming at the end
            if text.endswith(self.START[:k]):
                return len(text) - k
        return None


class Llama3JsonParser:
    """Llama 3.x JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`, several
    joined by `;` (the `<|python_tag|>` before them is a special token, gone from the text)."""

    def parse(self, text: str, declared: frozenset[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, declared, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return "", calls

    def may_start_call(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if not stripped or stripped[0] == "{" else None


PARSERS = {"hermes": HermesParser, "qwen": HermesParser, "llama3_json": Llama3JsonParser}
ToolParser = HermesParser | Llama3JsonParser


def parser_named(name: str) -> ToolParser:
    return PARSERS[name]()
