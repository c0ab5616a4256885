"""The Responses API request (`POST /v1/responses`) as vLLM serves it, stateless: validated, and
read into the chat request it amounts to (input items to chat messages, flat function tools to
chat tools, `text.format` to `response_format`), so one chat path serves both routes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvfence.server.errors import APIError, bad_request
from kvfence.server.schemas import ChatCompletionRequest, _Strict

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Asking for these changes nothing a model without reasoning or hosted tools would produce.
_HARMLESS_INCLUDES = ("reasoning.encrypted_content",)


def _unsupported(param: str, message: str) -> APIError:
    return bad_request(message, code="unsupported_parameter", param=param)


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{param}[{i}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported",
                code="unsupported_parameter" if isinstance(kind, str) else "invalid_value",
                param=f"{param}[{i}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _str_field(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a function call joins the assistant turn before
    it (several calls in a row are one turn), its output becomes a `tool` message."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(
                    f"{param}.role must be one of {', '.join(_ROLES)}", param=f"{param}.role"
                )
            out.append({"role": role, "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {
                "id": _str_field(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _str_field(item, "name", param),
                    "arguments": _str_field(item, "arguments", param),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _str_field(item, "call_id", param),
                    "content": _text_of(output, f"{param}.output"),
                }
            )
        else:
            raise _unsupported(
                f"{param}.type",
                f"{param}: input items of type {kind!r} are not supported by this server "
                "(send message, function_call or function_call_output items)",
            )
    return out


def _chat_tool(tool: Any, i: int) -> Any:
    """A Responses function tool (flat: name, parameters) as a chat tool; anything else is left
    for the chat tool checks to refuse, except the hosted tools, which are named here."""
    if not isinstance(tool, dict) or "function" in tool:
        return tool
    if tool.get("type") != "function":
        raise _unsupported(
            f"tools[{i}].type",
            f"tools[{i}]: tools of type {tool.get('type')!r} are not supported by this server "
            "(only function tools)",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", param="text.format")
    if fmt.get("type") != "json_schema":
        return fmt  # text / json_object read the same as chat's response_format
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's field: narrows prefix-cache sharing to requests of this tenant with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def check_supported(self) -> None:
        """What a stateless server cannot honour is refused, never answered differently."""
        if self.previous_response_id is not None:
            raise _unsupported(
                "previous_response_id",
                "previous_response_id is not supported: this server stores no responses "
                "(store is always false); send the whole conversation in `input`",
            )
        if self.background:
            raise _unsupported("background", "background responses are not supported")
        if self.truncation == "auto":
            raise _unsupported("truncation", 'truncation "auto" is not supported (send "disabled")')
        if self.top_logprobs:
            raise _unsupported("top_logprobs", "top_logprobs are not supported on /v1/responses")
        for value in self.include or ():
            if value not in _HARMLESS_INCLUDES:
                raise _unsupported("include", f"include {value!r} is not supported")

    def messages(self) -> list[dict[str, Any]]:
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else None
        out = _messages(items if items is not None else self.input)
        if self.instructions:
            out.insert(0, {"role": "system", "content": self.instructions})
        if not out:
            raise bad_request("input must not be empty", param="input")
        return out

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one amounts to (validated as any chat request is)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": [_chat_tool(t, i) for i, t in enumerate(self.tools)] if self.tools else None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text),
            "cache_salt": self.cache_salt,
        }
        return ChatCompletionRequest.model_validate(body)


__all__ = ["ResponsesRequest"]
