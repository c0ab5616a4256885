"""Chat tool calling: `tools`, `tool_choice` and `parallel_tool_calls` read into a plan (a
grammar for `required` / a named function, a parser for `auto`), `tool_answer` (what a finished
or cut answer holds: content, calls, finish reason; the one rule every API that serves tools
uses), and the chat format that sends it as OpenAI `tool_calls`, in a body or as deltas.

Bounds: `parallel_tool_calls: false` allows exactly one call; otherwise at most `max_calls`
(`--max-tool-calls`), which the `required` grammar enforces and `auto` keeps the first of.
A forced call (required / named) cut by max_tokens ends as OpenAI's and vLLM's do: finish reason
"length", content null, and the call(s) as far as they were written (the last one's arguments
may not parse). vLLM's named path returns the cut arguments the same way
(vllm/entrypoints/openai/serving_chat.py, chat_completion_full_generator: `arguments=content`,
finish reason from the output); its non-streamed `required` path fails validating a cut list,
while its stream sends the calls parsed so far, which is what this does in both."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvfence.config import DEFAULT_MAX_TOOL_CALLS
from kvfence.engine.request import TokenLogprob
from kvfence.server.errors import APIError, bad_request
from kvfence.server.schemas import ChatFormat, ChoiceState, Delta, TokenText, chat_logprobs
from kvfence.server.tool_parsers import (
    ToolCall,
    ToolParser,
    parse_call_list,
    parser_named,
)
from kvfence.structured.spec import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128


def _err(message: str, param: str, code: str = "invalid_value") -> APIError:
    return bad_request(message, code=code, param=param)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    declared: frozenset[str]
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None
    constraint: Constraint | None = None  # required / named: the grammar that enforces a call
    max_calls: int = DEFAULT_MAX_TOOL_CALLS  # 1 when parallel_tool_calls is false

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def _parameters(tools: list[Any]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise _err(f"at most {MAX_TOOLS} tools are allowed", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise _err(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _err(f"tools[{i}].function.name must match {_NAME.pattern}", "tools")
        if name in out:
            raise _err(f"tools[{i}]: function {name!r} is declared twice", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _err(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[name] = params
    return out


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser_name: str | None,
    max_calls: int = DEFAULT_MAX_TOOL_CALLS,
) -> ToolPlan | None:
    """None: no tools in play. Raises a 400 for every malformed or unservable combination.
    `max_calls`: the most calls one answer may make when parallel calls are allowed."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _err("tool_choice needs a non-empty `tools`", "tool_choice")
        return None
    params = _parameters(tools)
    declared = frozenset(params)
    parallel = parallel_tool_calls is not False
    limit = max(1, max_calls) if parallel else 1
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", declared)
    if choice == "auto":
        if parser_name is None:
            raise _err(
                'tool_choice "auto" needs the server started with --tool-call-parser '
                '(or send tool_choice "required" or a named function)',
                "tool_choice",
            )
        return ToolPlan(
            "auto", declared, parallel=parallel, parser=parser_named(parser_name), max_calls=limit
        )
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        # maxItems: without it a model that never closes the list writes calls to max_tokens.
        schema: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": items},
            "minItems": 1,
            "maxItems": limit,
        }
        return ToolPlan(
            "required",
            declared,
            parallel=parallel,
            constraint=Constraint.json_schema(schema),
            max_calls=limit,
        )
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise _err(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in declared:
        raise _err(
            f"tool_choice names {name!r}, which is not in tools", "tool_choice", "unknown_function"
        )
    return ToolPlan(
        "named", declared, named=name, constraint=Constraint.json_schema(params[name]), max_calls=1
    )


@dataclass(frozen=True)
class ToolAnswer:
    """What an answer given with tools holds, by the rules in this module's docstring."""

    content: str | None  # never a call's text
    calls: list[ToolCall]
    finish_reason: str | None


def tool_answer(plan: ToolPlan, text: str, finish: str | None) -> ToolAnswer:
    """The content, calls and finish reason of an answer that ended with `finish` ("stop": it
    ended by itself; anything else: cut, e.g. "length")."""
    cut = finish != "stop"
    if plan.mode == "named":
        args = text
        if not cut:
            try:
                args = json.dumps(json.loads(text), ensure_ascii=False)
            except ValueError:
                pass  # the grammar makes this unreachable; the text is still the arguments
        return ToolAnswer(None, [ToolCall(plan.named or "", args)], finish if cut else "tool_calls")
    if plan.mode == "required":
        calls = parse_call_list(text, plan.declared, cut=cut)[: plan.max_calls]
        return ToolAnswer(None, calls, "tool_calls" if calls and not cut else finish)
    if plan.mode == "auto" and plan.parser is not None:
        content, calls = plan.parser.parse(text, plan.declared, cut=cut)
        calls = calls[: plan.max_calls]
        if not calls:
            return ToolAnswer(content, [], finish)
        return ToolAnswer(content or None, calls, finish if cut else "tool_calls")
    return ToolAnswer(text, [], finish)


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass
class _Stream:
    text: str = ""  # everything generated so far
    sent: int = 0  # chars of it already streamed as content
    lps: list[TokenLogprob] = field(default_factory=list)  # withheld with withheld text
    call_open: bool = False  # named: the call's head (id, name) is out; arguments follow


class ToolChatFormat(ChatFormat):
    """ChatFormat for requests with tools: answers carry `tool_calls` and finish `tool_calls`;
    in a stream, text that is (or may become) a call is held back and sent as tool-call deltas."""

    def __init__(
        self, response_id: str, model: str, logprobs: bool, token_text: TokenText, plan: ToolPlan
    ) -> None:
        super().__init__(response_id, model, logprobs, token_text)
        self.plan = plan
        self._streams: dict[int, _Stream] = {}

    def body(self, choices: list[ChoiceState], use: dict[str, Any]) -> dict[str, Any]:
        out = super().body(choices, use)
        for c, choice in zip(choices, out["choices"], strict=True):
            answer = tool_answer(self.plan, "".join(c.text), c.finish_reason)
            message: dict[str, Any] = {"role": "assistant", "content": answer.content}
            if answer.calls:
                message["tool_calls"] = [_call_json(x) for x in answer.calls]
            choice["message"] = message
            choice["finish_reason"] = answer.finish_reason
        return out

    def _held_from(self, s: _Stream) -> int:
        if self.plan.mode in ("required", "named"):
            return 0  # the whole answer is the call
        if self.plan.mode == "auto" and self.plan.parser is not None:
            pos = self.plan.parser.may_start_call(s.text)
            return len(s.text) if pos is None else pos
        return len(s.text)

    def _content(self, c: ChoiceState, s: _Stream, upto: int) -> list[dict[str, Any]]:
        if upto <= s.sent and not (s.lps and upto == len(s.text)):
            return []
        text, s.sent = s.text[s.sent : upto], max(s.sent, upto)
        lps, s.lps = s.lps, []
        return [self._chunk(c.index, {"content": text}, lps, None)]

    def _chunk(
        self, index: int, delta: dict[str, Any], lps: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        logprobs = chat_logprobs(lps, self.token_text) if self.logprobs and lps else None
        return self.delta_chunk(index, delta, logprobs, finish)

    def delta_chunks(self, c: ChoiceState, d: Delta) -> list[dict[str, Any]]:
        # d.new_tokens is not read: held-back tokens get no empty chunk here, a call is one unit.
        s = self._streams.setdefault(c.index, _Stream())
        s.text += d.text
        s.lps.extend(d.logprobs)
        if self.plan.mode == "named":
            return self._named_deltas(c, s, d.text, d.finish)
        if d.finish is None:
            return self._content(c, s, self._held_from(s))
        answer = tool_answer(self.plan, s.text, d.finish)
        # Content the body would hold that is not out yet (held back while it might be a call);
        # the body's content is a prefix of the text, stripped.
        out = []
        if answer.content:
            at = s.text.find(answer.content)
            out = self._content(c, s, at + len(answer.content) if at >= 0 else len(s.text))
        if not answer.calls:
            return [*out, self._chunk(c.index, {}, [], answer.finish_reason)]
        for i, call in enumerate(answer.calls):
            head = _call_json(call)
            head["index"] = i
            head["function"] = {"name": call.name, "arguments": ""}
            out.append(self._chunk(c.index, {"tool_calls": [head]}, [], None))
            args = {"index": i, "function": {"arguments": call.arguments}}
            lps_now, s.lps = s.lps, []
            out.append(self._chunk(c.index, {"tool_calls": [args]}, lps_now, None))
        out.append(self._chunk(c.index, {}, [], answer.finish_reason))
        return out

    def _named_deltas(
        self, c: ChoiceState, s: _Stream, text: str, finish: str | None
    ) -> list[dict[str, Any]]:
        """A named call's answer is its arguments: stream them as they are written."""
        out = []
        if not s.call_open and (text or finish is not None):
            head = _call_json(ToolCall(self.plan.named or "", ""))
            out.append(self._chunk(c.index, {"tool_calls": [{"index": 0, **head}]}, [], None))
            s.call_open = True
        if text or s.lps:
            lps, s.lps = s.lps, []
            args = {"index": 0, "function": {"arguments": text}}
            out.append(self._chunk(c.index, {"tool_calls": [args]}, lps, None))
        if finish is not None:
            # A cut-off call says "length" (as OpenAI's does); a complete one "tool_calls".
            out.append(self._chunk(c.index, {}, [], "tool_calls" if finish == "stop" else finish))
        return out
