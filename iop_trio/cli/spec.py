"""Commands as data: what an argument and a (sub)command are, and the parser built from them.

A :class:`Command` names its arguments (:func:`arg`) and the function that runs it, or
its own subcommands; :func:`build_parser` turns a table of them into one argparse parser
and :func:`chosen` finds, in the same table, the command a parsed namespace names. A
default that depends on the environment is a :class:`FromEnv`, read when the parser is
built (not when the table is imported), so each ``main`` call sees the environment as
it is then.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import attrs

#: How a command runs: with the parsed arguments, stdout and stderr; its exit status.
Runner = Callable[[argparse.Namespace, TextIO, TextIO], int]


@attrs.frozen
class FromEnv:
    """A default taken from ``$var`` when the parser is built, else ``fallback``."""

    var: str
    fallback: str | None = None

    def value(self) -> str | None:
        return os.environ.get(self.var, self.fallback)


@attrs.frozen
class Arg:
    """One ``add_argument`` call: its flags (or a positional's name) and its keywords;
    a ``default`` that is a :class:`FromEnv` is resolved when the parser is built."""

    flags: tuple[str, ...]
    options: Mapping[str, Any] = attrs.field(factory=dict, hash=False)

    def __repr__(self) -> str:
        return f"<Arg {'/'.join(self.flags)}>"

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        options = dict(self.options)
        if isinstance(options.get("default"), FromEnv):
            options["default"] = options["default"].value()
        parser.add_argument(*self.flags, **options)


def arg(*flags: str, **options: Any) -> Arg:
    """An :class:`Arg` written as the ``add_argument`` call it stands for."""
    return Arg(flags, options)


@attrs.frozen
class Command:
    """A subcommand: its name, its one-line help and its arguments; either ``run``
    (a leaf) or ``subcommands``, whose chosen name is kept in the namespace at ``dest``."""

    name: str
    help: str
    args: tuple[Arg, ...] = ()
    run: Runner | None = None
    subcommands: tuple[Command, ...] = ()
    dest: str = ""

    def __attrs_post_init__(self) -> None:
        if (self.run is None) == (not self.subcommands):
            raise ValueError(f"command {self.name!r} needs either run or subcommands")
        if self.subcommands and not self.dest:
            raise ValueError(f"command {self.name!r} has subcommands but no dest")

    def __repr__(self) -> str:
        below = f" [{', '.join(c.name for c in self.subcommands)}]" if self.subcommands else ""
        return f"<Command {self.name!r}{below}>"


def build_parser(
    parser: argparse.ArgumentParser,
    options: Sequence[Arg],
    commands: Sequence[Command],
    dest: str,
) -> argparse.ArgumentParser:
    """``parser`` with ``options``, then ``commands`` as required subcommands (their
    chosen name at ``dest``), each with its arguments and subcommands, in table order."""
    for option in options:
        option.add_to(parser)
    sub = parser.add_subparsers(dest=dest, required=True)
    for command in commands:
        below = sub.add_parser(command.name, help=command.help)
        if command.subcommands:
            build_parser(below, command.args, command.subcommands, command.dest)
        else:
            for option in command.args:
                option.add_to(below)
    return parser


def chosen(commands: Sequence[Command], ns: argparse.Namespace, dest: str) -> Command:
    """The leaf command ``ns`` names (parsed by :func:`build_parser` from ``commands``)."""
    command = {c.name: c for c in commands}[getattr(ns, dest)]
    if command.subcommands:
        return chosen(command.subcommands, ns, command.dest)
    return command
