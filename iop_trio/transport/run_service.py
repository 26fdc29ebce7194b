"""The node's request service: answers an edge's requests from a :class:`Node`.

Each request kind has a handler (``_on_<kind>``); the failures a request can
meet are answered by the protocol's one error table
(:data:`iop_trio.protocol.errors.ERROR_RULES`), and anything else is a bug
that the session answers INTERNAL.
"""

from __future__ import annotations

import logging

import attrs

from ..model import UnknownRun
from ..protocol import Request, pb
from ..protocol.convert import (
    event_to_pb,
    limits_to_pb,
    query_from_pb,
    spec_from_request,
    status_to_pb,
    summary_from_record,
    tenant_limits_from_pb,
)
from ..protocol.errors import TooLate, refusal_for
from ..runtime import Node, RunWatcher
from ..store import StoreUnavailable
from .session import ProtoSession

log = logging.getLogger(__name__)

MAX_EVENTS_PER_INFO = 1000
MAX_LIST = 1000
#: The least time (seconds) a run request's sender must still wait for its answer for
#: the node to begin it (make its run): less, and it would be answered too late.
MIN_TIME_LEFT = 0.25


class RunService:
    """Serves run requests for one node; one instance serves every session of it.

    Foreground runs belong to the session that asked (its ``key``), so the
    client can abandon them when the session is lost.
    """

    def __init__(self, node: Node) -> None:
        self.node = node

    def __repr__(self) -> str:
        return f"<RunService {self.node.node_id!r}>"

    async def handle(self, session: ProtoSession, request: Request) -> None:
        handler = getattr(self, f"_on_{request.kind}", None)
        if handler is None:
            await session.error(
                request.nonce, pb.ERROR_CODE_UNEXPECTED, f"{request.kind!r} is not served here"
            )
            return
        try:
            await handler(session, request.nonce, request.message)
        except Exception as exc:
            refusal = refusal_for(exc, request.kind)
            if refusal is None:
                raise
            await session.error(
                request.nonce, refusal.code, refusal.message, retry_after=refusal.retry_after
            )

    async def _on_run_request(
        self, session: ProtoSession, nonce: int, message: pb.RunRequest
    ) -> None:
        spec = spec_from_request(message)
        left = session.time_left(nonce)
        if left < MIN_TIME_LEFT:
            # its sender gives up first: no run for nobody
            raise TooLate(
                f"the run request's sender gives up in {max(left, 0):.2f}s: not begun; retry later"
            )
        manager = self.node.manager
        # stored within the sender's time (a run stored later would be one it never hears
        # of), and within store_grace
        bound = min(manager.store_grace, left - MIN_TIME_LEFT)
        try:
            submitted = await manager.submit(spec, owner=session.key, create_timeout=bound)
        except StoreUnavailable:
            if bound >= manager.store_grace or not self.node.store.health().writable:
                raise
            # a store that writes, but not before the sender gives up (a busy node)
            raise TooLate(
                f"the run could not be stored within the {bound:.2f}s its sender still "
                "waited; it was not made: retry later"
            ) from None
        record = submitted.record
        watcher = self.node.manager.watch(record.run_id)
        # the events stored with the run (QUEUED, and STARTED for one that may start at
        # once) go with the ack, in one frame
        await session.reply_with_events(
            nonce,
            "run_accepted",
            pb.RunAccepted(
                run_id=record.run_id,
                status=status_to_pb(record.status),
                existing=submitted.existing,
            ),
            map(event_to_pb, watcher.ready()),
        )
        await self._stream(session, nonce, watcher)

    async def _stream(self, session: ProtoSession, nonce: int, watcher: RunWatcher) -> None:
        """Send the run's events that ``watcher`` gives; while the session is behind they
        gather and go out merged (:meth:`ProtoSession.reply_events`)."""
        async for event in watcher:
            await session.reply_events(
                nonce, event_to_pb(event), lambda: map(event_to_pb, watcher.ready())
            )

    async def _on_cancel_run(
        self, session: ProtoSession, nonce: int, message: pb.CancelRun
    ) -> None:
        outcome = await self.node.manager.cancel(message.run_id, message.reason or "cancelled")
        await session.reply(
            nonce,
            "cancel_result",
            pb.CancelResult(
                run_id=outcome.run_id,
                status=status_to_pb(outcome.status),
                cancelled=outcome.cancelled,
            ),
        )

    async def _on_get_run(self, session: ProtoSession, nonce: int, message: pb.GetRun) -> None:
        manager = self.node.manager
        record = await manager.get(message.run_id)
        if record is None:
            raise UnknownRun(message.run_id)
        info = pb.RunInfo(run=summary_from_record(record))
        after = message.after_seq
        if message.include_events:
            # bounded by count and bytes, so the reply always fits in a frame
            budget = session.settings.max_message_size // 2
            events = await manager.events(
                message.run_id, after_seq=after, limit=MAX_EVENTS_PER_INFO + 1
            )
            for event in events[:MAX_EVENTS_PER_INFO]:
                converted = event_to_pb(event)
                budget -= converted.ByteSize() + 8
                if budget < 0 and info.events:
                    break
                info.events.append(converted)
            info.more_events = len(info.events) < len(events)
            if info.events:
                after = info.events[-1].seq
        await session.reply(nonce, "run_info", info)
        if message.follow and not record.status.terminal:
            await self._stream(session, nonce, manager.watch(message.run_id, after_seq=after))

    async def _on_list_runs(self, session: ProtoSession, nonce: int, message: pb.ListRuns) -> None:
        query = query_from_pb(message)
        records = await self.node.manager.list_runs(
            attrs.evolve(query, limit=min(query.limit, MAX_LIST))
        )
        await session.reply(
            nonce, "run_list", pb.RunList(runs=[summary_from_record(r) for r in records])
        )

    async def _on_set_limits(
        self, session: ProtoSession, nonce: int, message: pb.SetLimits
    ) -> None:
        limits = self.node.set_limits(
            concurrency=message.concurrency if message.HasField("concurrency") else None,
            max_queued=message.max_queued if message.HasField("max_queued") else None,
            queue_timeout=message.queue_timeout_s if message.HasField("queue_timeout_s") else None,
            adapters=dict(message.adapters),
            targets=dict(message.targets),
            tenants={n: tenant_limits_from_pb(t) for n, t in message.tenants.items()},
        )
        await session.reply(nonce, "limits", limits_to_pb(limits))
