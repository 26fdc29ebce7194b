"""Logging setup: human text or one JSON object per line, with context fields.

Fields passed as ``extra={...}`` (``run_id``, ``target``, ``status``,
``node_id``...) become keys of the JSON object, and ``key=value`` pairs in
text mode, so logs can be filtered by run without parsing messages.

A JSON line written while a span is current (a run's own tasks, a door request; see
:mod:`iop_trio.tracing`) carries its ``trace_id`` and ``span_id`` in hex, so a run's
lines and its trace find each other; with tracing off there is no span, and no keys.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from .tracing import current_ids

# attributes every LogRecord has; anything else came in through ``extra``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (unix), time (ISO 8601 UTC), level, logger, msg,
    trace_id and span_id (of the current span, if any), extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ids = current_ids()
        if ids is not None:
            entry["trace_id"], entry["span_id"] = ids
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


#: Control characters (line breaks included) as escapes, so that nothing a caller sends
#: (a cancel reason, a run id) can start a line of its own in a text log.
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, 0x85]} | {
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def escape_controls(text: str) -> str:
    """``text`` with control characters and line separators written as escapes."""
    return text.translate(_ESCAPES)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...`` on one line.

    Control characters in the message and the fields are escaped; a traceback
    follows on lines of its own, each indented, so a record's own lines are the
    only ones that start at the left margin.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = self._style.format(record)
        head, sep, message = line.partition(": ")
        line = f"{head}{sep}{escape_controls(message)}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={escape_controls(str(v))}" for k, v in extras.items())
        return line

    def formatException(self, ei: Any) -> str:
        return "\n".join("    " + line for line in super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + line for line in stack_info.splitlines())


def setup_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Route the root logger to ``stream`` (stderr) in the given format; replaces handlers."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # per-frame chatter from libraries stays out of info logs
    for noisy in ("trio-websocket", "httpx", "httpcore", "hypercorn"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
