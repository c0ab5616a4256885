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


# A call's head as far as it was written: its whole name, then the start of its arguments.
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*)?',
    re.DOTALL,
)


def partial_call(fragment: str, declared: frozenset[str]) -> ToolCall | None:
    """A call cut off by max_tokens: its name when that was written whole (and declared), its
    arguments as far as they were written (JSON that may not parse), as a cut call reaches a
    client from OpenAI and from vLLM's named and streamed paths."""
    m = _HEAD.match(fragment)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    if name not in declared:
        return None
    return ToolCall(name, fragment[m.end() :].rstrip())


def parse_call_list(text: str, declared: frozenset[str], *, cut: bool) -> list[ToolCall]:
    """The calls of a `tool_choice: required` answer, `[{"name": ..., "parameters": {...}}, ...]`
    as the grammar writes it; when `cut`, the last one as far as it was written."""
    body = text.strip()
    if not body.startswith("["):
        return []
    dec = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 1
    while pos < len(body):
        while pos < len(body) and body[pos] in " \t\n,":
            pos += 1
        if pos >= len(body) or body[pos] == "]":
            break
        try:
            obj, pos = dec.raw_decode(body, pos)
        except ValueError:
            part = partial_call(body[pos:], declared) if cut else None
            return calls + ([part] if part else [])
        call = _call(obj, declared, ("parameters", "arguments"))
        if call is not None:
            calls.append(call)
    return calls


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Hermes, Qwen 2.5 / Qwen 3."""

    START = "<tool_call>"
    END = "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(
        self, text: str, declared: frozenset[str], *, cut: bool = False
    ) -> tuple[str, list[ToolCall]]:
        """(content, calls). The text from the first marker on is never content: a malformed
        call yields no call, a cut one (`cut`) what was written of it."""
        if self.START not in text:
            return text, []
        calls = []
        found = list(self._CALL.finditer(text))
        for i, m in enumerate(found):
            fragment = m.group(1)
            open_end = cut and i == len(found) - 1 and not m.group(0).endswith(self.END)
            if open_end:  # cut inside the closing marker: drop what was written of it
                fragment = next(
                    (fragment[:-k] for k in range(len(self.END), 0, -1)
                     if fragment.endswith(self.END[:k])),
                    fragment,
                ).rstrip()  # fmt: skip
            try:
                call = _call(json.loads(fragment), declared, ("arguments", "parameters"))
            except ValueError:
                call = partial_call(fragment, declared) if open_end else None
            if call is None:
                break
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

    def parse(
        self, text: str, declared: frozenset[str], *, cut: bool = False
    ) -> tuple[str, list[ToolCall]]:
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
                part = partial_call(body[pos:], declared) if cut else None
                if part is not None:  # a call cut off: what was written of it, never content
                    return "", [*calls, part]
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
