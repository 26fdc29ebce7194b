"""Logging setup: human text or one JSON object per line, with context fields.

Fields passed as ``extra={...}`` (``run_id``, ``target``, ``status``,
``node_id``...) become keys of the JSON object, and ``key=value`` pairs in
text mode, so logs can be filtered by run without parsing messages.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

# attributes every LogRecord has; anything else came in through ``extra``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (unix), time (ISO 8601 UTC), level, logger, msg, extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if extras:
            tail = " ".join(f"{k}={v}" for k, v in extras.items())
            first, sep, rest = line.partition("\n")
            line = f"{first} {tail}{sep}{rest}"
        return line


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
