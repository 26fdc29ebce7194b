"""``iop-node``: serve, inspect the store, submit through an edge, demo.

::

    iop-node serve --config node.yaml
    iop-node check-config --config node.yaml
    iop-node runs list|show|cancel ... --config node.yaml
    iop-node usage --config node.yaml [--since 7d] [--by tenant|target] [--json]
    iop-node submit --edge ws://127.0.0.1:8765 --token T --target echo/chat "prompt"
    iop-node demo            # edge + node + echo targets on loopback (make run)

Exit codes: 0 ok, 1 the run or command failed, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import logging
import os
import re
import secrets
import signal
import socket
import ssl
import sys
import time
import traceback
from collections.abc import Collection, Sequence
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import attrs
import trio

from . import __version__
from .adapters import AdapterError
from .config import ConfigError, NodeConfig, is_loopback, load_config, split_listen
from .lifecycle import RunState
from .logs import escape_controls, setup_logging
from .metrics import NodeMetrics
from .model import (
    EventKind,
    InvalidRequest,
    Limits,
    RunEvent,
    RunQuery,
    RunRecord,
    RunSpec,
    RunStatus,
    redact_url,
)
from .ops import OpsApp, record_json, serve_ops
from .runtime import Node
from .store import RunStore, StoreError, UsageTotal, unfinished_usage
from .transport.server import lone_error

log = logging.getLogger("iop_trio.node")


class CliError(Exception):
    """A failure to report in one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# --- the store lock -------------------------------------------------------------------------


class StoreLock:
    """An exclusive ``flock`` on ``<db>.lock``: one node per database file.

    ``acquire`` raises CliError when another process holds it; ``held_elsewhere``
    tells without taking it, and ``holder`` what the holder noted, without making or
    writing anything. A node notes its ops URL and which file its store is.
    """

    def __init__(self, db_path: str) -> None:
        self.path = f"{db_path}.lock"
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"<StoreLock {self.path} {'held' if self._fd is not None else 'free'}>"

    def _try(self) -> bool:
        try:
            Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise CliError(f"cannot open the store's lock {self.path}: {exc.strerror}", 2) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def acquire(self) -> None:
        if not self._try():
            raise CliError(f"another node is using this store ({self.path} is locked)", code=2)

    def note(self, *lines: str) -> None:
        """Write ``lines`` after the pid (e.g. the ops URL, for other commands to find)."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, "\n".join([str(os.getpid()), *lines, ""]).encode(), 0)

    def read(self) -> list[str]:
        """What the holder wrote: its pid, then its notes ([] if none)."""
        try:
            return Path(self.path).read_text().splitlines()
        except OSError:
            return []

    def holder(self) -> list[str] | None:
        """What the process holding the lock wrote (its pid, then its notes), or None
        when none holds it (or there is no lock file). Makes and writes nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self.read()
        finally:
            os.close(fd)  # and with it a shared lock taken
        return None

    def held_elsewhere(self) -> bool:
        if self._try():
            self.release()
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: How a node notes in its lock which file its store is: ``store <st_dev>:<st_ino>``.
STORE_NOTE = "store "


def store_note(db_path: str) -> str:
    """The note that says which file ``db_path`` is now (see :data:`STORE_NOTE`)."""
    found = os.stat(db_path)
    return f"{STORE_NOTE}{found.st_dev}:{found.st_ino}"


def require_store(config: NodeConfig) -> None:
    """CliError unless the config names a store that a node has kept runs in, and, if a
    node runs on it, the file that node has open (not one put in its place)."""
    if config.store.kind == "memory":
        raise CliError(f"{config.source}: store.kind is memory, so the node keeps no runs to read")
    path = config.store.path
    holder = StoreLock(path).holder()
    noted = [n for n in holder or () if n.startswith(STORE_NOTE)]
    if holder and noted:
        try:
            now: str | None = store_note(path)
        except OSError:
            now = None
        if now != noted[0]:
            raise CliError(
                f"the run store {path} was {'deleted' if now is None else 'replaced'} under "
                f"the node that runs on it (pid {holder[0]}): that node refuses new runs, and "
                "an ERROR line in its log names the copy it made of its runs "
                "(docs/operations.md, 'When the store file is deleted')"
            )
    if not Path(path).exists():
        raise CliError(
            f"no run store at {config.store.path}: no node has run with this config yet "
            f"(store.path in {config.source})"
        )


def check_store_writable(config: NodeConfig) -> None:
    """CliError (exit 2) unless this process may write the store the config names: its
    folder (made 0700 if need be; SQLite makes its WAL, and the node its lock, there) and
    the file, if there is one. A mode, an owner, a read-only mount or an immutable file
    can each forbid it."""
    if config.store.kind != "sqlite":
        return
    db = Path(config.store.path)
    elsewhere = f"point store.path (in {config.source}) at one it may"
    effective = os.access in os.supports_effective_ids
    try:
        db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(
            f"cannot make the run store's folder {db.parent}: {exc.strerror}; make it, or "
            f"{elsewhere}",
            code=2,
        ) from None
    if not os.access(db.parent, os.W_OK | os.X_OK, effective_ids=effective):
        raise CliError(
            f"the node may not write the run store's folder {db.parent}: make it writable "
            f"for this user, or {elsewhere}",
            code=2,
        )
    if db.exists() and not os.access(db, os.W_OK, effective_ids=effective):
        raise CliError(
            f"the node may not write the run store's file {db}: make it writable for this "
            f"user (chmod u+w), or {elsewhere}",
            code=2,
        )


def open_store(config: NodeConfig, *, existing: bool = False) -> RunStore:
    """The store the config names (made if need be). With ``existing`` (the ``runs``
    commands, which read what a node kept) a store that is not there is a CliError,
    not an empty store made on the spot."""
    if existing:
        require_store(config)
    if config.store.kind == "memory":
        from .store.memory import MemoryStore

        return MemoryStore()
    from .store.sqlite import SqliteStore

    Path(config.store.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return SqliteStore(config.store.path, synchronous=config.store.synchronous)


# --- serve ----------------------------------------------------------------------------------


def _log_run_end(event: RunEvent, record: RunRecord) -> None:
    if not event.kind.terminal:
        return
    started = record.started if record.started is not None else record.created
    log.info(
        "run %s %s",
        record.run_id,
        event.kind.value,
        extra={
            "run_id": record.run_id,
            "target": record.target,
            "status": event.kind.value,
            "reason": event.reason,
            "background": record.background,
            "queued_s": round(started - record.created, 3),
            "run_s": round(event.time - started, 3) if record.started is not None else 0.0,
        },
    )


async def _prune_loop(store: RunStore, config: NodeConfig) -> None:
    days = config.store.retention_days
    if days <= 0:
        return
    while True:
        removed = await store.prune(finished_before=time.time() - days * 86400)
        if removed:
            log.info("pruned %d runs older than %g days", removed, days, extra={"pruned": removed})
        await trio.sleep(config.store.prune_interval)


async def serve(
    config: NodeConfig,
    *,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Run the node of ``config`` until SIGTERM/SIGINT (or ``stop``), then drain; returns
    the exit code.

    The first signal stops admission, cancels queued runs, gives running ones
    ``runtime.drain_timeout`` seconds and cancels the rest (status recorded);
    a second signal cancels everything at once.
    """
    from .transport import Backoff, NodeLink, SessionSettings

    check_store_writable(config)
    lock = StoreLock(config.store.path) if config.store.kind == "sqlite" else None
    if lock is not None:
        lock.acquire()
    store = open_store(config)
    try:
        node = Node(
            node_id=config.node_id,
            adapters=config.build_adapters(),
            targets=config.target_specs(),
            limits=config.limits(),
            store=store,
        )
        node.event_listeners.append(_log_run_end)
        metrics = NodeMetrics(node)
        metrics.attach()
        ops_stop = trio.Event()
        async with node.running(), trio.open_nursery() as ops:
            # the ops endpoints outlive the rest, so /healthz says "draining" during a drain
            notes: list[str] = []  # for the lock, the ops URL first
            if config.metrics.address is not None:
                host, port = config.metrics.address
                app = OpsApp(
                    node,
                    metrics,
                    token=config.ops_token(),
                    open_metrics=config.metrics.open_metrics,
                )
                try:
                    bound = await ops.start(partial(serve_ops, app, host, port, shutdown=ops_stop))
                except OSError as exc:
                    raise CliError(
                        f"cannot listen on {host}:{port} (metrics.listen): {exc.strerror or exc}"
                    ) from None
                log.info("metrics on http://%s:%d/metrics", host, bound)
                notes.append(f"http://{host}:{bound}")
            if lock is not None:  # the store is open: which file it is, for the runs commands
                lock.note(*notes, store_note(config.store.path))
            async with trio.open_nursery() as nursery:
                link: NodeLink | None = None
                if config.edge.url:
                    link = NodeLink(
                        node,
                        config.edge.url,
                        token=config.edge_token(),
                        settings=SessionSettings(
                            ping_interval=config.edge.ping_interval,
                            ping_timeout=config.edge.ping_timeout,
                            max_message_size=config.edge.max_message_size,
                        ),
                        backoff=Backoff(
                            initial=config.edge.backoff_initial, maximum=config.edge.backoff_max
                        ),
                        ssl_context=config.edge_ssl_context(),
                    )
                    metrics.watch_link(link)
                    nursery.start_soon(link.run)
                nursery.start_soon(_prune_loop, store, config)
                log.info(
                    "node %s serving %s",
                    config.node_id,
                    ", ".join(node.targets),
                    extra={"node_id": config.node_id, "version": __version__},
                )
                task_status.started(node)
                await _wait_and_drain(node, config.runtime.drain_timeout, stop)
                if link is not None:
                    await link.aclose("node stopping")
                nursery.cancel_scope.cancel()
            ops_stop.set()
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
        if lock is not None:
            lock.release()
    log.info("node %s stopped", config.node_id)
    return 0


async def _wait_and_drain(node: Node, grace: float, stop: trio.Event | None = None) -> None:
    """Wait for SIGTERM or SIGINT (or ``stop``), then drain ``node``; a second signal
    cancels every run at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        why = "stop"
        async with trio.open_nursery() as waiting:

            async def on_signal() -> None:
                nonlocal why
                why = signal.Signals(await signals.__anext__()).name
                waiting.cancel_scope.cancel()

            waiting.start_soon(on_signal)
            if stop is not None:
                await stop.wait()
                waiting.cancel_scope.cancel()
        log.warning(
            "%s: draining (running runs get %gs; a second signal cancels them now)",
            why,
            grace,
        )
        async with trio.open_nursery() as nursery:

            async def second_signal() -> None:
                await signals.__anext__()
                log.warning("second signal: cancelling every run now")
                node.manager.cancel_all("node_shutdown")

            nursery.start_soon(second_signal)
            cancelled = await node.manager.drain(grace)
            nursery.cancel_scope.cancel()
    log.info("drained; %d runs were cancelled", cancelled, extra={"cancelled": cancelled})


# --- runs -----------------------------------------------------------------------------------


def _event_json(event: RunEvent) -> dict[str, Any]:
    data = attrs.asdict(event, recurse=True)
    data["kind"] = event.kind.value
    if event.kind is not EventKind.DELTA:
        del data["tokens"]  # only a delta holds any
    return {k: v for k, v in data.items() if v not in ("", None)}


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


async def runs_list(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    store = open_store(config, existing=True)
    try:
        statuses = [RunStatus(s) for s in ns.status or ()]
        records = await store.list_runs(
            RunQuery(statuses, target=ns.target or "", tenant=ns.tenant, limit=ns.limit)
        )
    finally:
        await store.aclose()
    if ns.json:  # JSON Lines: one run a line, so a pipe can take them one by one
        for record in records:
            out.write(json.dumps(record_json(record)) + "\n")
        return 0
    # a caller chose the run id, the target and the reason (a cancel's): escaped, so no
    # control character can forge a row or retitle the terminal
    rows = [
        tuple(
            escape_controls(cell)
            for cell in (
                r.run_id,
                r.target,
                r.tenant or "-",
                str(r.priority),
                r.status.value + (f"({r.reason})" if r.reason else ""),
                "bg" if r.background else "fg",
                _when(r.created),
            )
        )
        for r in records
    ]
    header = ("RUN ID", "TARGET", "TENANT", "PRI", "STATUS", "MODE", "CREATED")
    _write_table(out, header, rows, numbers={3})
    return 0


def _write_table(
    out: TextIO,
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    numbers: Collection[int] = (),
) -> None:
    """``rows`` under ``header``, every column as wide as its widest cell (so no cell
    breaks the table), the columns in ``numbers`` aligned right. The cells must be
    escaped already (:func:`escape_controls`)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if i in numbers else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        out.write("  ".join(cells).rstrip() + "\n")


async def runs_show(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    store = open_store(config, existing=True)
    try:
        record = await store.get(ns.run_id)
        events = await store.events(ns.run_id) if record is not None and ns.events else []
    finally:
        await store.aclose()
    if record is None:
        raise CliError(f"no run {ns.run_id!r} in {config.store.path}")
    if ns.json:
        data = record_json(record)
        if ns.events:
            data["events"] = [_event_json(e) for e in events]
        json.dump(data, out, indent=2)
        out.write("\n")
        return 0
    excerpt = record.prompt or " / ".join(f"{role}: {text}" for role, text in record.messages)
    excerpt = escape_controls(excerpt[:77] + ("..." if len(excerpt) > 77 else ""))
    ended = record.finished if record.finished is not None else time.time()
    took = f"{ended - record.started:.2f}s" if record.started is not None else "-"
    for key, value in [
        ("run", record.run_id),
        ("target", record.target),
        ("model", record.target.split("/", 1)[-1].split("@")[0]),
        ("prompt", excerpt or "-"),
        ("ran", took + ("" if record.finished is not None or took == "-" else " so far")),
        ("status", record.status.value),
        ("reason", record.reason or "-"),
        ("message", record.message or "-"),
        ("mode", "background" if record.background else "foreground"),
        ("tenant", record.tenant or '"" (default)'),
        ("priority", str(record.priority)),
        ("created", _when(record.created)),
        ("started", _when(record.started)),
        ("finished", _when(record.finished)),
        ("events", str(record.last_seq)),
    ] + ([("retry", f"after {record.retry_after:g}s")] if record.retry_after else []):
        out.write(f"{key:>9}: {escape_controls(value)}\n")
    if record.usage is not None:
        u = record.usage
        reason = escape_controls(u.done_reason) + " " if u.done_reason else ""
        guessed = [k for k, e in (("in", u.prompt_estimated), ("out", u.completion_estimated)) if e]
        note = f" (estimated: {', '.join(guessed)})" if guessed else ""
        out.write(f"{'usage':>9}: {reason}in={u.prompt_tokens} out={u.completion_tokens}{note}\n")
    for e in events:
        detail = repr(e.text) if e.text else " ".join(x for x in (e.reason, e.message) if x)
        out.write(f"  #{e.seq:<5} {e.kind.value:<11} {escape_controls(detail)}\n")
    return 0


async def runs_cancel(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    """Through the running node's ops endpoint, or straight in the store if no node runs."""
    require_store(config)
    if StoreLock(config.store.path).held_elsewhere():
        return await _cancel_via_node(config, ns, out)
    lock = StoreLock(config.store.path)
    lock.acquire()
    store = open_store(config, existing=True)
    try:
        record = await store.get(ns.run_id)
        if record is None:
            raise CliError(f"no run {ns.run_id!r} in {config.store.path}")
        if record.status.terminal:
            out.write(f"{ns.run_id}: already {record.status.value}\n")
            return 0
        usage = None
        if record.status is RunStatus.RUNNING:  # its node died: settled as a restart would
            sent = sum(e.tokens for e in await store.events(ns.run_id))
            usage = unfinished_usage(record, sent, config.runtime.chars_per_token)
        event = RunState(record).transition(
            RunStatus.CANCELLED,
            time=time.time(),
            reason=ns.reason,
            message="cancelled from the command line while no node was running",
            usage=usage,
        )
        await store.append(event)
    finally:
        await store.aclose()
        lock.release()
    out.write(f"{ns.run_id}: cancelled (no node was running)\n")
    return 0


# --- usage ----------------------------------------------------------------------------------


#: A time ago, as ``--since`` takes it: a number and a unit.
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, *, now: float, flag: str) -> float:
    """The unix time ``text`` names: a time ago (``90m``, ``24h``, ``7d``, ``2w``) before
    ``now``, or an ISO 8601 date or date and time (``2025-03-14``, ``2025-03-14T10:00``,
    ``2025-03-14 10:00:00+02:00``; without a zone, local time, as ``runs list`` shows
    times). CliError (exit 2) naming ``flag`` for anything else."""
    ago = _AGO.fullmatch(text.strip())
    if ago:
        return now - float(ago[1]) * _UNITS[ago[2]]
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except (ValueError, OverflowError, OSError):
        raise CliError(
            f"{flag} {text!r} is neither a date and time (2025-03-14, 2025-03-14T10:00, "
            "2025-03-14T10:00:00+02:00) nor a time ago (90m, 24h, 7d)",
            code=2,
        ) from None


def usage_json(by: str, total: UsageTotal) -> dict[str, Any]:
    """One line of ``usage --json``: the group's name under ``tenant`` or ``target``."""
    return {
        by: total.name,
        "runs": total.runs,
        "prompt_tokens": total.prompt_tokens,
        "completion_tokens": total.completion_tokens,
        "estimated_prompt_tokens": total.estimated_prompt_tokens,
        "estimated_completion_tokens": total.estimated_completion_tokens,
    }


async def usage_command(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    """The tokens of the runs that ended from ``--since`` until ``--until``, by tenant or
    target, from the store's records (see :meth:`RunStore.usage_totals`)."""
    now = time.time()
    since = None if ns.since is None else parse_when(ns.since, now=now, flag="--since")
    until = None if ns.until is None else parse_when(ns.until, now=now, flag="--until")
    if since is not None and until is not None and until < since:
        raise CliError(f"--until {ns.until!r} is before --since {ns.since!r}", code=2)
    store = open_store(config, existing=True)
    try:
        totals = await store.usage_totals(by=ns.by, since=since, until=until)
    finally:
        await store.aclose()
    if ns.json:  # JSON Lines, as runs list --json: one group a line
        for total in totals:
            out.write(json.dumps(usage_json(ns.by, total)) + "\n")
        return 0
    # a tenant's or target's name is a caller's or an old store's: escaped, as in runs list
    rows = [
        (
            escape_controls(t.name) if t.name else "(default)",
            str(t.runs),
            str(t.prompt_tokens),
            str(t.completion_tokens),
            str(t.estimated_tokens),
        )
        for t in totals
    ]
    header = (ns.by.upper(), "RUNS", "PROMPT", "COMPLETION", "ESTIMATED")
    _write_table(out, header, rows, numbers={1, 2, 3, 4})
    return 0


async def _cancel_via_node(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    import httpx

    notes = [n for n in StoreLock(config.store.path).read()[1:] if n.startswith("http")]
    if not notes:
        raise CliError(
            "a node is running on this store but has no ops endpoint (metrics.listen is "
            "empty): cancel through the edge"
        )
    url = f"{notes[0]}/runs/{ns.run_id}/cancel"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            token = config.ops_token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            response = await client.post(url, params={"reason": ns.reason}, headers=headers)
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the running node at {url}: {exc}") from None
    if response.status_code == 404:
        raise CliError(f"the node has no run {ns.run_id!r}")
    if response.status_code == 401:
        raise CliError(
            "the node's ops port refused the request: the node and this command need the "
            "same metrics.token (or token_file) in the config"
        )
    if response.status_code != 200:
        raise CliError(f"the node answered {response.status_code}: {response.text.strip()}")
    data = response.json()
    verb = "cancelled" if data.get("cancelled") else f"already {data.get('status')}"
    out.write(f"{ns.run_id}: {verb}\n")
    return 0


# --- submit ---------------------------------------------------------------------------------


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
    from .transport import open_runner

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
        from .config import read_secret_file

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
        raise _submit_failure(lone_error(exc), url) from None
    out.write("\n")
    assert last is not None
    reason = f" ({last.reason}{': ' + last.message if last.message else ''})" if last.reason else ""
    hint = f"; retry after {last.retry_after:g}s" if last.retry_after else ""
    err.write(f"{last.kind.value}{reason}{hint}\n")
    return 0 if last.kind.value == "succeeded" else 1


def _submit_failure(exc: BaseException, url: str) -> BaseException:
    """The one line a failed submit prints for ``exc`` (a CliError), or ``exc`` itself
    for what is not an expected failure (a bug, or Ctrl-C)."""
    from trio_websocket import (
        ConnectionClosed,
        ConnectionRejected,
        ConnectionTimeout,
        HandshakeError,
    )

    from .transport import RemoteError, ReplyTimeout, SessionClosed
    from .transport.tls import TLSFailed

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


# --- edge -----------------------------------------------------------------------------------


async def edge_command(ns: argparse.Namespace, out: TextIO) -> int:
    """The reference edge, until SIGTERM or SIGINT: nodes dial /node, clients /client."""
    from .config import read_secret_file
    from .edge import Edge
    from .edge.front_door import serve_door
    from .edge.identities import Identities, IdentityError
    from .transport.guard import ConnectionBounds
    from .transport.tls import server_context

    try:
        if ns.listen.startswith(":"):  # the edge is told its host; no default here
            raise ValueError(ns.listen)
        host, port = split_listen(ns.listen)
    except ValueError:
        raise CliError(f"--listen must be host:port, not {ns.listen!r}", code=2) from None
    identities = token = None
    try:
        if ns.identities is not None:
            identities = Identities.load(ns.identities)
        elif ns.token_file is not None:
            token = read_secret_file(ns.token_file, "--token-file")
        else:
            token = os.environ.get("IOP_EDGE_TOKEN") or None
    except IdentityError as exc:
        raise CliError(str(exc), code=2) from None
    if identities is None and token is None:
        raise CliError(
            "the edge needs who may use it: --identities FILE (a token per caller and "
            "node), --token-file FILE or IOP_EDGE_TOKEN (one shared token)",
            code=2,
        )
    context = None
    if ns.cert_file is None and (ns.key_file or ns.client_ca_file):
        raise CliError("--key-file and --client-ca-file go with --cert-file (TLS)", code=2)
    if ns.cert_file is not None:
        read_secret_file(
            ns.key_file or ns.cert_file, "--key-file" if ns.key_file else "--cert-file"
        )
        try:
            context = server_context(
                cert_file=ns.cert_file, key_file=ns.key_file, client_ca_file=ns.client_ca_file
            )
        except (OSError, ssl.SSLError) as exc:
            raise CliError(f"TLS files: {exc}", code=2) from None
    door_address = None
    if ns.openai_listen is not None:
        try:
            door_address = split_listen(ns.openai_listen)
        except ValueError:
            raise CliError(
                f"--openai-listen must be host:port, not {ns.openai_listen!r}", code=2
            ) from None
    try:
        bounds = ConnectionBounds(
            max_connections=ns.max_connections,
            max_unproven_per_peer=ns.max_unproven_per_peer,
            handshake_timeout=ns.handshake_timeout,
        )
    except ValueError as exc:
        raise CliError(f"connection bounds: {exc}", code=2) from None
    edge = Edge(
        token=token,
        identities=identities,
        ssl_context=context,
        edge_id=ns.edge_id,
        bounds=bounds,
    )
    if identities is None:
        log.warning(
            "edge: one shared token: whoever holds it may use every target, read, follow "
            "and cancel every run and pose as any node, and nothing bounds one caller's "
            "rate; give each caller and node a token of its own with --identities "
            "(docs/security.md)"
        )
    refused: tuple[str, OSError] | None = None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            listening = ns.listen
            try:
                await nursery.start(edge.serve, host, port)
                out.write(f"edge listening on {edge.url} (nodes: {edge.node_url}, ")
                out.write(f"clients: {edge.client_url})\n")
                if door_address is not None:
                    listening = ns.openai_listen
                    door_port = await nursery.start(serve_door, edge, *door_address)
                    scheme = "http" if ns.cert_file is None else "https"
                    door_host = door_address[0]
                    shown = f"[{door_host}]" if ":" in door_host else door_host
                    out.write(f"OpenAI-compatible API on {scheme}://{shown}:{door_port}/v1\n")
            except OSError as exc:  # raised outside the nursery, so it is not a group
                refused = listening, exc
            else:
                out.flush()
                async for _ in signals:
                    log.info("edge: stopping")
                    break
            nursery.cancel_scope.cancel()
    if refused is not None:
        where, error = refused
        raise CliError(f"cannot listen on {where}: {error.strerror or error}")
    return 0


# --- demo -----------------------------------------------------------------------------------


DEMO_TOKEN = "demo-token"
#: Seconds ``check-config --probe`` waits for the edge's WebSocket to open.
PROBE_CONNECT_TIMEOUT = 5.0


DEMO_CONFIG = """\
# written by `iop-node demo`: the demo's node, for `iop-node runs list --config` this file
node_id: demo-node
adapters:
  echo: {{kind: echo, delay: 0.05, concurrency: 8}}
targets:
  - {{adapter: echo, model: chat, concurrency: 2, params: {{delay: 0.08}}}}
  - {{adapter: echo, model: fast, concurrency: 4, params: {{delay: 0}}}}
runtime: {{concurrency: 4, max_queued: 100, queue_timeout: 30, drain_timeout: 5}}
store: {{path: demo.db}}
metrics: {{listen: "127.0.0.1:{metrics_port}", token_file: demo.ops-token}}
edge: {{url: "ws://127.0.0.1:{edge_port}/node", token_file: demo.token}}
"""


def _free_port() -> int:
    """A port on 127.0.0.1 free just now (for the demo's metrics, asked for port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _write_demo_files(folder: Path, edge_port: int, metrics_port: int) -> tuple[Path, Path]:
    """The demo node's config, the edge's token and the ops port's (a new random one,
    so that ``runs cancel`` and ``GET /runs/<id>`` work on the demo), private, in
    ``folder``."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_file = folder / "demo.token"
    token_file.write_text(DEMO_TOKEN + "\n")
    token_file.chmod(0o600)
    ops_token = folder / "demo.ops-token"
    ops_token.touch(mode=0o600)
    ops_token.chmod(0o600)
    ops_token.write_text(secrets.token_urlsafe(24) + "\n")
    config_path = folder / "demo.yaml"
    config_path.write_text(DEMO_CONFIG.format(metrics_port=metrics_port, edge_port=edge_port))
    return config_path, token_file


async def demo(ns: argparse.Namespace, out: TextIO) -> int:
    """An edge (with its OpenAI-compatible API) and a node with echo targets, on loopback,
    until Ctrl-C. The node is an ordinary ``serve`` of a config written to ``ns.var``: its
    runs are kept in a SQLite file there and its metrics are served."""
    from .edge import Edge
    from .edge.front_door import serve_door

    folder = Path(ns.var)
    edge = Edge(token=DEMO_TOKEN, edge_id="demo-edge")
    stop = trio.Event()
    async with trio.open_nursery() as edge_nursery:
        listening = f"127.0.0.1:{ns.port}"
        try:
            port = await edge_nursery.start(edge.serve, "127.0.0.1", ns.port)
            listening = f"127.0.0.1:{ns.api_port}"
            api_port = await edge_nursery.start(serve_door, edge, "127.0.0.1", ns.api_port)
        except OSError as exc:
            raise CliError(f"cannot listen on {listening}: {exc.strerror or exc}") from None
        metrics_port = ns.metrics_port or _free_port()
        config_path, token_file = _write_demo_files(folder, port, metrics_port)
        config = load_config(config_path)
        async with trio.open_nursery() as node_nursery:
            await node_nursery.start(partial(serve, config, stop=stop))
            handle = await edge.wait_for_node("demo-node")
            exe = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "iop-node"
            api = f"http://127.0.0.1:{api_port}/v1"
            out.write(
                f"\niop-trio {__version__} demo: node {handle.node_id!r} serves "
                f"{', '.join(sorted(handle.targets))}\n"
                f"  edge (proto-socket)  ws://127.0.0.1:{port}  (token: {DEMO_TOKEN})\n"
                f"  OpenAI-compatible    {api}\n"
                f"  metrics              http://127.0.0.1:{metrics_port}/metrics  "
                f"(and /readyz)\n"
                f"  runs are kept in     {folder / 'demo.db'}\n\n"
            )
            async with edge.run(RunSpec("echo/chat", "hello from the iop-trio demo")) as stream:
                out.write("demo run: ")
                async for event in stream:
                    out.write(event.text)
                    out.flush()
            out.write(f"  [{stream.last.kind.value if stream.last else '?'}]\n\n")
            chat = json.dumps(
                {"model": "echo/chat", "messages": [{"role": "user", "content": "stream me"}]}
            )
            out.write(
                "try, from another terminal:\n"
                f"  .venv/bin/{exe} submit --edge ws://127.0.0.1:{port} --token-file "
                f'{token_file} --target echo/chat "stream me back"\n'
                f"  .venv/bin/{exe} runs list --config {config_path}\n"
                f"  .venv/bin/{exe} runs cancel RUN_ID --config {config_path}\n"
                f"  curl -s {api}/chat/completions -H 'Authorization: Bearer {DEMO_TOKEN}' "
                f"-H 'Content-Type: application/json' -d '{chat}'\n\n"
                "each run is logged here as it ends; Ctrl-C stops (running runs are drained "
                "first).\n"
            )
            out.flush()
            if ns.once:
                stop.set()
        edge_nursery.cancel_scope.cancel()
    return 0


# --- argument parsing -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop-node", description="An IOP inference node.")
    parser.add_argument("--version", action="version", version=f"iop-node {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="with a failure's one line, print its traceback"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            default=os.environ.get("IOP_CONFIG", "node.yaml"),
            help="the node's YAML config (default: $IOP_CONFIG or node.yaml)",
        )

    p = sub.add_parser("serve", help="run the node until SIGTERM/SIGINT")
    with_config(p)
    p = sub.add_parser("check-config", help="validate the config and print what it sets up")
    with_config(p)
    p.add_argument(
        "--probe",
        action="store_true",
        help="also ask each engine whether it serves its target's model, and open a "
        "connection to the edge with the node's token (exit 1 if any cannot be reached)",
    )

    runs = sub.add_parser("runs", help="inspect or cancel runs in the node's store")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    p = runs_sub.add_parser("list", help="newest runs first")
    with_config(p)
    p.add_argument(
        "--status",
        action="append",
        choices=[s.value for s in RunStatus],
        help="only runs with this status (repeat for several)",
    )
    p.add_argument("--target", help="only this target's runs (adapter/model[@profile])")
    p.add_argument("--tenant", help='only this tenant\'s runs ("" is the default tenant)')
    p.add_argument("--limit", type=int, default=50, help="at most this many (default %(default)s)")
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line (JSON Lines), newest first"
    )
    p = runs_sub.add_parser("show", help="one run, with --events its event log")
    with_config(p)
    p.add_argument("run_id", help="the run's id (as runs list shows it)")
    p.add_argument("--events", action="store_true", help="also print its event log")
    p.add_argument("--json", action="store_true", help="the run (and events) as JSON")
    p = runs_sub.add_parser("cancel", help="cancel a live run")
    with_config(p)
    p.add_argument("run_id", help="the run's id")
    p.add_argument(
        "--reason", default="cancelled", help="recorded as the run's reason (default %(default)s)"
    )

    p = sub.add_parser(
        "usage",
        help="prompt and completion tokens of the runs that ended, by tenant or target",
    )
    with_config(p)
    p.add_argument(
        "--since",
        metavar="WHEN",
        help="runs that ended then or later: a date and time (2025-03-14, 2025-03-14T10:00, "
        "local time unless it names a zone) or a time ago (90m, 24h, 7d); default: all",
    )
    p.add_argument(
        "--until", metavar="WHEN", help="runs that ended before then (as --since); default: now"
    )
    p.add_argument(
        "--by",
        choices=["tenant", "target"],
        default="tenant",
        help="sum by the runs' tenant or target (default %(default)s)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line (JSON Lines), by name"
    )

    p = sub.add_parser("submit", help="submit a run through an edge and stream it")
    p.add_argument(
        "--edge",
        default=os.environ.get("IOP_EDGE", "ws://127.0.0.1:8765"),
        help="the edge's ws:// or wss:// URL (default: $IOP_EDGE or %(default)s)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("IOP_TOKEN"),
        help="the edge's token (default: $IOP_TOKEN); on the command line ps shows it, so "
        "prefer IOP_TOKEN or --token-file",
    )
    p.add_argument("--token-file", metavar="FILE", help="read the token from a private file")
    p.add_argument("--target", required=True, help="adapter/model[@profile], e.g. echo/chat")
    p.add_argument(
        "--background",
        action="store_true",
        help="print the run id once accepted and exit; the run goes on (see runs show)",
    )
    p.add_argument("--run-id", help="the run's id (resubmitting an id follows the run it names)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="JSON or text value")
    p.add_argument(
        "--priority", type=int, default=0, help="higher starts first (-1000..1000; default 0)"
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        metavar="SECONDS",
        help="wait at most this long for capacity (the target's bound applies if smaller)",
    )
    p.add_argument("prompt", help="the prompt (one argument; quote it)")

    p = sub.add_parser(
        "edge",
        help="run the reference edge: nodes dial ws(s)://HOST:PORT/node, clients /client",
    )
    p.add_argument("--listen", default="127.0.0.1:8765", help="host:port (default %(default)s)")
    p.add_argument("--edge-id", default="edge", help="the edge's name in HelloAck")
    p.add_argument(
        "--identities",
        metavar="FILE",
        help="a token per caller and node (see docs/security.md; iop-node hash-token)",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="one shared token, from a private file (or IOP_EDGE_TOKEN); never on the "
        "command line, where ps shows it",
    )
    p.add_argument("--cert-file", metavar="FILE", help="serve wss:// with this certificate")
    p.add_argument("--key-file", metavar="FILE", help="its private key (if not in --cert-file)")
    p.add_argument(
        "--client-ca-file", metavar="FILE", help="require client certificates from this CA"
    )
    p.add_argument(
        "--openai-listen",
        metavar="HOST:PORT",
        help="also serve an OpenAI-compatible API (POST /v1/chat/completions, GET /v1/models) "
        "there; its bearer tokens are the callers' (https with --cert-file, and client "
        "certificates with --client-ca-file, as on the WebSocket port)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection not authenticated within this is closed (default %(default)s)",
    )
    p.add_argument(
        "--max-unproven-per-peer",
        type=int,
        default=32,
        metavar="N",
        help="connections from one address that may wait to authenticate at once "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="connections at once, both ports together (default: the open-file limit less 64)",
    )

    sub.add_parser(
        "hash-token",
        help="read a token on stdin, print the sha256:... an edge's identities file keeps",
    )

    p = sub.add_parser("demo", help="edge + node + echo targets on loopback (make run)")
    p.add_argument("--port", type=int, default=8765, help="the edge's port (0: any free one)")
    p.add_argument(
        "--api-port",
        type=int,
        default=8080,
        help="the OpenAI-compatible API's port (0: any free one)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=9464, help="the node's metrics port (0: any free one)"
    )
    p.add_argument(
        "--var",
        default="var",
        metavar="DIR",
        help="where the demo writes its config, token and run store (default: ./var)",
    )
    p.add_argument("--once", action="store_true", help="exit after the demo run")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = sys.stderr
    ns = _parser().parse_args(argv)
    try:
        return _command(ns, out, err)
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, and let nothing flush at exit
        with suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as raised:
        # an expected failure says one line, even when it comes inside a nursery's group
        exc = lone_error(raised)
        if isinstance(exc, BrokenPipeError):
            with suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if ns.debug and not isinstance(exc, KeyboardInterrupt):
            traceback.print_exception(raised, file=err)
        if isinstance(exc, ConfigError):
            err.write(f"iop-node: {exc}\n")
            return 2
        if isinstance(exc, CliError):
            err.write(f"iop-node: {exc}\n")
            return exc.code
        if isinstance(exc, StoreError):
            err.write(f"iop-node: store: {exc}\n")
            return 1
        if isinstance(exc, KeyboardInterrupt):
            return 130
        raise


def _command(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run the command ``ns`` names; its failures are main's to say."""
    if ns.command == "demo":
        setup_logging("info")
        return trio.run(demo, ns, out)
    if ns.command == "submit":
        setup_logging("warning")
        return trio.run(submit, ns, out, err)
    if ns.command == "edge":
        setup_logging("info")
        return trio.run(edge_command, ns, out)
    if ns.command == "hash-token":
        from .edge.identities import token_digest

        token = sys.stdin.readline().strip()
        if not token:
            raise CliError("no token on stdin", code=2)
        out.write(token_digest(token) + "\n")
        return 0
    config = load_config(ns.config)
    if ns.command == "serve":
        setup_logging(config.logging.level, config.logging.format)
        for warning in config.warnings:
            log.warning("%s", warning)
        return trio.run(serve, config)
    for warning in config.warnings:
        err.write(f"iop-node: warning: {warning}\n")
    if ns.command == "check-config":
        return check_config(config, out, probe=ns.probe)
    setup_logging("warning")
    if ns.command == "usage":
        return trio.run(usage_command, config, ns, out)
    action = {"list": runs_list, "show": runs_show, "cancel": runs_cancel}[ns.runs_command]
    return trio.run(action, config, ns, out)


def check_config(config: NodeConfig, out: TextIO, *, probe: bool = False) -> int:
    """Build everything the config describes (nothing is started) and summarise it.

    With ``probe``, also ask each engine which models it serves and open a WebSocket
    to the edge with the node's token; 1 if any target or the edge cannot be reached.
    """
    from .store.memory import MemoryStore

    node = Node(
        node_id=config.node_id,
        adapters=config.build_adapters(),
        targets=config.target_specs(),
        limits=config.limits(),
        store=MemoryStore(),  # the configured store is not opened
    )
    config.edge_token()
    config.edge_ssl_context()  # its key file's mode, as serve checks it
    config.ops_token()
    limits = node.limits()
    out.write(f"{config.source}: ok\n")
    out.write(f"  node {config.node_id}, edge {redact_url(config.edge.url) or '(none)'}\n")
    where = config.store.path if config.store.kind == "sqlite" else "(in memory)"
    out.write(f"  store {config.store.kind} {where}\n")
    out.write(
        f"  runtime concurrency={limits.concurrency} max_queued={limits.max_queued} "
        f"queue_timeout={limits.queue_timeout:g}s\n"
    )
    for name, adapter in node.adapters.items():
        bound = limits.adapters[name]
        limit = _learned(node, f"adapter:{name}") or ("-" if bound is None else str(bound))
        out.write(f"  adapter {name} ({adapter.kind}) limit={limit}\n")
    for name in node.targets:
        limit = _learned(node, f"target:{name}") or str(limits.targets[name])
        out.write(f"  target {name} limit={limit}\n")
    for warning in config_warnings(config, limits):
        out.write(f"  warning: {warning}\n")
    if probe:
        return 0 if trio.run(probe_reach, config, node, out) else 1
    return 0


async def probe_reach(config: NodeConfig, node: Node, out: TextIO) -> bool:
    """Whether every target's engine serves its model and the edge takes the node's
    token; one line each on ``out``."""
    from .transport.tls import open_websocket

    reached = True
    try:
        unavailable = await node.probe_engines()
        await probe_signals(node, out)
    finally:
        for adapter in node.adapters.values():
            await adapter.aclose()
    for name, target in node.targets.items():
        why = unavailable.get(name)
        reached &= why is None
        said = f"serves {target.model!r}" if why is None else f"UNAVAILABLE: {why}"
        out.write(f"  probe target {name}: {said}\n")
    if config.edge.url:
        url = redact_url(config.edge.url)
        try:
            async with open_websocket(
                config.edge.url,
                token=config.edge_token(),
                ssl_context=config.edge_ssl_context(),
                max_message_size=config.edge.max_message_size,
                connect_timeout=PROBE_CONNECT_TIMEOUT,
            ) as ws:
                await ws.aclose()
            out.write(f"  probe edge {url}: reachable, the token is accepted\n")
        except Exception as exc:
            failure = _submit_failure(exc, url)
            if failure is exc:
                raise
            reached = False
            out.write(f"  probe edge: UNREACHABLE: {failure}\n")
    return reached


def _learned(node: Node, pool: str) -> str | None:
    """``auto MIN..MAX`` and the signal the pool will learn from; None if it is static."""
    if pool not in node.auto:
        return None
    auto, _ = node.auto[pool]
    url = node.adapter_of_pool(pool).signals_url
    signal = "latency" if url is None else f"engine metrics at {url}, else latency"
    return f"auto {auto.minimum}..{auto.maximum} (signal: {signal})"


async def probe_signals(node: Node, out: TextIO) -> None:
    """For each ``concurrency: auto`` pool, read its engine's metrics once, as the
    learner does when the node starts, and say which signal it will learn from."""
    for pool in node.auto:
        adapter = node.adapter_of_pool(pool)
        try:
            signals = await adapter.engine_signals(trio.current_time())
        except AdapterError as exc:
            said = (
                f"engine (its metrics cannot be read now: {exc.message}; "
                "counted as saturated until they can)"
            )
        else:
            if signals is None:
                said = "latency (the engine exposes no signals of its load)"
            else:
                said = f"engine ({signals.waiting:g} waiting"
                if signals.kv_usage is not None:
                    said += f", KV cache {signals.kv_usage:.0%} used"
                said += ")"
        out.write(f"  probe {pool.replace(':', ' ')} learns from {said}\n")


def config_warnings(config: NodeConfig, limits: Limits) -> list[str]:
    """Settings that are legal but probably not what the operator meant."""
    warnings = [
        f"target {name} has concurrency 0: it takes no runs until its limit is raised"
        for name, limit in limits.targets.items()
        if limit == 0
    ]
    if limits.queue_timeout == 0:
        warnings.append("runtime.queue_timeout is 0: a run that finds no room is rejected at once")
    edge_host = urlsplit(config.edge.url).hostname or ""
    if config.edge.url.startswith("ws://") and not is_loopback(edge_host):
        warnings.append(
            f"edge.url {redact_url(config.edge.url)} is not TLS and not on loopback: the token "
            "and every prompt cross the network in the clear (use wss://)"
        )
    for name, target in zip(limits.targets, config.targets, strict=True):
        if isinstance(target.concurrency, int) and target.concurrency > limits.concurrency:
            warnings.append(
                f"target {name} allows {target.concurrency} runs at once, more than the node's "
                f"runtime.concurrency {limits.concurrency}"
            )
    return warnings


if __name__ == "__main__":
    sys.exit(main())
