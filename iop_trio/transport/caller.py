"""The caller's side of run requests: what an edge uses on a node, and a CLI on an edge.

:class:`RunnerClient` wraps a :class:`ProtoSession` whose peer serves run
requests (Role.RUNNER) and offers them as Python calls. Errors from the peer
arrive as :class:`RemoteError`; a lost session as :class:`SessionClosed`.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio
from google.protobuf.message import Message

from ..model import LATEST_RUNS, RunEvent, RunQuery, RunSpec, TenantLimits
from ..protocol import BATCH_SUBPROTOCOL, Role, pb
from ..protocol.convert import (
    TERMINAL_STATUSES_PB,
    event_from_pb,
    query_to_pb,
    request_from_spec,
    tenant_limits_to_pb,
)
from .session import ProtoSession, ReplyStream, SessionClosed, SessionSettings
from .tls import open_websocket


class RunStream:
    """The events of one run, from ``after`` on, ending with its terminal event.

    ``run_id``/``existing`` come from RunAccepted (or RunInfo when following).
    """

    def __init__(self, replies: ReplyStream, run_id: str, *, existing: bool = False) -> None:
        self._replies = replies
        self.run_id = run_id
        self.existing = existing
        self.last: RunEvent | None = None

    def __repr__(self) -> str:
        last = self.last.kind.value if self.last else "-"
        return f"<RunStream {self.run_id} last={last}>"

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> RunEvent:
        if self.last is not None and self.last.kind.terminal:
            raise StopAsyncIteration
        message = await self._replies.__anext__()
        if not isinstance(message, pb.RunEvent):
            raise SessionClosed(f"expected a run event, got {type(message).__name__}")
        self.last = event_from_pb(message)
        return self.last

    async def collect(self) -> tuple[str, RunEvent]:
        """Consume the rest: the text of the deltas and the terminal event."""
        text = []
        async for event in self:
            text.append(event.text)
        assert self.last is not None
        return "".join(text), self.last


#: Seconds a caller waits for the first answer to a request by default.
ACK_TIMEOUT = 30.0
#: Seconds of a caller's ``ack_timeout`` kept back, at least, from the bound it gives
#: its peer (``answer_within``), so that the peer's refusal reaches it before it gives up.
ANSWER_MARGIN = 2.0


def answer_within_for(ack_timeout: float | None) -> float:
    """The bound a caller that waits ``ack_timeout`` seconds gives its peer: that, less
    a third of it or :data:`ANSWER_MARGIN` (whichever is more), and at least half of it;
    0 (no bound) for None. For the default 30 s: 20 s (a burst's last refusals, and
    their trip back on a busy machine, get 10 s)."""
    if ack_timeout is None or not ack_timeout > 0:
        return 0.0
    return max(ack_timeout / 2, ack_timeout - max(ANSWER_MARGIN, ack_timeout / 3))


class RunnerClient:
    """Run requests over one session; many calls may be in flight at once.

    :meth:`run`, :meth:`cancel`, :meth:`get_run`, :meth:`follow`, :meth:`list_runs`,
    :meth:`set_limits` and :meth:`ping` make one kind of request each; :meth:`call` and
    :meth:`stream` send any request as a protobuf message (what a relay such as the
    edge needs).

    Every call raises :class:`ReplyTimeout` if the peer does not answer
    within ``ack_timeout`` seconds, and a run's event stream raises it if no
    event comes for ``idle_timeout`` seconds (None, the default, waits as long
    as the run does: a run may wait in the queue and the engine for long).
    Each request tells the peer when its caller gives up
    (:func:`answer_within_for` ``ack_timeout``), so a request the peer cannot begin
    to handle in time is answered UNAVAILABLE, not left to time out, and no run is
    made for a caller who is gone.
    """

    def __init__(
        self,
        session: ProtoSession,
        *,
        ack_timeout: float | None = ACK_TIMEOUT,
        idle_timeout: float | None = None,
    ) -> None:
        self.session = session
        self.ack_timeout = ack_timeout
        self.idle_timeout = idle_timeout

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.session!r}>"

    def _bounds(
        self, ack_timeout: float | None, answer_within: float | None
    ) -> tuple[float | None, float]:
        ack = self.ack_timeout
        if ack_timeout is not None:
            ack = ack_timeout if ack is None else min(ack, ack_timeout)
        within = answer_within_for(ack) if answer_within is None else answer_within
        return ack, within

    async def call(
        self,
        kind: str,
        message: Message,
        *,
        ack_timeout: float | None = None,
        answer_within: float | None = None,
    ) -> Message:
        """Send any request ``kind`` (an Envelope body name, ``"list_runs"``) and return
        its first answer; the relay's API (the edge passes a client's request on as it
        came).

        ``ack_timeout`` (seconds) can only shorten this client's own (None: this
        client's); ``answer_within`` is the bound the peer is given, in seconds (None:
        :func:`answer_within_for` the ack timeout; 0: no bound). Raises RemoteError for
        an Error answer, ReplyTimeout if none comes in time, SessionClosed if the
        session ends first. A request answered by a stream (``run_request``, ``get_run``
        with ``follow``) gets only its first reply here: use :meth:`stream`.
        """
        ack, within = self._bounds(ack_timeout, answer_within)
        return await self.session.request(kind, message, ack_timeout=ack, answer_within=within)

    def stream(
        self,
        kind: str,
        message: Message,
        *,
        ack_timeout: float | None = None,
        answer_within: float | None = None,
    ) -> AbstractAsyncContextManager[ReplyStream]:
        """Send any request and yield the stream of its replies (:meth:`ProtoSession.stream`);
        the relay's API for requests answered by a stream.

        The bounds are :meth:`call`'s for the first reply; each later one waits at most
        this client's ``idle_timeout``. Iterating raises as :meth:`call` does, and ends
        after the final reply; leaving the block stops listening (later replies are
        dropped; a run goes on unless cancelled).
        """
        ack, within = self._bounds(ack_timeout, answer_within)
        return self.session.stream(
            kind, message, ack_timeout=ack, idle_timeout=self.idle_timeout, answer_within=within
        )

    @asynccontextmanager
    async def run(self, spec: RunSpec) -> AsyncIterator[RunStream]:
        """Submit ``spec`` and stream its events; leaving the block stops listening
        (the run itself goes on unless cancelled)."""
        async with self.stream("run_request", request_from_spec(spec)) as replies:
            accepted = await replies.first()
            assert isinstance(accepted, pb.RunAccepted)
            yield RunStream(replies, accepted.run_id, existing=accepted.existing)

    async def submit(self, spec: RunSpec) -> str:
        """Submit without following; returns the run id."""
        async with self.run(spec) as stream:
            return stream.run_id

    async def cancel(self, run_id: str, reason: str = "") -> pb.CancelResult:
        result = await self.call("cancel_run", pb.CancelRun(run_id=run_id, reason=reason))
        assert isinstance(result, pb.CancelResult)
        return result

    async def get_run(
        self, run_id: str, *, include_events: bool = False, after_seq: int = 0
    ) -> pb.RunInfo:
        info = await self.call(
            "get_run",
            pb.GetRun(run_id=run_id, include_events=include_events, after_seq=after_seq),
        )
        assert isinstance(info, pb.RunInfo)
        return info

    @asynccontextmanager
    async def follow(self, run_id: str, *, after_seq: int = 0) -> AsyncIterator[RunStream]:
        """Every event of ``run_id`` after ``after_seq``, to the terminal one, live or stored."""
        request = pb.GetRun(run_id=run_id, include_events=True, after_seq=after_seq, follow=True)
        async with self.stream("get_run", request) as replies:
            info = await replies.first()
            assert isinstance(info, pb.RunInfo)
            yield _Followed(self, replies, info)

    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[pb.RunSummary]:
        """The runs ``query`` asks for, newest first (:class:`~iop_trio.model.RunQuery`;
        through an edge with identities, only the caller's own, whatever its prefix)."""
        reply = await self.call("list_runs", query_to_pb(query))
        assert isinstance(reply, pb.RunList)
        return list(reply.runs)

    async def set_limits(
        self,
        *,
        concurrency: int | None = None,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
        adapters: Mapping[str, int] | None = None,
        targets: Mapping[str, int] | None = None,
        tenants: Mapping[str, TenantLimits] | None = None,
        node_id: str = "",
    ) -> pb.Limits:
        """Change limits (None / absent leaves one as it is); each tenant named gets that
        whole share. Returns the limits in force. Through an edge, ``node_id`` names the
        node (and the caller needs the right to change limits)."""
        request = pb.SetLimits(
            node_id=node_id,
            adapters=adapters or {},
            targets=targets or {},
            tenants={n: tenant_limits_to_pb(t) for n, t in (tenants or {}).items()},
        )
        if concurrency is not None:
            request.concurrency = concurrency
        if max_queued is not None:
            request.max_queued = max_queued
        if queue_timeout is not None:
            request.queue_timeout_s = queue_timeout
        reply = await self.call("set_limits", request)
        assert isinstance(reply, pb.Limits)
        return reply

    async def ping(self) -> float:
        """Round trip time in seconds."""
        start = trio.current_time()
        await self.call("ping", pb.Ping(time=start))
        return trio.current_time() - start


class _Followed(RunStream):
    """A followed run: the events inlined in RunInfo (paged if need be), then the live stream."""

    def __init__(self, client: RunnerClient, replies: ReplyStream, info: pb.RunInfo) -> None:
        super().__init__(replies, info.run.run_id, existing=True)
        self._client = client
        self._backlog = [event_from_pb(e) for e in info.events]
        self._more = info.more_events
        self._ended = info.run.status in TERMINAL_STATUSES_PB
        self.info = info

    async def __anext__(self) -> RunEvent:
        if self._backlog:
            self.last = self._backlog.pop(0)
            return self.last
        if self._more and self._ended and self.last is not None:
            # an ended run's stored events come in pages (a live run's rest
            # arrives on the stream instead)
            page = await self._client.get_run(
                self.run_id, include_events=True, after_seq=self.last.seq
            )
            self._backlog = [event_from_pb(e) for e in page.events]
            self._more = page.more_events
            return await self.__anext__()
        if self._ended:
            raise StopAsyncIteration
        return await super().__anext__()


@asynccontextmanager
async def open_runner(
    url: str,
    *,
    token: str | None = None,
    settings: SessionSettings | None = None,
    connect_timeout: float = 10.0,
    ack_timeout: float | None = ACK_TIMEOUT,
    idle_timeout: float | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[RunnerClient]:
    """Connect to a peer serving run requests (an edge's ``/client`` endpoint).

    trio-websocket's ``ConnectionTimeout`` if the WebSocket is not open within
    ``connect_timeout`` seconds, TLSFailed at once for a ``wss:`` peer whose
    certificate is not trusted; the other timeouts are the client's (see
    :class:`RunnerClient`).
    """
    settings = settings or SessionSettings()
    async with open_websocket(
        url,
        token=token,
        ssl_context=ssl_context,
        max_message_size=settings.max_message_size,
        connect_timeout=connect_timeout,
        subprotocols=(BATCH_SUBPROTOCOL,),  # it reads batches (an older edge accepts none)
    ) as ws:
        session = ProtoSession(ws, Role.CLIENT, settings=settings, name=url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            try:
                yield RunnerClient(session, ack_timeout=ack_timeout, idle_timeout=idle_timeout)
            finally:
                nursery.cancel_scope.cancel()
