"""An in-memory run store: the reference implementation of :class:`RunStore`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import trio

from ..lifecycle import RunState, fold
from ..model import CHARS_PER_TOKEN, LATEST_RUNS, RunEvent, RunQuery, RunRecord, RunStatus
from .base import (
    RunStore,
    StoreError,
    UsageGroup,
    UsageTotal,
    created_record,
    refused_error,
    unfinished_usage,
)


class MemoryStore(RunStore):
    """Keeps everything in dicts; nothing survives the process. Every method is a checkpoint."""

    def __init__(self) -> None:
        self._runs: dict[str, RunRecord] = {}
        self._events: dict[str, list[RunEvent]] = {}

    def __repr__(self) -> str:
        return f"<MemoryStore runs={len(self._runs)}>"

    async def create(
        self, record: RunRecord, event: RunEvent, *, then: Sequence[RunEvent] = ()
    ) -> None:
        await trio.lowlevel.checkpoint()
        if record.run_id in self._runs:
            raise StoreError(f"run {record.run_id} exists")
        self._runs[record.run_id] = _copy(created_record(record, event, then))
        self._events[record.run_id] = [event, *then]

    async def append(self, event: RunEvent) -> None:
        self.append_nowait(event)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def append_many(self, events: Sequence[RunEvent]) -> None:
        refused = []
        for event in events:
            try:
                self.append_nowait(event)
            except StoreError as exc:
                refused.append(str(exc))
        await trio.lowlevel.cancel_shielded_checkpoint()
        if refused:
            raise refused_error(refused)

    def append_nowait(
        self, event: RunEvent, *, on_durable: Callable[[], None] | None = None
    ) -> None:
        try:
            self._append_now(event)
        finally:
            if on_durable is not None:
                on_durable()

    def _append_now(self, event: RunEvent) -> None:
        record = self._runs.get(event.run_id)
        if record is None:
            raise StoreError(f"event for unknown run {event.run_id}")
        try:
            fold(record, event)
        except (ValueError, RuntimeError) as exc:
            raise StoreError(str(exc)) from exc
        self._events[event.run_id].append(event)

    async def get(self, run_id: str) -> RunRecord | None:
        await trio.lowlevel.checkpoint()
        record = self._runs.get(run_id)
        return None if record is None else _copy(record)

    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[RunRecord]:
        await trio.lowlevel.checkpoint()
        found = [_copy(r) for r in reversed(self._runs.values()) if query.matches(r)]
        return found[: max(query.limit, 0)]

    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        await trio.lowlevel.checkpoint()
        start = max(after_seq, 0)
        end = None if limit is None else start + max(limit, 0)
        return self._events.get(run_id, [])[start:end]

    async def interrupt_unfinished(
        self, *, time: float, message: str, chars_per_token: float = CHARS_PER_TOKEN
    ) -> list[RunEvent]:
        await trio.lowlevel.checkpoint()
        made = []
        for record in self._runs.values():
            if not record.status.terminal:
                usage = None
                if record.status is RunStatus.RUNNING:
                    sent = sum(e.tokens for e in self._events[record.run_id])
                    usage = unfinished_usage(record, sent, chars_per_token)
                event = RunState(record).interrupt(time=time, message=message, usage=usage)
                self._events[record.run_id].append(event)
                made.append(event)
        return made

    async def usage_totals(
        self, *, by: UsageGroup, since: float | None = None, until: float | None = None
    ) -> list[UsageTotal]:
        await trio.lowlevel.checkpoint()
        sums: dict[str, list[int]] = {}
        for r in self._runs.values():
            if r.usage is None or r.finished is None:
                continue
            if (since is not None and r.finished < since) or (
                until is not None and r.finished >= until
            ):
                continue
            total = sums.setdefault(r.tenant if by == "tenant" else r.target, [0] * 5)
            prompt, completion = r.usage.prompt_tokens or 0, r.usage.completion_tokens or 0
            total[0] += 1
            total[1] += prompt
            total[2] += completion
            total[3] += prompt if r.usage.prompt_estimated else 0
            total[4] += completion if r.usage.completion_estimated else 0
        return [UsageTotal(name, *sums[name]) for name in sorted(sums)]

    async def prune(self, *, finished_before: float) -> int:
        await trio.lowlevel.checkpoint()
        old = [
            run_id
            for run_id, r in self._runs.items()
            if r.status.terminal and r.finished is not None and r.finished < finished_before
        ]
        for run_id in old:
            del self._runs[run_id]
            del self._events[run_id]
        return len(old)


def _copy(record: RunRecord) -> RunRecord:
    """A copy that shares no mutable state (``options``) with ``record``."""
    return attrs.evolve(record, options=dict(record.options))
