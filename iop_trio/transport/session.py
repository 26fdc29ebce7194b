"""A proto-socket session: the Trio shell around :class:`ProtoConnection`.

One :class:`ProtoSession` per WebSocket. :meth:`ProtoSession.run` owns four
kinds of task, all ending with the session:

- the reader, which always drains the socket (so pings and pongs keep
  flowing however slow a consumer is) and routes each frame: a reply to its
  waiter, a request to a handler, a bad frame to an Error reply;
- the writer, the one task that writes to the socket, from the outbox:
  any number of tasks may send, a cancelled sender never leaves half a
  frame on the wire, and a sender waits while more than ``send_buffer``
  bytes are unwritten (backpressure), in line: first come, first sent.
  Each time it runs, the writer takes every frame that is ready (the rule
  is :func:`~iop_trio.protocol.take_sendable`: in order, bounded in bytes,
  never waiting for more) and writes them in one send; to a peer that reads
  batches (:attr:`ProtoSession.peer_reads_batches`) neighbouring frames go
  as one Batch frame.
  What the reader itself must answer (errors, pongs, UNAVAILABLE) is never
  dropped and never waits. A peer that does not read its replies is closed
  (1008) once a frame has waited ``send_timeout`` seconds to be written, or
  more than ``max_outbox`` bytes are unwritten;
- the heartbeat: a WebSocket ping every ``ping_interval`` seconds; the
  session ends (close 1011) when ``ping_timeout`` seconds after a ping the
  peer has sent neither its pong nor any frame for ``ping_timeout``. A busy
  peer's pong can wait behind its data (or behind ours: a WebSocket reader
  writes its pongs), so frames that keep arriving prove it alive too;
- one handler task per request being answered. Requests come in two
  classes, calls and stream openers (``run_request``, ``get_run`` with
  ``follow``), each with its own bound: at most ``max_in_flight`` of a class
  are handled and not yet answered at once; more wait, as data, in that
  class's FIFO (at most ``max_pending`` requests and ``max_pending_bytes``);
  beyond that a request is answered UNAVAILABLE at once. A handler's slot
  is freed by its first reply, so a stream that goes on for a run's whole
  life holds no slot, and calls (cancel, get, list, set limits) are never
  queued behind runs. A request that says how long its sender waits for an
  answer (``answer_within``) and is still waiting when that has passed is
  answered UNAVAILABLE then, and never handled: its sender has given up, so
  no work is done for nobody. A handler asks :meth:`ProtoSession.time_left`
  how long its request's sender still waits.

A ``gatekeeper`` may refuse a request before it is queued (a caller over its
rate, say): its :class:`Refusal` is the answer, at once.

Every request gets exactly one first answer. Nothing a peer sends can make
``run`` raise: it returns the reason the session ended.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress

import attrs
import trio
from google.protobuf.message import Message
from trio_websocket import ConnectionClosed, WebSocketConnection

from ..protocol import (
    BATCH_SUBPROTOCOL,
    Incoming,
    ProtocolError,
    ProtoConnection,
    Reply,
    Request,
    Role,
    StaleReply,
    pb,
    take_sendable,
)
from ..protocol.convert import merge_deltas

# the failures of an exchange, and a gatekeeper's answer, are the protocol's error table's
# (re-exported: these are their public names on the transport)
from ..protocol.errors import Refusal as Refusal
from ..protocol.errors import RemoteError as RemoteError
from ..protocol.errors import ReplyTimeout as ReplyTimeout
from ..protocol.errors import SessionClosed as SessionClosed
from ..protocol.errors import TooLate as TooLate
from .replies import STREAM_BUFFER as STREAM_BUFFER
from .replies import ReplyStream as ReplyStream
from .ws_send import send_messages

log = logging.getLogger(__name__)

RequestHandler = Callable[["ProtoSession", Request], Awaitable[None]]


#: Says whether a request may be queued: None, or the Refusal that answers it at once.
Gatekeeper = Callable[[Request], Refusal | None]

DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
#: The close code of a session whose peer does not read what it is sent (policy violation).
CLOSE_NOT_READING = 1008
_session_ids = itertools.count(1)


#: Seconds :meth:`ProtoSession.aclose` waits for what was sent to be written.
FLUSH_TIMEOUT = 1.0
#: The retry hint, in seconds, of a request refused for want of room on a session.
BUSY_RETRY_AFTER = 1.0


@attrs.frozen
class SessionSettings:
    """Per-session bounds (see the module docstring). ``ping_interval`` 0 turns the
    heartbeat off; ``send_timeout`` None never closes a peer for not reading."""

    ping_interval: float = 20.0
    ping_timeout: float = 10.0
    max_in_flight: int = 256
    max_pending: int = 10_000
    max_pending_bytes: int = 64 * 1024 * 1024
    send_buffer: int = 1024 * 1024
    max_outbox: int = 64 * 1024 * 1024
    send_timeout: float | None = 30.0
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    #: a stream of run events waits (:meth:`ProtoSession.wait_for_room`) while this
    #: many bytes are unwritten before it takes its next events, so a stream that is
    #: behind sends its waiting deltas merged, in fewer frames, not a backlog of tiny ones
    stream_buffer: int = 64 * 1024


@attrs.define(eq=False)
class _RequestClass:
    """The requests of one class on a session: handled and unanswered, and waiting (by
    nonce, oldest first)."""

    name: str
    active: int = 0
    waiting: dict[int, Request] = attrs.field(factory=dict)
    waiting_bytes: int = 0

    def take(self, nonce: int) -> Request | None:
        """Take ``nonce`` out of the waiting ones (None if it is not waiting)."""
        request = self.waiting.pop(nonce, None)
        if request is not None:
            self.waiting_bytes -= request.size
        return request

    def next(self) -> Request:
        """Take the oldest waiting request."""
        request = self.waiting.pop(next(iter(self.waiting)))
        self.waiting_bytes -= request.size
        return request


class ProtoSession:
    """See the module docstring. ``key`` identifies the session to the runtime."""

    def __init__(
        self,
        ws: WebSocketConnection,
        role: Role,
        *,
        handler: RequestHandler | None = None,
        settings: SessionSettings | None = None,
        name: str = "",
        gatekeeper: Gatekeeper | None = None,
    ) -> None:
        self.ws = ws
        self.gatekeeper = gatekeeper
        self.key = f"s{next(_session_ids)}"
        self.name = name or self.key
        self.settings = settings or SessionSettings()
        self._conn: ProtoConnection[ReplyStream] = ProtoConnection(role)
        #: the peer reads Batch frames: it said so (the subprotocol it opened the
        #: WebSocket with; on a node's link, its Hello or HelloAck sets this)
        self.peer_reads_batches = ws.subprotocol == BATCH_SUBPROTOCOL
        self.frames_sent = 0  # envelopes written
        self.sends = 0  # writes to the socket (each one or more WebSocket messages)
        self._handler = handler
        # requests being handled and not yet answered: nonce -> its class
        self._unanswered: dict[int, _RequestClass] = {}
        self._calls = _RequestClass("call")
        self._streams = _RequestClass("stream")
        # when the senders of the peer's requests give up on them (trio time), by nonce,
        # and the waiting requests' bounds as a heap of (when, nonce)
        self._give_up_at: dict[int, float] = {}
        self._bounds: list[tuple[float, int]] = []
        self._bounds_lot = trio.lowlevel.ParkingLot()
        self.expired = 0  # requests answered UNAVAILABLE because their sender gave up
        # frames for the writer, and what wakes it / the senders waiting for room
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._flushed: list[trio.Event] = []  # set when the writer has nothing left to write
        self._room_lot = trio.lowlevel.ParkingLot()
        self._stream_lot = trio.lowlevel.ParkingLot()  # streams waiting for stream_buffer
        self._closed = False
        self._nursery: trio.Nursery | None = None
        self.close_reason = ""
        self.started = trio.Event()
        self.ended = trio.Event()
        self.frames_received = 0
        self.heard_at = trio.current_time()  # when the peer last sent a frame
        self.bad_frames = 0
        self.refused = 0  # requests answered UNAVAILABLE for want of room

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<ProtoSession {self.name} {self._conn.role.value} {state} "
            f"unanswered={len(self._unanswered)} "
            f"waiting={len(self._calls.waiting) + len(self._streams.waiting)} "
            f"outbox={self._outbox_bytes}B pending={self._conn.pending} "
            f"batches={'yes' if self.peer_reads_batches else 'no'} "
            f"frames/sends={self.frames_sent}/{self.sends}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def unanswered(self) -> int:
        """Requests of the peer being handled or waiting, not yet answered."""
        return len(self._unanswered) + len(self._calls.waiting) + len(self._streams.waiting)

    @property
    def pending(self) -> int:
        """Our requests still waiting for (more) answers."""
        return self._conn.pending

    # --- running -------------------------------------------------------------------------

    async def run(self) -> str:
        """Serve the session until the connection ends; returns why it ended."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                nursery.start_soon(self._expire_waiting)
                if self.settings.ping_interval > 0:
                    nursery.start_soon(self._heartbeat)
                self.started.set()
                await self._reader()
                nursery.cancel_scope.cancel()
        finally:
            # the WebSocket itself belongs to whoever opened it: aclose(), the
            # heartbeat and a peer's close have closed it already, and a session
            # cancelled from outside leaves it to its owner (which cannot wait
            # for a close handshake once its reader is cancelled anyway)
            self._closed = True
            self._room_lot.unpark_all()
            self._stream_lot.unpark_all()
            for stream in self._conn.forget_all():
                # one exception each: a shared one would grow its traceback with every raise
                stream.deliver(SessionClosed(f"session {self.name} ended: {self.close_reason}"))
            self.ended.set()
        return self.close_reason

    def _end(self, reason: str) -> None:
        if not self.close_reason:
            self.close_reason = reason
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def aclose(self, code: int = 1000, reason: str = "closing") -> None:
        """Close the WebSocket and end the session, once what was sent is written (for
        at most :data:`FLUSH_TIMEOUT` seconds), so a last answer reaches the peer."""
        if not self._closed and self._nursery is not None:
            with trio.move_on_after(FLUSH_TIMEOUT):
                await self._flush()
        self._end(reason)
        with trio.move_on_after(2):
            await self.ws.aclose(code, reason)

    async def _close_for_not_reading(self, why: str) -> None:
        """End the session of a peer that does not read: say why, close (1008), at once."""
        log.warning("session %s: closing: %s", self.name, why)
        self.close_reason = why
        self._end(why)
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await self.ws.aclose(CLOSE_NOT_READING, "not reading replies")

    async def _reader(self) -> None:
        while True:
            try:
                data = await self.ws.get_message()
            except ConnectionClosed as exc:
                reason = exc.reason
                detail = f"{reason.code} {reason.reason or ''}".strip() if reason else "closed"
                self.close_reason = self.close_reason or f"connection closed ({detail})"
                return
            self.frames_received += 1
            self.heard_at = trio.current_time()
            for incoming in self._conn.receive_all(data):
                self._route(incoming)

    def _route(self, incoming: Incoming[ReplyStream] | ProtocolError) -> None:
        """Take one incoming envelope (of a frame, or of a batch): a reply to its waiter,
        a request to :meth:`_admit`, a bad one to an Error reply."""
        if isinstance(incoming, ProtocolError):
            self.bad_frames += 1
            log.warning("session %s: bad frame: %s", self.name, incoming.message)
            if isinstance(incoming.waiter, ReplyStream):
                incoming.waiter.deliver(RemoteError(incoming.code, incoming.message))
            self._send_now(self._conn.error(incoming.reply_to, incoming.code, incoming.message))
        elif isinstance(incoming, Request):
            self._admit(incoming)
        elif isinstance(incoming, Reply):
            if incoming.waiter is not None:
                incoming.waiter.deliver(incoming)
        elif isinstance(incoming, StaleReply):
            log.debug("session %s: stale %s for %d", self.name, incoming.kind, incoming.reply_to)

    # --- requests ------------------------------------------------------------------------

    def _admit(self, request: Request) -> None:
        """Answer a ping at once; start, queue or refuse anything else (module docstring)."""
        if request.kind == "ping" and isinstance(request.message, pb.Ping):
            self._send_now(
                self._conn.reply(request.nonce, "pong", pb.Pong(time=request.message.time))
            )
            return
        if self._handler is None:
            self._refuse(request, "this side serves no requests")
            return
        if self.gatekeeper is not None:
            refusal = self.gatekeeper(request)
            if refusal is not None:
                self._send_now(
                    self._conn.error(
                        request.nonce,
                        refusal.code,
                        refusal.message,
                        retry_after=refusal.retry_after,
                    )
                )
                return
        cls = self._streams if request.stream else self._calls
        settings = self.settings
        if request.answer_within > 0:
            self._give_up_at[request.nonce] = trio.current_time() + request.answer_within
        if cls.active < settings.max_in_flight and not cls.waiting:
            self._start(cls, request)
        elif (
            len(cls.waiting) < settings.max_pending
            and cls.waiting_bytes + request.size <= settings.max_pending_bytes
        ):
            cls.waiting[request.nonce] = request
            cls.waiting_bytes += request.size
            when = self._give_up_at.get(request.nonce)
            if when is not None:
                heapq.heappush(self._bounds, (when, request.nonce))
                if self._bounds[0][1] == request.nonce:
                    self._bounds_lot.unpark()
        else:
            self._give_up_at.pop(request.nonce, None)
            self.refused += 1
            self._refuse(
                request,
                f"{cls.active + len(cls.waiting)} {cls.name} requests are already being "
                f"answered on this session; retry later",
            )

    def _refuse(self, request: Request, why: str) -> None:
        self._send_now(
            self._conn.error(
                request.nonce, pb.ERROR_CODE_UNAVAILABLE, why, retry_after=BUSY_RETRY_AFTER
            )
        )

    def _start(self, cls: _RequestClass, request: Request) -> None:
        assert self._nursery is not None
        cls.active += 1
        self._unanswered[request.nonce] = cls
        self._nursery.start_soon(self._handle, request)

    def _answered(self, nonce: int) -> None:
        """``nonce`` has its first answer: free its slot for the next waiting request."""
        self._give_up_at.pop(nonce, None)
        cls = self._unanswered.pop(nonce, None)
        if cls is None:
            return
        cls.active -= 1
        if cls.waiting and cls.active < self.settings.max_in_flight and not self._closed:
            self._start(cls, cls.next())

    def time_left(self, nonce: int) -> float:
        """Seconds until the sender of the peer's request ``nonce`` gives up on its first
        answer (``math.inf`` if it set no bound, or it has its answer); may be < 0."""
        when = self._give_up_at.get(nonce)
        return math.inf if when is None else when - trio.current_time()

    async def _expire_waiting(self) -> None:
        """Answer each waiting request whose sender has given up UNAVAILABLE, then: it is
        never handled (its bound, :attr:`Request.answer_within`, has passed)."""
        while True:
            while not self._bounds:
                await self._bounds_lot.park()
            when, nonce = self._bounds[0]
            if when > trio.current_time():
                with trio.move_on_at(when):
                    await self._bounds_lot.park()  # or an earlier bound came
                continue
            heapq.heappop(self._bounds)
            if self._give_up_at.get(nonce) != when:
                continue  # answered already (or a nonce the peer used again)
            for cls in (self._streams, self._calls):
                request = cls.take(nonce)
                if request is not None:
                    self._give_up_at.pop(nonce, None)
                    self.expired += 1
                    self._refuse(
                        request,
                        f"{request.kind} waited {request.answer_within:g}s for one of the "
                        f"{self.settings.max_in_flight} handlers of its class here "
                        f"({len(cls.waiting)} more wait), and its sender has given up; "
                        "it was not handled: retry later",
                    )

    async def _handle(self, request: Request) -> None:
        handler = self._handler
        assert handler is not None
        try:
            await handler(self, request)
            if request.nonce in self._unanswered:
                log.error("session %s: %s ended without an answer", self.name, request.kind)
                await self.error(request.nonce, pb.ERROR_CODE_INTERNAL, "no answer was made")
        except SessionClosed:
            pass
        except Exception as exc:
            log.exception("session %s: handler for %s failed", self.name, request.kind)
            with suppress(SessionClosed):
                await self.error(request.nonce, pb.ERROR_CODE_INTERNAL, f"internal error: {exc}")
        finally:
            self._answered(request.nonce)

    # --- the outbox and the writer -------------------------------------------------------

    def _enqueue(self, frame: bytes) -> None:
        self._outbox.append(frame)
        self._outbox_bytes += len(frame)
        self._writer_lot.unpark()
        if (
            self._outbox_bytes > self.settings.max_outbox
            and self._nursery is not None
            and not self.close_reason
        ):
            self.close_reason = "closing: the peer does not read"
            self._nursery.start_soon(
                self._close_for_not_reading,
                f"the peer does not read its replies: {self._outbox_bytes} bytes wait to be "
                f"written (max_outbox {self.settings.max_outbox})",
            )

    def _send_now(self, frame: bytes) -> None:
        """Queue a frame the reader must send (it never waits): never dropped while the
        session is open; the outbox bound ends a session whose peer does not read."""
        if not self._closed:
            self._enqueue(frame)

    async def _writer(self) -> None:
        timeout = self.settings.send_timeout
        try:
            while True:
                while not self._outbox:
                    for flushed in self._flushed:
                        flushed.set()
                    self._flushed.clear()
                    await self._writer_lot.park()
                ready = len(self._outbox)
                messages, taken = take_sendable(self._outbox, batches=self.peer_reads_batches)
                self._outbox_bytes -= taken
                frames = ready - len(self._outbox)
                for _ in range(frames):
                    self._make_room()  # one waiting sender a frame taken, as they came
                self.frames_sent += frames
                self.sends += 1
                with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
                    await send_messages(self.ws, messages)
                if scope.cancelled_caught:
                    await self._close_for_not_reading(
                        f"the peer does not read its replies: a frame waited {timeout:g}s "
                        "to be written"
                    )
                    return
        except ConnectionClosed:
            self._end("connection closed while sending")
        except trio.BrokenResourceError as exc:
            self._end(f"socket broken: {exc}")

    async def _flush(self) -> None:
        """Wait until the writer has written everything queued so far."""
        if not self._outbox and self._writer_lot.statistics().tasks_waiting:
            return  # nothing queued, and the writer waits for more
        flushed = trio.Event()
        self._flushed.append(flushed)
        await flushed.wait()

    async def _heartbeat(self) -> None:
        """Ping every ``ping_interval``; end the session once the peer is silent.

        A ping not answered within ``ping_timeout`` is forgiven while frames
        still arrive (the peer is busy, not gone): it stays in flight, and no
        other is sent until it is answered. The session ends only when a ping is
        unanswered and nothing at all came for ``ping_timeout`` seconds.
        """
        interval, timeout = self.settings.ping_interval, self.settings.ping_timeout
        answered: trio.Event | None = None
        while True:
            await trio.sleep(interval)
            if answered is None or answered.is_set():  # one ping in flight at a time
                answered = trio.Event()
                assert self._nursery is not None
                # the ping is never cancelled half-written: only the wait for its pong is timed
                self._nursery.start_soon(self._ping, answered)
            with trio.move_on_after(timeout):
                await answered.wait()
            if self._closed:
                return
            if answered.is_set():
                continue
            if trio.current_time() - self.heard_at < timeout:
                log.debug("session %s: pong late, but frames are arriving", self.name)
                continue
            log.warning("session %s: no pong nor frame within %ss, closing", self.name, timeout)
            self.close_reason = f"heartbeat: no pong within {timeout:g}s"
            with trio.move_on_after(1):
                await self.ws.aclose(1011, "heartbeat timeout")
            self._end(self.close_reason)
            return

    async def _ping(self, answered: trio.Event) -> None:
        with suppress(ConnectionClosed):
            await self.ws.ping()
            answered.set()

    # --- sending -------------------------------------------------------------------------

    async def _send(self, frame: bytes) -> None:
        """Queue ``frame`` for the writer, waiting while ``send_buffer`` bytes are unwritten.

        Raises SessionClosed if the session is (or gets) closed, ValueError for a
        frame over ``max_message_size``. Cancelled while waiting, nothing is sent.
        """
        await self._send_frames((frame,))

    async def _send_frames(self, frames: Sequence[bytes]) -> None:
        """Queue ``frames`` for the writer, in order and together (one wait for room, one
        checkpoint: the writer finds them all, so they go in one send); otherwise as
        :meth:`_send`. A frame over ``max_message_size`` raises ValueError before any is
        queued."""
        for frame in frames:
            if len(frame) > self.settings.max_message_size:
                raise ValueError(
                    f"frame of {len(frame)} bytes exceeds max_message_size "
                    f"{self.settings.max_message_size}"
                )
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise SessionClosed(f"session {self.name} is closed")
        if self._outbox_bytes >= self.settings.send_buffer or self._room_lot:
            # wait in line: the writer wakes one sender per frame it takes, in order, and
            # the one woken goes (so a thousand waiters cost one wake-up per frame, and
            # none of them waits behind later arrivals)
            await self._room_lot.park()
            if self._closed:
                raise SessionClosed(f"session {self.name} is closed")
        for frame in frames:
            self._enqueue(frame)
        self._make_room()
        await trio.lowlevel.cancel_shielded_checkpoint()

    def _make_room(self) -> None:
        """Wake the next waiting sender if the outbox is below ``send_buffer``, and the
        next stream waiting in :meth:`wait_for_room` if it is below ``stream_buffer``."""
        if self._room_lot and self._outbox_bytes < self.settings.send_buffer:
            self._room_lot.unpark()
        if self._stream_lot and self._outbox_bytes < self.settings.stream_buffer:
            self._stream_lot.unpark()

    async def wait_for_room(self) -> None:
        """Wait, in line with other streams, while ``stream_buffer`` bytes or more are
        unwritten; the writer wakes one waiting stream per frame it takes. A stream of
        run events calls this before it takes its next events, so that while the peer
        or the socket is behind, its events gather and go out merged. Raises
        SessionClosed if the session is (or gets) closed."""
        if self._outbox_bytes >= self.settings.stream_buffer or self._stream_lot:
            await self._stream_lot.park()
        else:
            await trio.lowlevel.checkpoint()
        if self._closed:
            raise SessionClosed(f"session {self.name} is closed")

    async def reply(self, reply_to: int, kind: str, message: Message) -> None:
        """Answer the peer's request ``reply_to`` (raises SessionClosed if gone)."""
        await self._send(self._conn.reply(reply_to, kind, message))
        self._answered(reply_to)

    async def reply_events(
        self,
        reply_to: int,
        first: pb.RunEvent,
        ready: Callable[[], Iterable[pb.RunEvent]],
    ) -> None:
        """Answer ``reply_to`` with run events: wait in line while the session is behind
        (:meth:`wait_for_room`), then send ``first`` and every event ``ready()`` gives
        now, neighbouring deltas merged (:func:`merge_deltas`). So a stream that keeps up
        sends each event as it comes, and one that is behind fewer, larger frames: the
        same text in the same order. ``ready`` is called only after the wait, so the
        events that came during it go too."""
        await self.wait_for_room()
        await self._send_frames(self._event_frames(reply_to, [first, *ready()]))
        self._answered(reply_to)

    async def reply_with_events(
        self, reply_to: int, kind: str, message: Message, events: Iterable[pb.RunEvent]
    ) -> None:
        """Answer ``reply_to`` with ``message`` (a stream's first answer: RunAccepted,
        RunInfo) and, in the same send, the run ``events`` that are here already,
        neighbouring deltas merged: an ack and the QUEUED and STARTED stored with the run
        go as one Batch frame to a peer that reads batches. Without waiting for room
        first (an answer never waits behind a stream that is behind)."""
        frames = [self._conn.reply(reply_to, kind, message)]
        frames += self._event_frames(reply_to, events)
        await self._send_frames(frames)
        self._answered(reply_to)

    def _event_frames(self, reply_to: int, events: Iterable[pb.RunEvent]) -> list[bytes]:
        """The frames answering ``reply_to`` with ``events``, neighbouring deltas merged."""
        return [self._conn.reply(reply_to, "run_event", m) for m in merge_deltas(events)]

    async def error(
        self, reply_to: int, code: int, message: str, *, retry_after: float | None = None
    ) -> None:
        """Answer the peer's request ``reply_to`` with an Error; it ends the exchange.
        ``retry_after``: seconds until a retry would likely succeed (None: no hint)."""
        await self._send(self._conn.error(reply_to, code, message, retry_after=retry_after))
        self._answered(reply_to)

    def open_request(
        self,
        kind: str,
        message: Message,
        *,
        ack_timeout: float | None = None,
        idle_timeout: float | None = None,
        answer_within: float = 0.0,
    ) -> ReplyStream:
        """Register a request and return the stream its replies will arrive on.

        The caller sends ``stream.frame`` itself; :meth:`stream` and
        :meth:`request` do both. The timeouts bound the wait for the first
        reply and between later ones (see :meth:`ReplyStream.__anext__`).
        ``answer_within`` (seconds, 0: none) tells the peer when we give up on the
        first reply (:attr:`Request.answer_within`): give less than ``ack_timeout``,
        so that its refusal reaches us in time.
        """
        if self._closed:
            raise SessionClosed(f"session {self.name} is closed")
        return ReplyStream(
            self._conn,
            kind,
            message,
            ack_timeout=ack_timeout,
            idle_timeout=idle_timeout,
            answer_within=answer_within,
        )

    @asynccontextmanager
    async def stream(
        self,
        kind: str,
        message: Message,
        *,
        ack_timeout: float | None = None,
        idle_timeout: float | None = None,
        answer_within: float = 0.0,
    ) -> AsyncIterator[ReplyStream]:
        """Send a request and yield its reply stream; leaving stops listening."""
        stream = self.open_request(
            kind,
            message,
            ack_timeout=ack_timeout,
            idle_timeout=idle_timeout,
            answer_within=answer_within,
        )
        try:
            await self._send(stream.frame)
            yield stream
        finally:
            stream.close()

    async def request(
        self,
        kind: str,
        message: Message,
        *,
        ack_timeout: float | None = None,
        answer_within: float = 0.0,
    ) -> Message:
        """Send a request and return its (first) answer.

        Raises RemoteError for an Error answer, SessionClosed if the session
        ends first and ReplyTimeout if no answer comes within ``ack_timeout``
        seconds (None: no bound). ``answer_within``: see :meth:`open_request`.
        """
        async with self.stream(
            kind, message, ack_timeout=ack_timeout, answer_within=answer_within
        ) as replies:
            return await replies.first()
