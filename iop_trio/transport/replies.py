"""The replies to one request of ours on a proto-socket session, as the caller reads them.

A :class:`ReplyStream` is the waiter the session's protocol state keeps for one
nonce: the session's reader hands it each reply (:meth:`ReplyStream.deliver`),
never waiting, and the caller iterates it, or takes what is here already
(:meth:`ReplyStream.ready`, so that the replies of one frame or batch go on
together).
"""

from __future__ import annotations

import math

import trio
from google.protobuf.message import Message

from ..protocol import ProtoConnection, Reply, pb
from ..protocol.errors import RemoteError, ReplyTimeout, SessionClosed

#: The replies a consumer may fall behind before its stream is cut (SessionClosed).
STREAM_BUFFER = 10_000


class ReplyStream:
    """The replies to one request, in order; iterate, or ``await first()``.

    Iteration ends after the final reply. An Error reply raises RemoteError;
    the session ending early raises SessionClosed. The session's protocol
    state ``conn`` keeps the stream as the waiter of its request's nonce, and
    the session's reader gives it each reply (:meth:`deliver`).
    """

    def __init__(
        self,
        conn: ProtoConnection[ReplyStream],
        kind: str,
        message: Message,
        *,
        ack_timeout: float | None = None,
        idle_timeout: float | None = None,
        answer_within: float = 0.0,
    ) -> None:
        self._conn = conn
        self.kind = kind
        self.nonce, self.frame = conn.request(kind, message, self, answer_within=answer_within)
        self._send, self._receive = trio.open_memory_channel[Reply[ReplyStream] | BaseException](
            STREAM_BUFFER
        )
        self._done = False
        self._answered = False
        self._held: Reply[ReplyStream] | BaseException | None = None  # taken, not yet given
        self.ack_timeout = ack_timeout
        self.idle_timeout = idle_timeout

    def __repr__(self) -> str:
        return f"<ReplyStream nonce={self.nonce} done={self._done}>"

    def deliver(self, item: Reply[ReplyStream] | BaseException) -> None:
        """Hand the consumer a reply, or the exception its next ``__anext__`` raises; the
        session's reader calls it, never waiting. A consumer that is
        :data:`STREAM_BUFFER` replies behind is cut off (its stream ends with
        SessionClosed) rather than stall the reader, and drops whatever comes after."""
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            # the consumer is far behind: end its stream rather than stall the reader
            self._conn.forget(self.nonce)
            self._send.close()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> Message:
        """The next reply. Raises ReplyTimeout if the first one takes more than
        ``ack_timeout`` seconds, or a later one more than ``idle_timeout`` (None: no bound)."""
        if self._done:
            raise StopAsyncIteration
        timeout = self.idle_timeout if self._answered else self.ack_timeout
        try:
            if self._held is not None:
                item, self._held = self._held, None
                await trio.lowlevel.checkpoint()
            else:
                with trio.fail_after(math.inf if timeout is None else timeout):
                    item = await self._receive.receive()
        except trio.TooSlowError:
            self.close()
            what = "went on with its replies to" if self._answered else "answered"
            raise ReplyTimeout(
                f"the peer has not {what} {self.kind} (nonce {self.nonce}) within {timeout:g}s"
            ) from None
        except trio.EndOfChannel:
            self._done = True
            raise SessionClosed(
                f"reply stream {self.nonce} cut: the consumer fell {STREAM_BUFFER} replies behind"
            ) from None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._answered = True
        if item.final:
            self._done = True
        if item.kind == "error":
            assert isinstance(item.message, pb.Error)
            error = item.message
            raise RemoteError(error.code, error.message, error.retry_after_s or None)
        return item.message

    def ready(self, limit: int = 1024) -> list[Message]:
        """The next replies that are here now, without waiting (at most ``limit``), up
        to and including a final one. An error, or the stream's end, is not taken: the
        next ``__anext__`` raises it, after the replies before it."""
        taken: list[Message] = []
        while not self._done and self._held is None and len(taken) < limit:
            try:
                item = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if isinstance(item, BaseException) or item.kind == "error":
                self._held = item
                break
            self._answered = True
            if item.final:
                self._done = True
            taken.append(item.message)
        return taken

    async def first(self) -> Message:
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise SessionClosed("no reply") from None

    def close(self) -> None:
        """Stop listening; later replies are dropped."""
        self._done = True
        self._conn.forget(self.nonce)
