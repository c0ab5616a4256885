"""The request fields that ask for structured output (OpenAI's `response_format`, vLLM's
`structured_outputs`) read into one engine Constraint, with a 400 for every malformed shape."""

from __future__ import annotations

import json
from typing import Any

from kvfence.server.errors import APIError, bad_request
from kvfence.structured.spec import Constraint, ConstraintKind

# vLLM removed these in v0.12 for `structured_outputs`; answering them unconstrained would be
# silently wrong, so they get a 400 that names the new spelling.
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
    "guided_decoding_backend": None,
}
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_UNSUPPORTED = ("structural_tag", "whitespace_pattern", "disable_any_whitespace")
MAX_CHOICES = 256


def _err(message: str, param: str, code: str = "invalid_value") -> APIError:
    return bad_request(message, code=code, param=param)


def from_response_format(rf: dict[str, Any] | None) -> Constraint | None:
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT, "")
    if kind != "json_schema":
        raise _err(
            f"response_format.type {kind!r}: expected 'text', 'json_object' or 'json_schema'",
            "response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise _err(
            "response_format.json_schema must be an object with a `schema`",
            "response_format.json_schema",
        )
    schema = spec.get("schema", {})  # OpenAI: an absent schema is any JSON
    if not isinstance(schema, dict):
        raise _err("response_format.json_schema.schema must be an object", "response_format")
    # strict=false is still enforced: a grammar that only sometimes holds helps nobody.
    return Constraint.json_schema(schema)


def from_structured_outputs(so: dict[str, Any] | None) -> Constraint | None:
    if so is None:
        return None
    for key in _SO_UNSUPPORTED:
        if so.get(key) is not None:
            raise _err(
                f"structured_outputs.{key} is not supported by this server",
                f"structured_outputs.{key}",
                "unsupported_parameter",
            )
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise _err(
            f"structured_outputs needs exactly one of {', '.join(_SO_KINDS)}; got "
            f"{', '.join(given) or 'none'}",
            "structured_outputs",
        )
    kind = given[0]
    value = so[kind]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise _err(f"{param} is not valid JSON: {e}", param) from e
        if not isinstance(value, dict):
            raise _err(f"{param} must be a JSON schema object", param)
        return Constraint.json_schema(value)
    if kind == "json_object":
        if value is not True:
            raise _err(f"{param} must be true", param)
        return Constraint(ConstraintKind.JSON_OBJECT, "")
    if kind == "choice":
        ok = isinstance(value, list) and value and all(isinstance(x, str) and x for x in value)
        if not ok:
            raise _err(f"{param} must be a non-empty list of non-empty strings", param)
        if len(value) > MAX_CHOICES:
            raise _err(f"{param}: at most {MAX_CHOICES} choices", param, "grammar_too_large")
        return Constraint.choice(value)
    if not isinstance(value, str) or not value:
        raise _err(f"{param} must be a non-empty string", param)
    return Constraint(ConstraintKind.REGEX if kind == "regex" else ConstraintKind.GRAMMAR, value)


def constraint_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    extra: dict[str, Any],
) -> Constraint | None:
    """The one constraint a request asks for (None: free text). extra: the body's unknown
    fields, where vLLM's removed guided_* spellings would land."""
    for old, new in LEGACY_FIELDS.items():
        if extra.get(old) is not None:
            hint = f'use {{"structured_outputs": {{"{new}": ...}}}}' if new else "remove it"
            raise _err(
                f"{old} was removed (as in vLLM >= 0.12): {hint}", old, "unsupported_parameter"
            )
    a = from_response_format(response_format)
    b = from_structured_outputs(structured_outputs)
    if a is not None and b is not None:
        raise _err(
            "response_format and structured_outputs both constrain the output: send one",
            "structured_outputs",
        )
    return a or b
