"""What the read-only commands print: tables whose cells cannot break them, and times.

Shared by ``runs list`` and ``usage``; every cell a caller or an old store chose must be
escaped (:func:`~iop_trio.logs.escape_controls`) before it reaches :func:`write_table`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TextIO


def write_table(
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


def local_time(ts: float | None) -> str:
    """``ts`` as local ``YYYY-MM-DD HH:MM:SS``; ``-`` for None or 0 (never happened)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"
