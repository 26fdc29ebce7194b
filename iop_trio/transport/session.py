"""A proto-socket session: the Trio shell around :class:`ProtoConnection`.

One :class:`ProtoSession` per WebSocket. :meth:`ProtoSession.run` owns four
kinds of task, all ending with the session:

- the reader, which always drains the socket (so pings and pongs keep
  flowing however slow a consumer is) and routes each frame: a reply to its
  waiter, a request to a new handler task, a bad frame to an Error reply;
- the writer, the one task that writes to the socket: senders put frames on
  a bounded channel, so any number of tasks may send, a cancelled sender
  never leaves half a frame on the wire, and a slow peer pushes back;
- the heartbeat: a WebSocket ping every ``ping_interval`` seconds that must
  be answered within ``ping_timeout``, else the session ends (close 1011);
- one handler task per request, at most ``max_in_flight`` at a time (more
  are answered UNAVAILABLE at once).

Nothing a peer sends can make ``run`` raise: it returns the reason the
session ended.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

import attrs
import trio
from google.protobuf.message import Message
from trio_websocket import ConnectionClosed, WebSocketConnection

from ..protocol import ProtocolError, ProtoConnection, Reply, Request, Role, StaleReply, pb

log = logging.getLogger(__name__)

RequestHandler = Callable[["ProtoSession", Request], Awaitable[None]]

DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
STREAM_BUFFER = 10_000
_session_ids = itertools.count(1)


class SessionClosed(Exception):
    """The session ended before the answer came."""


class RemoteError(Exception):
    """The peer answered with an Error envelope."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{pb.ErrorCode.Name(code)}: {message}")
        self.code = code
        self.message = message


@attrs.frozen
class SessionSettings:
    """Per-session knobs. ``ping_interval`` 0 turns the heartbeat off."""

    ping_interval: float = 20.0
    ping_timeout: float = 10.0
    max_in_flight: int = 1024
    send_queue: int = 256
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE


class ReplyStream:
    """The replies to one request, in order; iterate, or ``await first()``.

    Iteration ends after the final reply. An Error reply raises RemoteError;
    the session ending early raises SessionClosed. The session's protocol
    state keeps the stream as the waiter of its request's nonce.
    """

    def __init__(self, session: ProtoSession, kind: str, message: Message) -> None:
        self._session = session
        self.nonce, self.frame = session._conn.request(kind, message, self)
        self._send, self._receive = trio.open_memory_channel[Reply[ReplyStream] | BaseException](
            STREAM_BUFFER
        )
        self._done = False

    def __repr__(self) -> str:
        return f"<ReplyStream nonce={self.nonce} done={self._done}>"

    def _deliver(self, item: Reply[ReplyStream] | BaseException) -> None:
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            # the consumer is far behind: end its stream rather than stall the reader
            self._session._conn.forget(self.nonce)
            self._send.close()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> Message:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            self._done = True
            raise SessionClosed(
                f"reply stream {self.nonce} cut: the consumer fell {STREAM_BUFFER} replies behind"
            ) from None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.final:
            self._done = True
        if item.kind == "error":
            assert isinstance(item.message, pb.Error)
            raise RemoteError(item.message.code, item.message.message)
        return item.message

    async def first(self) -> Message:
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise SessionClosed("no reply") from None

    def close(self) -> None:
        """Stop listening; later replies are dropped."""
        self._done = True
        self._session._conn.forget(self.nonce)


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
    ) -> None:
        self.ws = ws
        self.key = f"s{next(_session_ids)}"
        self.name = name or self.key
        self.settings = settings or SessionSettings()
        self._conn: ProtoConnection[ReplyStream] = ProtoConnection(role)
        self._handler = handler
        self._out_send, self._out_receive = trio.open_memory_channel[bytes](
            self.settings.send_queue
        )
        self._in_flight = 0
        self._closed = False
        self._nursery: trio.Nursery | None = None
        self.close_reason = ""
        self.started = trio.Event()
        self.ended = trio.Event()
        self.frames_received = 0
        self.bad_frames = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<ProtoSession {self.name} {self._conn.role.value} {state} "
            f"in_flight={self._in_flight} waiting={self._conn.pending}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    # --- running -------------------------------------------------------------------------

    async def run(self) -> str:
        """Serve the session until the connection ends; returns why it ended."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
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
            self._fail_waiters(SessionClosed(f"session {self.name} ended: {self.close_reason}"))
            self.ended.set()
        return self.close_reason

    def _end(self, reason: str) -> None:
        if not self.close_reason:
            self.close_reason = reason
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def aclose(self, code: int = 1000, reason: str = "closing") -> None:
        """Close the WebSocket and end the session."""
        self._end(reason)
        with trio.move_on_after(2):
            await self.ws.aclose(code, reason)

    def _fail_waiters(self, exc: BaseException) -> None:
        for stream in self._conn.forget_all():
            stream._deliver(exc)

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
            try:
                incoming = self._conn.receive(data)
            except ProtocolError as exc:
                self.bad_frames += 1
                log.warning("session %s: bad frame: %s", self.name, exc.message)
                if isinstance(exc.waiter, ReplyStream):
                    exc.waiter._deliver(RemoteError(exc.code, exc.message))
                self._send_nowait_or_drop(self._conn.error(exc.reply_to, exc.code, exc.message))
                continue
            if isinstance(incoming, Request):
                self._start_handler(incoming)
            elif isinstance(incoming, Reply):
                if incoming.waiter is not None:
                    incoming.waiter._deliver(incoming)
            elif isinstance(incoming, StaleReply):
                log.debug(
                    "session %s: stale %s for %d", self.name, incoming.kind, incoming.reply_to
                )

    def _send_nowait_or_drop(self, frame: bytes) -> None:
        # the reader must never block on the writer: a peer that floods us with
        # bad frames and reads nothing gets its error replies dropped
        try:
            self._out_send.send_nowait(frame)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            log.debug("session %s: error reply dropped", self.name)

    def _start_handler(self, request: Request) -> None:
        if request.kind == "ping" and isinstance(request.message, pb.Ping):
            self._send_nowait_or_drop(
                self._conn.reply(request.nonce, "pong", pb.Pong(time=request.message.time))
            )
            return
        if self._handler is None or self._in_flight >= self.settings.max_in_flight:
            self._send_nowait_or_drop(
                self._conn.error(
                    request.nonce,
                    pb.ERROR_CODE_UNAVAILABLE,
                    f"more than {self.settings.max_in_flight} requests in flight",
                )
            )
            return
        assert self._nursery is not None
        self._in_flight += 1
        self._nursery.start_soon(self._handle, request)

    async def _handle(self, request: Request) -> None:
        handler = self._handler
        assert handler is not None
        try:
            await handler(self, request)
        except SessionClosed:
            pass
        except Exception as exc:
            log.exception("session %s: handler for %s failed", self.name, request.kind)
            await self._try_send(
                self._conn.error(request.nonce, pb.ERROR_CODE_INTERNAL, f"internal error: {exc}")
            )
        finally:
            self._in_flight -= 1

    async def _try_send(self, frame: bytes) -> None:
        with suppress(SessionClosed):
            await self._send(frame)

    async def _writer(self) -> None:
        try:
            async for frame in self._out_receive:
                await self.ws.send_message(frame)
        except ConnectionClosed:
            self._end("connection closed while sending")
        except trio.BrokenResourceError as exc:
            self._end(f"socket broken: {exc}")

    async def _heartbeat(self) -> None:
        interval, timeout = self.settings.ping_interval, self.settings.ping_timeout
        while True:
            await trio.sleep(interval)
            try:
                with trio.fail_after(timeout):
                    await self.ws.ping()
            except trio.TooSlowError:
                log.warning("session %s: no pong within %ss, closing", self.name, timeout)
                self.close_reason = f"heartbeat: no pong within {timeout:g}s"
                with trio.move_on_after(1):
                    await self.ws.aclose(1011, "heartbeat timeout")
                self._end(self.close_reason)
                return
            except ConnectionClosed:
                return

    # --- sending -------------------------------------------------------------------------

    async def _send(self, frame: bytes) -> None:
        if self._closed:
            raise SessionClosed(f"session {self.name} is closed")
        if len(frame) > self.settings.max_message_size:
            raise ValueError(
                f"frame of {len(frame)} bytes exceeds max_message_size "
                f"{self.settings.max_message_size}"
            )
        try:
            await self._out_send.send(frame)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise SessionClosed(f"session {self.name} is closed") from None

    async def reply(self, reply_to: int, kind: str, message: Message) -> None:
        """Answer the peer's request ``reply_to`` (raises SessionClosed if gone)."""
        await self._send(self._conn.reply(reply_to, kind, message))

    async def error(self, reply_to: int, code: int, message: str) -> None:
        await self._send(self._conn.error(reply_to, code, message))

    def open_request(self, kind: str, message: Message) -> ReplyStream:
        """Register a request and return the stream its replies will arrive on.

        The caller sends ``stream.frame`` itself; :meth:`stream` and
        :meth:`request` do both.
        """
        if self._closed:
            raise SessionClosed(f"session {self.name} is closed")
        return ReplyStream(self, kind, message)

    @asynccontextmanager
    async def stream(self, kind: str, message: Message) -> AsyncIterator[ReplyStream]:
        """Send a request and yield its reply stream; leaving stops listening."""
        stream = self.open_request(kind, message)
        try:
            await self._send(stream.frame)
            yield stream
        finally:
            stream.close()

    async def request(self, kind: str, message: Message) -> Message:
        """Send a request and return its (first) answer.

        Raises RemoteError for an Error answer and SessionClosed if the
        session ends first. Bound the wait with ``trio.fail_after``.
        """
        async with self.stream(kind, message) as replies:
            return await replies.first()
