"""Kill -9 a real node process mid-run, then restart on its database: nothing accepted is lost.

The child (tests/procs/crashy_node.py) prints what it knows to be stored; the
test synchronises only on those lines, never on time, and kills the child once
every kind of run it wants is there. A fresh Node on the same file then marks
the unfinished runs INTERRUPTED, and the test checks every run's log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import attrs
import pytest
import trio

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.model import RunQuery
from iop_trio.runtime import EventKind, Node, RunStatus
from iop_trio.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "procs"))
from crashy_node import PATTERN  # noqa: E402  (what the child submits)

pytestmark = pytest.mark.faults

CHILD = Path(__file__).resolve().parent / "procs" / "crashy_node.py"
TIMEOUT = 60  # seconds for the whole test; the child needs about one


@attrs.define
class ChildLog:
    """What the child said, line by line."""

    accepted: dict[str, str] = attrs.field(factory=dict)  # run_id -> target
    stored: dict[str, list[tuple[int, str]]] = attrs.field(factory=lambda: defaultdict(list))
    cancel_asked: set[str] = attrs.field(factory=set)
    ready: bool = False

    def feed(self, line: str) -> None:
        words = line.split()
        if words == ["ready"]:
            self.ready = True
        elif words[0] == "accepted":
            self.accepted[words[1]] = words[2]
        elif words[0] == "stored":
            self.stored[words[1]].append((int(words[2]), words[3]))
        elif words[0] == "cancel":
            self.cancel_asked.add(words[1])
        else:
            raise AssertionError(f"the child said {line!r}")

    def ended(self, target: str, kind: str) -> int:
        return sum(
            1
            for run_id, stored in self.stored.items()
            if self.accepted.get(run_id) == target and any(k == kind for _, k in stored)
        )

    def seen_enough(self) -> bool:
        slow = [r for r, t in self.accepted.items() if t == "echo/slow"]
        slow_deltas = sum(
            1 for r in slow for _, kind in self.stored.get(r, []) if kind == EventKind.DELTA.value
        )
        return (
            len(self.accepted) >= 40
            and len(slow) >= 3  # one RUNNING forever, the rest QUEUED
            and slow_deltas >= 2
            and self.ended("echo/fast", "succeeded") >= 3
            and self.ended("echo/fast", "cancelled") >= 1
            and self.ended("echo/flaky", "failed") >= 1
            and self.ended("echo/tiny", "rejected") >= 1
        )


class Lines:
    """Lines from a byte stream, as they come."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def next(self) -> str | None:
        """The next whole line, or None at end of stream."""
        while b"\n" not in self._buffer:
            data = await self._stream.receive_some(65536)
            if not data:
                return None
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


async def run_child_until_killed(db: Path, stderr_path: Path) -> tuple[ChildLog, int]:
    log = ChildLog()
    with stderr_path.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(
            [sys.executable, str(CHILD), str(db)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert proc.stdout is not None
            lines = Lines(proc.stdout)
            while not log.seen_enough():
                line = await lines.next()
                if line is None:
                    code = await proc.wait()
                    stderr.flush()
                    said = await trio.Path(stderr_path).read_text()
                    raise AssertionError(f"the child ended early ({code}):\n{said}")
                log.feed(line)
            proc.kill()  # SIGKILL: no cleanup of any kind in the child
            returncode = await proc.wait()
            # what it printed before it died counts too
            while (line := await lines.next()) is not None:
                if line:
                    log.feed(line)
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
    return log, returncode


async def test_kill_9_mid_run_then_restart(tmp_path):
    db = tmp_path / "runs.db"
    with trio.fail_after(TIMEOUT):
        log, returncode = await run_child_until_killed(db, tmp_path / "child.stderr")
        assert returncode == -signal.SIGKILL
        assert log.ready
        assert (tmp_path / "runs.db-wal").exists()  # it died with its WAL open

        store = SqliteStore(db)
        try:
            node = Node(node_id="restarted", adapters=[EchoAdapter()], targets=[], store=store)
            async with node.running():
                pass  # entering interrupted what was unfinished
            records = {r.run_id: r for r in await store.list_runs(RunQuery(limit=1_000_000))}
            events = {run_id: await store.events(run_id) for run_id in records}
        finally:
            await store.aclose()

    # every accepted run is there, and has ended
    missing = set(log.accepted) - set(records)
    assert not missing, f"accepted runs lost: {sorted(missing)}"
    for run_id in log.accepted:
        assert records[run_id].status.terminal, records[run_id]

    # every event the child was told is stored is stored, as it was (an append cancelled
    # while waiting is written too, but the child was not told, so it may be missing here)
    for run_id, stored in log.stored.items():
        in_db = {e.seq: e.kind.value for e in events[run_id]}
        assert [(seq, in_db.get(seq)) for seq, _ in stored] == stored, (run_id, events[run_id])

    interrupted: dict[str, list[EventKind]] = {}
    for run_id, record in records.items():
        log_ = events[run_id]
        kinds = [e.kind for e in log_]
        # seq 1..n, no gap; QUEUED first; exactly one terminal event, and it is last
        assert [e.seq for e in log_] == list(range(1, len(log_) + 1)), (run_id, log_)
        assert kinds[0] is EventKind.QUEUED
        assert sum(1 for k in kinds if k.terminal) == 1, (run_id, kinds)
        assert kinds[-1].terminal, (run_id, kinds)
        # the record agrees with its log
        statuses = [e.status for e in log_ if e.status is not None]
        assert record.status is statuses[-1], (record, kinds)
        assert record.last_seq == len(log_)
        assert record.finished == log_[-1].time
        if kinds[-1] is EventKind.INTERRUPTED:
            # it was QUEUED or RUNNING in the store when the child died
            last = log_[-1]
            assert (last.reason, record.reason) == ("node_restart", "node_restart")
            assert record.status is RunStatus.INTERRUPTED
            assert all(
                k in (EventKind.QUEUED, EventKind.STARTED, EventKind.DELTA) for k in kinds[:-1]
            )
            interrupted[run_id] = kinds[:-1]
        if record.status is RunStatus.CANCELLED:
            assert run_id in log.cancel_asked
        if record.status is RunStatus.REJECTED:
            assert record.reason == "queue_full"

    # runs that could not have ended were live at the kill, and are INTERRUPTED now
    for run_id, target in log.accepted.items():
        if target == "echo/slow":
            assert run_id in interrupted, (records[run_id], events[run_id])
    was_running = [r for r, kinds in interrupted.items() if EventKind.STARTED in kinds]
    was_queued = [r for r, kinds in interrupted.items() if kinds == [EventKind.QUEUED]]
    assert was_running, "no run was RUNNING at the kill"
    # a run's deltas are written in batches nobody waits for (one in 64 is waited for): the
    # ones the store had taken when the child died are there too, gap-free, and their text
    # is a prefix of what the run streamed
    # (a run may be stored RUNNING before its submitter heard of it: one that could start
    # at once writes STARTED with QUEUED, and the child may die before it says "accepted",
    # so its prompt is found by the target its record names)
    prompts = {target: prompt for target, prompt, _ in PATTERN}
    for run_id in was_running:
        deltas = [e.text for e in events[run_id] if e.kind is EventKind.DELTA]
        assert prompts[records[run_id].target].startswith("".join(deltas)), run_id  # echo
        reported = [seq for seq, kind in log.stored.get(run_id, []) if kind == "delta"]
        assert len(deltas) >= len(reported)
    assert any(
        len([e for e in events[r] if e.kind is EventKind.DELTA])
        > len([s for s, k in log.stored.get(r, []) if k == "delta"])
        for r in was_running
    ), "no delta nobody waited for reached the store"
    assert was_queued, "no run was QUEUED at the kill"
    ends = {r.status for r in records.values()}
    assert {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.REJECTED,
        RunStatus.INTERRUPTED,
    } <= ends
    assert {r.background for r in records.values()} == {True, False}


async def test_kill_9_mid_stream_of_merged_batched_deltas_leaves_a_whole_log(tmp_path):
    """A real node (``iop-node serve``, SQLite) streams a fast echo through an edge; the
    client gets merged deltas (seq skips), the store has them in batches nobody waited
    for. SIGKILL mid-stream: the stored log is seq 1..n with no gap, its text and the
    client's are prefixes of what the run streams, and at most SYNC_EVERY deltas the
    client got are not in the store."""
    from iop_trio.edge import Edge
    from iop_trio.model import RunSpec
    from iop_trio.runtime.live import SYNC_EVERY

    words = "".join(f"w{i} " for i in range(1000))
    repeat = 1000  # a million deltas: far more than the node sends before the kill
    edge = Edge(token="crash-token")
    db = tmp_path / "node.db"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            config = tmp_path / "node.yaml"
            config.write_text(
                "node_id: crashy\n"
                "adapters: {echo: {kind: echo}}\n"
                "targets: [{adapter: echo, model: m, concurrency: 1}]\n"
                f"store: {{path: {db}}}\n"
                "metrics: {listen: ''}\n"
                f"edge: {{url: '{edge.node_url}', token: crash-token}}\n"
            )
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "iop_trio.cli", "serve", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=ROOT,
            )
            try:
                await edge.wait_for_node("crashy")
                spec = RunSpec("echo/m", words, options={"repeat": repeat}, background=True)
                got: list[tuple[int, str]] = []
                merged = False  # a delta whose seq skips: it stands for several
                async with edge.run(spec) as stream:
                    run_id = stream.run_id
                    async for event in stream:
                        if event.kind is EventKind.DELTA:
                            merged = merged or bool(got and event.seq - got[-1][0] > 1)
                            got.append((event.seq, event.text))
                        if len(got) > 50 and got[-1][0] > 20_000 and merged:
                            break
                    proc.kill()  # SIGKILL, mid-stream
                    assert await proc.wait() == -signal.SIGKILL
            finally:
                if proc.returncode is None:
                    proc.kill()
                    with trio.CancelScope(shield=True):
                        await proc.wait()
            nursery.cancel_scope.cancel()
        store = SqliteStore(db)
        try:
            stored = await store.events(run_id, limit=10_000_000)
        finally:
            await store.aclose()
    seqs = [e.seq for e in stored]
    assert seqs == list(range(1, len(stored) + 1))
    assert [e.kind for e in stored[:2]] == [EventKind.QUEUED, EventKind.STARTED]
    assert all(e.kind is EventKind.DELTA for e in stored[2:])  # it died streaming
    full = words * repeat
    stored_text = "".join(e.text for e in stored[2:])
    client_text = "".join(text for _, text in got)
    assert full.startswith(stored_text) and full.startswith(client_text)
    # the client's pieces were merged, never reordered: its seqs only grow
    assert [s for s, _ in got] == sorted({s for s, _ in got})
    # every 64th delta waits until it is durable before it is sent
    assert seqs[-1] >= got[-1][0] - SYNC_EVERY
