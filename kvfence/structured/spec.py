"""Constraint: what a request's output must match, as a plain value that travels with its
SamplingParams (and so in a PD RESERVE) and keys the compiled-grammar cache."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # value: the schema as canonical JSON text
    JSON_OBJECT = "json_object"  # value: "" (any JSON object)
    REGEX = "regex"  # value: the pattern (Rust regex syntax, anchored at both ends)
    CHOICE = "choice"  # value: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # value: a Lark grammar, or GBNF (recognised by "::=")


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    value: str

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        # Not key-sorted: the schema's property order is the order the answer writes them in.
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls(ConstraintKind.CHOICE, json.dumps(list(options)))

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "value": self.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Constraint:
        if not isinstance(data, Mapping) or set(data) != {"kind", "value"}:
            raise TypeError("constraint must be an object with exactly kind and value")
        value = data["value"]
        if not isinstance(value, str):
            raise TypeError("constraint value must be a string")
        return cls(ConstraintKind(data["kind"]), value)
