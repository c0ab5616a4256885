"""`Option`: one flag, its spellings and how it parses; adding options to a parser, and writing
parsed values back as a command line. The tables of options live beside this, one per config."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class Parser(Protocol):
    """An argparse parser or one of its groups."""

    def add_argument(self, *names: str, **kw: Any) -> Any: ...


@dataclass(frozen=True)
class Option:
    """One flag: its spellings (the first is canonical), where it lands, and how it parses."""

    names: tuple[str, ...]
    dest: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    help: str | None = None
    switch: bool = False  # a store_true flag: present or not, no value
    negations: tuple[str, ...] = ()  # a switch on by default: the spellings that turn it off
    required: bool = False
    metavar: str | None = None
    nargs: str | None = None  # "+": one or more values, parsed as a list

    @property
    def flag(self) -> str:
        return self.names[0]

    def add(self, parser: Parser, **changes: Any) -> None:
        """Add to `parser` (or a group of it); `changes` adapt one command's view of the flag
        (a help text, a default that command resolves differently), never its name."""
        if {"names", "dest"} & changes.keys():
            raise ValueError(f"{self.flag}: a command may not rename an option")
        o = dataclasses.replace(self, **changes) if changes else self
        kw: dict[str, Any] = {"dest": o.dest, "default": o.default, "help": o.help}
        if o.switch:
            kw["action"] = "store_true"
        else:
            kw.update(type=o.type, choices=o.choices, required=o.required, metavar=o.metavar)
            if o.nargs is not None:
                kw["nargs"] = o.nargs
        parser.add_argument(*o.names, **kw)
        if o.negations:
            off = f"turn {o.flag} off" if o.help != argparse.SUPPRESS else o.help
            parser.add_argument(
                *o.negations, dest=o.dest, default=o.default, action="store_false", help=off
            )

    def argv(self, value: Any) -> list[str]:
        """This option with `value` as a child process's command line spells it."""
        if self.switch:
            return [self.flag] if value else list(self.negations[:1])
        if self.nargs is not None:
            return [self.flag, *(str(v) for v in value)]
        return [self.flag, str(value)]


def add_options(
    parser: Parser,
    options: Iterable[Option],
    **changes: Mapping[str, Any],
) -> None:
    """Add each option; `changes[dest]` adapts that one (see `Option.add`)."""
    options = tuple(options)
    unknown = set(changes) - {o.dest for o in options}
    if unknown:
        raise ValueError(f"no such option to change: {', '.join(sorted(unknown))}")
    for o in options:
        o.add(parser, **changes.get(o.dest, {}))


def command_line(args: argparse.Namespace, options: Iterable[Option]) -> list[str]:
    """The flags of `options` whose parsed value differs from the default (required ones always):
    a child given these parses back the same values, and its own defaults are the same ones."""
    out: list[str] = []
    for o in options:
        value = getattr(args, o.dest, None)
        if value is None or (value == o.default and not o.required):
            continue
        out += o.argv(value)
    return out


def field_options(config: type) -> Callable[..., Option]:
    """A maker of `config`'s options: each one's default is read from the field its dest names,
    so a default lives only on the config."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}

    def make(names: str | tuple[str, ...], dest: str, **kw: Any) -> Option:
        spellings = (names,) if isinstance(names, str) else names
        return Option(spellings, dest, default=defaults[dest], **kw)

    return make
