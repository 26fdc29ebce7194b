"""``iop-node usage``: the tokens of the runs that ended, summed by tenant or target.

:func:`parse_when` reads ``--since``/``--until`` (a time ago or an ISO 8601 date);
:func:`usage_json` is one line of ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time
from typing import Any, TextIO

from ..config import NodeConfig
from ..logs import escape_controls
from ..store import UsageTotal
from .errors import CliError
from .output import write_table
from .store_lock import open_store

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
    write_table(out, header, rows, numbers={1, 2, 3, 4})
    return 0
