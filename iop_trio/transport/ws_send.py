"""Several WebSocket messages in one send, over trio-websocket's own connection.

trio-websocket writes one message a send (``WebSocketConnection.send_message``): a
frame that is ready beside others still costs a ``send`` system call of its own, on
this machine about 0.1 ms each. :func:`send_messages` writes ``messages`` as binary
messages with one ``send_all``: each is framed by the connection's own wsproto state
machine, in order, exactly as ``send_message`` frames it, and the bytes go under the
connection's send lock, so they never interleave with a ping, a pong or a close that
trio-websocket writes itself.

This is the one place the package reaches inside trio-websocket (its ``_wsproto``,
``_stream``, ``_stream_lock``, ``_close_reason`` and ``_abort_web_socket``, the same
names from 0.12.0, the floor, to now; ``tests/test_ws_send.py`` holds the layer to
them on a real connection). Upstream, it would be a ``send_messages`` method beside
``send_message``; the semantics here are the ones such a method would have:

- an empty ``messages`` sends nothing (a checkpoint only);
- a connection closed, or being closed, raises ConnectionClosed before anything
  is framed; a stream that breaks while sending aborts the connection and raises
  ConnectionClosed, as ``send_message`` does;
- cancelled while waiting for the lock, nothing was framed that is not sent: the
  frames are made under the lock, right before the one ``send_all``; cancelled
  during it, the connection is as ``send_message`` leaves it (the stream is broken
  and the connection aborts).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.events import BytesMessage


async def send_messages(ws: WebSocketConnection, messages: Sequence[bytes]) -> None:
    """Write ``messages`` to ``ws`` as binary WebSocket messages, in order, in one send
    (see the module docstring for its edge cases)."""
    if not messages:
        await trio.lowlevel.checkpoint()
        return
    if len(messages) == 1:
        await ws.send_message(messages[0])
        return
    if ws._close_reason:  # noqa: SLF001
        raise ConnectionClosed(ws._close_reason)  # noqa: SLF001
    async with ws._stream_lock:  # noqa: SLF001
        if ws._close_reason:  # noqa: SLF001  (closed while this waited for the lock)
            raise ConnectionClosed(ws._close_reason)  # noqa: SLF001
        framing = ws._wsproto  # noqa: SLF001
        data = b"".join(framing.send(BytesMessage(data=message)) for message in messages)
        try:
            await ws._stream.send_all(data)  # noqa: SLF001
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await ws._abort_web_socket()  # noqa: SLF001
            assert ws._close_reason is not None  # noqa: SLF001
            raise ConnectionClosed(ws._close_reason) from None  # noqa: SLF001
