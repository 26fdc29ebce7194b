"""``iop-node runs list|show|cancel``: what a node kept in its store, and cancelling.

``list`` and ``show`` read the store (with a node running on it or not); ``cancel`` goes
through the running node's ops endpoint, or, when no node runs, settles the run in the
store itself as a restart would.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, TextIO

import attrs

from ..config import NodeConfig
from ..lifecycle import RunState
from ..logs import escape_controls
from ..model import EventKind, RunEvent, RunQuery, RunStatus
from ..ops import record_json
from ..store import unfinished_usage
from .errors import CliError
from .output import local_time, write_table
from .store_lock import StoreLock, open_store, require_store


def event_json(event: RunEvent) -> dict[str, Any]:
    """``event`` as ``runs show --json --events`` prints it: its kind's name, and only
    the fields it has (``tokens`` only on a delta)."""
    data = attrs.asdict(event, recurse=True)
    data["kind"] = event.kind.value
    if event.kind is not EventKind.DELTA:
        del data["tokens"]  # only a delta holds any
    return {k: v for k, v in data.items() if v not in ("", None)}


async def runs_list(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    """The newest runs first, as a table or (``--json``) JSON Lines."""
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
                local_time(r.created),
            )
        )
        for r in records
    ]
    header = ("RUN ID", "TARGET", "TENANT", "PRI", "STATUS", "MODE", "CREATED")
    write_table(out, header, rows, numbers={3})
    return 0


async def runs_show(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    """One run's record (with ``--events`` its event log); CliError if there is none."""
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
            data["events"] = [event_json(e) for e in events]
        json.dump(data, out, indent=2)
        out.write("\n")
        return 0
    excerpt = record.prompt or " / ".join(f"{role}: {text}" for role, text in record.messages)
    excerpt = escape_controls(excerpt[:77] + ("..." if len(excerpt) > 77 else ""))
    ended = record.finished if record.finished is not None else time.time()
    took = f"{ended - record.started:.2f}s" if record.started is not None else "-"
    for key, value in (
        [
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
            ("created", local_time(record.created)),
            ("started", local_time(record.started)),
            ("finished", local_time(record.finished)),
            ("events", str(record.last_seq)),
        ]
        + ([("retry", f"after {record.retry_after:g}s")] if record.retry_after else [])
        + ([("replica", record.replica)] if record.replica else [])
    ):
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
        return await cancel_via_node(config, ns, out)
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


async def cancel_via_node(config: NodeConfig, ns: argparse.Namespace, out: TextIO) -> int:
    """Cancel through the ops endpoint the running node noted in its lock."""
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
