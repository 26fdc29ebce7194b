"""Text logs keep one record on one line, whatever a caller puts in a field."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from iop_trio.cli.serve import log_run_end
from iop_trio.logs import escape_controls, setup_logging
from iop_trio.runtime import RunSpec

from .test_wire import echo_node

#: How every record's first line starts in text mode.
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ +\S+: ")


@pytest.fixture
def text_log() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    setup_logging("info", "text", buf)
    yield buf
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_control_characters_are_escaped():
    assert escape_controls("a\nb\r\tc\x1b[31m\u2028d") == "a\\x0ab\\x0d\\x09c\\x1b[31m\\u2028d"
    assert escape_controls("plain text, ünïcode") == "plain text, ünïcode"


def test_a_forged_line_stays_inside_its_record(text_log):
    log = logging.getLogger("iop_trio.test")
    forged = "ops\n2026-12-03 00:00:00,000 INFO    iop_trio.node: drained; 0 runs were cancelled"
    log.info("run %s cancelled: %s", "r1", forged, extra={"reason": forged})
    try:
        raise ValueError("one\ntwo")
    except ValueError:
        log.exception("failed")
    lines = text_log.getvalue().splitlines()
    starts = [line for line in lines if RECORD.match(line)]
    assert len(starts) == 2  # two records, however many lines
    assert all(RECORD.match(line) or line.startswith("    ") for line in lines)
    assert "ops\\x0a2026-12-03" in starts[0]


async def test_a_cancel_reason_cannot_forge_a_log_line(text_log):
    node = echo_node(("a", 1), delay=60)
    node.event_listeners.append(log_run_end)  # what `iop-node serve` logs at a run's end
    async with node.running():
        run_id = (await node.manager.submit(RunSpec("echo/a", "p"))).record.run_id
        await node.manager.cancel(run_id, "bye\nERROR forged: the node is on fire")
        await node.manager.wait_idle()
    lines = text_log.getvalue().splitlines()
    assert any("reason=bye\\x0aERROR forged" in line for line in lines), lines
    assert all(RECORD.match(line) or line.startswith("    ") for line in lines), lines


def test_json_logs_carry_the_text_as_it_was():
    buf = io.StringIO()
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        setup_logging("info", "json", buf)
        logging.getLogger("iop_trio.test").info("reason: %s", "a\nb", extra={"reason": "c\nd"})
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
    [line] = buf.getvalue().splitlines()
    entry = json.loads(line)
    assert (entry["msg"], entry["reason"]) == ("reason: a\nb", "c\nd")
