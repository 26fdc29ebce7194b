"""A node on a SQLite store that submits runs until it is killed (kill -9) by its parent.

    python tests/procs/crashy_node.py DB_PATH

Used by tests/test_crash_recovery.py. It prints one flushed line per fact the
parent may rely on, and only once the fact holds:

    ready                                  the node runs (unfinished runs interrupted)
    accepted RUN_ID TARGET bg|fg           submit() returned: the run is stored QUEUED
    stored RUN_ID SEQ KIND                 the store's append() returned for that event
    cancel RUN_ID                          the node was asked to cancel that run

The targets make every kind of end, and some runs that never end:

- ``echo/slow`` (concurrency 1): 2000 words at 50 ms each, so its first run
  stays RUNNING and every later one QUEUED until the kill;
- ``echo/fast`` (concurrency 3): a few words quickly, SUCCEEDED (every 5th
  one is cancelled right after it is accepted: CANCELLED);
- ``echo/flaky`` (concurrency 2): fails after 3 deltas, FAILED;
- ``echo/tiny`` (concurrency 1, one queued at most): like slow, so the rest
  are REJECTED(queue_full) at once.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.model import RunEvent, RunRecord
from iop_trio.runtime import Node, RunSpec, RuntimeLimits, TargetSpec
from iop_trio.store.sqlite import SqliteStore

TARGETS = [
    TargetSpec("echo", "slow", concurrency=1, params={"delay": 0.05}),
    TargetSpec("echo", "fast", concurrency=3, params={"delay": 0.002}),
    TargetSpec("echo", "flaky", concurrency=2, params={"delay": 0.002, "fail_after": 3}),
    TargetSpec("echo", "tiny", concurrency=1, max_queued=1, params={"delay": 0.05}),
]
LONG = "word " * 2000
SHORT = "one two three four five six"
# (target, prompt, background), round and round
PATTERN = [
    ("echo/fast", SHORT, False),
    ("echo/slow", LONG, True),
    ("echo/flaky", SHORT, False),
    ("echo/fast", SHORT, True),
    ("echo/tiny", LONG, False),
    ("echo/slow", LONG, False),
    ("echo/fast", SHORT, False),
    ("echo/flaky", SHORT, True),
]


def say(*words: object) -> None:
    print(*words, flush=True)


class ReportingStore(SqliteStore):
    """Says which events are stored: only after the store confirmed them."""

    async def create(
        self, record: RunRecord, event: RunEvent, *, then: Sequence[RunEvent] = ()
    ) -> None:
        await super().create(record, event, then=then)
        for stored in (event, *then):
            say("stored", stored.run_id, stored.seq, stored.kind.value)

    async def append(self, event: RunEvent) -> None:
        await super().append(event)
        say("stored", event.run_id, event.seq, event.kind.value)


async def main(db_path: str) -> None:
    store = ReportingStore(db_path)
    node = Node(
        node_id="crashy",
        adapters=[EchoAdapter()],
        targets=TARGETS,
        limits=RuntimeLimits(concurrency=8, max_queued=10_000, queue_timeout=3600.0),
        store=store,
    )
    async with node.running():
        say("ready")
        fast = 0
        for target, prompt, background in itertools.islice(itertools.cycle(PATTERN), 5000):
            submitted = await node.manager.submit(
                RunSpec(target, prompt, background=background), owner="parent"
            )
            run_id = submitted.record.run_id
            say("accepted", run_id, target, "bg" if background else "fg")
            if target == "echo/fast":
                fast += 1
                if fast % 5 == 0:
                    node.manager.cancel_nowait(run_id, "parent asked")
                    say("cancel", run_id)
            await trio.sleep(0.005)
        await trio.sleep_forever()  # the parent kills us long before


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
