"""``iop-node``: serve, inspect the store, submit through an edge, demo.

::

    iop-node serve --config node.yaml
    iop-node check-config --config node.yaml
    iop-node runs list|show|cancel ... --config node.yaml
    iop-node usage --config node.yaml [--since 7d] [--by tenant|target] [--json]
    iop-node submit --edge ws://127.0.0.1:8765 --token T --target echo/chat "prompt"
    iop-node demo            # edge + node + echo targets on loopback (make run)

Exit codes: 0 ok, 1 the run or command failed, 2 bad usage or configuration.

The package holds one module per command (``serve``, ``check``, ``runs``, ``usage``,
``submit``, ``edge``, ``demo``), the table of them all and their arguments
(``commands``, built by ``spec``), the store's lock and checks (``store_lock``), and
:func:`main`, which parses, runs and says a failure in one line (``errors``).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from contextlib import suppress
from typing import TextIO

from ..transport.server import lone_error
from .commands import build_parser, run_command
from .errors import CliError, report
from .store_lock import StoreLock, open_store
from .usage import parse_when

__all__ = ["CliError", "StoreLock", "main", "open_store", "parse_when"]


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command ``argv`` names (default: ``sys.argv[1:]``) and return its exit
    status. An expected failure is one line on stderr (with ``--debug``, its traceback
    too); a reader that went away (``| head``) ends it quietly with 0."""
    out = out or sys.stdout
    err = sys.stderr
    ns = build_parser().parse_args(argv)
    try:
        return run_command(ns, out, err)
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except BaseException as raised:
        # an expected failure says one line, even when it comes inside a nursery's group
        exc = lone_error(raised)
        if isinstance(exc, BrokenPipeError):
            _silence_stdout()
            return 0
        if ns.debug and not isinstance(exc, KeyboardInterrupt):
            traceback.print_exception(raised, file=err)
        code = report(exc, err)
        if code is None:
            raise
        return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so nothing flushes into a closed pipe at exit."""
    with suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
