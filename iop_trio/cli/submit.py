"""``iop-node submit``: one run through an edge, streamed to the terminal.

:func:`submit_failure` turns what a failed connection to the edge raised into the one
line the command prints; ``check-config --probe`` says the edge's failures with it too.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import Any, TextIO

import trio

from ..model import InvalidRequest, RunSpec
from ..transport.server import lone_error
from .errors import CliError


def options_from_pairs(pairs: Sequence[str]) -> dict[str, Any]:
    """``["temperature=0.2", "stop=[\\"x\\"]"]`` -> dict; values parse as JSON, else stay text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"option {pair!r} is not key=value")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


async def submit(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Submit ``ns``'s run through the edge and stream its text to ``out`` (its id and
    its end on ``err``); 0 if it succeeded, 1 otherwise. With ``--background``, print
    its id once accepted and return 0."""
    from ..transport import open_runner

    try:
        options = options_from_pairs(ns.option or [])
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    spec = RunSpec(
        target=ns.target,
        prompt=ns.prompt,
        background=ns.background,
        run_id=ns.run_id,
        options=options,
        priority=ns.priority,
        queue_timeout=ns.queue_timeout,
    )
    token = ns.token
    if ns.token_file is not None:
        from ..config import read_secret_file

        token = read_secret_file(ns.token_file, "--token-file")
    url = ns.edge.rstrip("/")
    if not re.match(r"wss?://", url):
        raise CliError(f"--edge must be a ws:// or wss:// URL, not {ns.edge!r}", code=2)
    if not url.endswith("/client"):
        url += "/client"
    try:
        async with open_runner(url, token=token) as client, client.run(spec) as stream:
            if ns.background:  # it runs on without us: say its id and go
                out.write(f"{stream.run_id}\n")
                return 0
            err.write(f"run {stream.run_id}{' (existing)' if stream.existing else ''}\n")
            async for event in stream:
                if event.text:
                    out.write(event.text)
                    out.flush()
            last = stream.last
    except BaseException as exc:
        raise submit_failure(lone_error(exc), url) from None
    out.write("\n")
    assert last is not None
    reason = f" ({last.reason}{': ' + last.message if last.message else ''})" if last.reason else ""
    hint = f"; retry after {last.retry_after:g}s" if last.retry_after else ""
    err.write(f"{last.kind.value}{reason}{hint}\n")
    return 0 if last.kind.value == "succeeded" else 1


def submit_failure(exc: BaseException, url: str) -> BaseException:
    """The one line a failed submit prints for ``exc`` (a CliError), or ``exc`` itself
    for what is not an expected failure (a bug, or Ctrl-C)."""
    from trio_websocket import (
        ConnectionClosed,
        ConnectionRejected,
        ConnectionTimeout,
        HandshakeError,
    )

    from ..transport import RemoteError, ReplyTimeout, SessionClosed
    from ..transport.tls import TLSFailed

    if isinstance(exc, RemoteError):
        hint = f" (retry after {exc.retry_after:g}s)" if exc.retry_after else ""
        return CliError(f"the edge refused the run: {exc}{hint}")
    if isinstance(exc, InvalidRequest):
        return CliError(str(exc), code=2)
    if isinstance(exc, ConnectionRejected):
        hint = " (check --token)" if exc.status_code == 401 else ""
        return CliError(f"the edge refused the connection: HTTP {exc.status_code}{hint}")
    if isinstance(exc, TLSFailed):
        return CliError(f"cannot reach the edge at {url}: {exc}")
    if isinstance(exc, HandshakeError):
        cause = exc.__cause__
        why = (
            cause.strerror
            if isinstance(cause, OSError) and cause.strerror
            else "no answer in time"
            if isinstance(exc, ConnectionTimeout)
            else str(cause or exc) or type(exc).__name__
        )
        return CliError(f"cannot reach the edge at {url}: {why}")
    if isinstance(exc, OSError):
        return CliError(f"cannot reach the edge at {url}: {exc.strerror or exc}")
    if isinstance(exc, SessionClosed | ConnectionClosed | trio.BrokenResourceError):
        return CliError(f"lost the edge: {exc}")
    if isinstance(exc, ReplyTimeout):
        return CliError(f"the edge did not answer: {exc}")
    return exc
