"""Bounds on the connections a server takes: how many and for how long before they prove
who they are, and how many in all.

A server accepts a connection before it knows who is on it. A peer that opens
connections and never finishes its handshake (a WebSocket upgrade, a TLS handshake, an
HTTP request line sent a byte at a time) holds an open file with each; with enough of
them the process can accept nothing at all (``EMFILE``) and every route it serves stops
answering, for callers who hold a good token too.

A :class:`ConnectionGuard` counts the connections of the servers that share it (the
edge's proto-socket port and its OpenAI-compatible door share one, so together they stay
within the process's open-file limit). :class:`GuardedListener` puts it in front of a
listener. The rules (:class:`ConnectionBounds`):

- **In all**: at most ``max_connections`` at once (by default the open-file limit less a
  reserve for everything else). A connection over it is closed at once, whoever it is.
- **Before proof**: a connection is *unproven* from its accept until its server calls
  :meth:`ConnectionGuard.prove` (it authenticated). At most ``max_unproven_per_peer``
  unproven connections come from one peer address, and ``max_unproven`` in all (never
  more than half of ``max_connections``, so proven callers always have room). At either
  bound, the oldest unproven connection there that has been open ``evict_after`` seconds
  is dropped for the newcomer: a flood of handshakes that is held open gives way to a
  client that finishes its own at once. If none is that old, the newcomer is refused at
  once (a plain-TCP one gets ``HTTP 503`` with ``Retry-After`` first).
- **Handshake deadline**: an unproven connection is dropped once it has been open
  ``handshake_timeout`` seconds.
- **Slow readers** (a listener's ``send_timeout``, on proven connections; None: no
  bound): a ``send_all`` that waits longer than that for the peer to read breaks the
  connection. An HTTP server that shields its sends (hypercorn does) then sees its
  client gone.

Dropping a connection cancels what its stream waits for and closes it; whoever uses the
stream gets ``trio.BrokenResourceError``. Refusals are logged at most once every
:data:`LOG_EVERY` seconds, with a count.
"""

from __future__ import annotations

import collections
import logging
import math
import resource
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import NoReturn, TypeVar

import attrs
import trio

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Open files kept back from ``max_connections`` for everything else a process opens.
RESERVED_FILES = 64
#: Seconds between two log lines about refused connections.
LOG_EVERY = 10.0
#: What a refused plain-TCP connection is told before it is closed.
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 46\r\n\r\n"
    b"too many connections wait to authenticate now\n"
)


def open_file_limit() -> int:
    """The process's soft open-file limit (``RLIMIT_NOFILE``); a large number if none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


@attrs.frozen
class ConnectionBounds:
    """The bounds of a :class:`ConnectionGuard` (see the module docstring).

    ``max_connections`` None: the open-file limit less :data:`RESERVED_FILES` (at least 16).
    """

    max_connections: int | None = None
    max_unproven: int = 256
    max_unproven_per_peer: int = 32
    handshake_timeout: float = 10.0
    evict_after: float = 1.0

    def __attrs_post_init__(self) -> None:
        for name in ("max_unproven", "max_unproven_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_connections is not None and self.max_connections < 2:
            raise ValueError("max_connections must be at least 2")
        if not self.handshake_timeout > 0 or self.evict_after < 0:
            raise ValueError("handshake_timeout must be > 0 and evict_after >= 0")

    def connection_limit(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return max(16, open_file_limit() - RESERVED_FILES)


class Ticket:
    """One connection the guard let in: its peer, when it opened, whether it is proven."""

    def __init__(self, guard: ConnectionGuard, peer: str, address: object, opened: float) -> None:
        self.guard = guard
        self.peer = peer
        self.address = address
        self.opened = opened
        self.deadline = opened + guard.bounds.handshake_timeout
        self.proven = False
        self.dropped = ""  # why it was dropped ("" while it is not)
        self.released = False
        # the cancel scopes of what its stream waits for now -> the bound of a proven one
        self._waits: dict[trio.CancelScope, float | None] = {}

    def __repr__(self) -> str:
        state = (
            f"dropped ({self.dropped})" if self.dropped else "proven" if self.proven else "unproven"
        )
        return f"<Ticket {self.peer} {state} opened={self.opened:.3f}>"

    def _limit(self, timeout: float | None) -> float:
        if not self.proven:
            return self.deadline
        return math.inf if timeout is None else trio.current_time() + timeout

    @contextmanager
    def bounded(self, timeout: float | None = None) -> Iterator[trio.CancelScope]:
        """A scope for one wait of the connection's stream: cancelled at the handshake
        deadline while unproven, after ``timeout`` seconds once proven (None: never), or
        when the connection is dropped."""
        scope = trio.CancelScope(deadline=self._limit(timeout))
        if self.dropped:
            scope.cancel()
        self._waits[scope] = timeout
        try:
            with scope:
                yield scope
        finally:
            del self._waits[scope]

    def mark_proven(self) -> None:
        """Its connection proved who it is: its waits lose the handshake deadline.
        The guard's own step: call :meth:`ConnectionGuard.prove`, which also counts it."""
        self.proven = True
        for scope, timeout in self._waits.items():
            scope.deadline = self._limit(timeout)

    def mark_dropped(self, why: str) -> None:
        """Its connection is dropped (``why``): every wait of its stream is cancelled.
        The guard's own step: call :meth:`ConnectionGuard.drop`, which also releases it."""
        self.dropped = why
        for scope in self._waits:
            scope.cancel()


class ConnectionGuard:
    """See the module docstring. Not thread-safe: one Trio run's servers share it."""

    def __init__(self, bounds: ConnectionBounds | None = None) -> None:
        self.bounds = bounds or ConnectionBounds()
        self.max_connections = self.bounds.connection_limit()
        self.max_unproven = min(self.bounds.max_unproven, max(1, self.max_connections // 2))
        self.open = 0
        # unproven tickets, oldest first: all of them, and by peer address
        self._unproven: dict[Ticket, None] = {}
        self._by_peer: dict[str, dict[Ticket, None]] = collections.defaultdict(dict)
        self._by_address: dict[object, Ticket] = {}
        self.refused = 0
        self.dropped = 0
        self._refused_unlogged = 0
        self._logged_at = -math.inf

    def __repr__(self) -> str:
        return (
            f"<ConnectionGuard open={self.open}/{self.max_connections} "
            f"unproven={len(self._unproven)}/{self.max_unproven} refused={self.refused} "
            f"dropped={self.dropped}>"
        )

    @property
    def unproven(self) -> int:
        return len(self._unproven)

    def unproven_from(self, peer: str) -> int:
        return len(self._by_peer.get(peer, ()))

    def admit(self, peer: str, address: object = None) -> Ticket | None:
        """A ticket for a new connection from ``peer`` (its address, without the port), or
        None if it is refused; may drop an old unproven connection to make room.
        ``address`` (the whole peer address) lets :meth:`prove_address` find it."""
        now = trio.current_time()
        if self.open >= self.max_connections:
            return self._refuse(
                peer, f"{self.open} connections are open (max {self.max_connections})"
            )
        mine = self._by_peer.get(peer, {})
        if len(mine) >= self.bounds.max_unproven_per_peer and not self._evict(
            mine, now, f"a newer connection from {peer}"
        ):
            return self._refuse(
                peer,
                f"{len(mine)} of its connections wait to authenticate "
                f"(max_unproven_per_peer {self.bounds.max_unproven_per_peer})",
            )
        if len(self._unproven) >= self.max_unproven and not self._evict(
            self._unproven, now, "a newer connection"
        ):
            return self._refuse(
                peer,
                f"{len(self._unproven)} connections wait to authenticate "
                f"(max_unproven {self.max_unproven})",
            )
        ticket = Ticket(self, peer, address, now)
        self.open += 1
        self._unproven[ticket] = None
        self._by_peer[peer][ticket] = None
        if address is not None:
            self._by_address[address] = ticket
        return ticket

    def _evict(self, tickets: dict[Ticket, None], now: float, why: str) -> bool:
        """Drop the oldest of ``tickets`` if it has been open ``evict_after``; whether it was."""
        oldest = next(iter(tickets), None)
        if oldest is None or now - oldest.opened < self.bounds.evict_after:
            return False
        self.drop(oldest, f"dropped for {why}")
        return True

    def _refuse(self, peer: str, why: str) -> Ticket | None:
        """Count and (now and then) log a refusal; None, the answer to the newcomer."""
        self.refused += 1
        self._refused_unlogged += 1
        now = trio.current_time()
        if now - self._logged_at >= LOG_EVERY:
            log.warning(
                "refused %d connection(s) in the last %gs; the last from %s: %s",
                self._refused_unlogged,
                LOG_EVERY,
                peer,
                why,
            )
            self._logged_at = now
            self._refused_unlogged = 0
        return None

    def prove(self, ticket: Ticket) -> None:
        """``ticket``'s connection proved who it is: no handshake deadline, no longer counted
        among the unproven. A dropped or released ticket stays as it is."""
        if ticket.proven or ticket.dropped or ticket.released:
            return
        self._forget_unproven(ticket)
        ticket.mark_proven()

    def prove_address(self, address: object) -> None:
        """:meth:`prove` the connection whose whole peer address is ``address`` (an HTTP
        server's ``scope["client"]``), if it is one of this guard's."""
        ticket = self._by_address.get(address)
        if ticket is not None:
            self.prove(ticket)

    def drop(self, ticket: Ticket, why: str) -> None:
        """Drop ``ticket``'s connection: its stream's waits are cancelled, and it no longer
        counts (its stream closes at once)."""
        if ticket.dropped or ticket.released:
            return
        self.dropped += 1
        log.debug("dropping the connection from %s: %s", ticket.peer, why)
        ticket.mark_dropped(why)
        self.release(ticket)

    def expire(self, ticket: Ticket) -> None:
        """``ticket`` reached its handshake deadline unproven: drop it."""
        if not ticket.proven:
            self.drop(ticket, f"not authenticated within {self.bounds.handshake_timeout:g}s")

    def release(self, ticket: Ticket) -> None:
        """The connection closed (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        self.open -= 1
        self._forget_unproven(ticket)
        if self._by_address.get(ticket.address) is ticket:
            del self._by_address[ticket.address]

    def _forget_unproven(self, ticket: Ticket) -> None:
        if self._unproven.pop(ticket, False) is None:
            mine = self._by_peer[ticket.peer]
            del mine[ticket]
            if not mine:
                del self._by_peer[ticket.peer]


class GuardedStream(trio.abc.HalfCloseableStream):
    """A socket stream whose waits a :class:`Ticket` bounds (see the module docstring).

    ``socket`` is the inner stream's, so servers that ask for the peer's address find it.
    ``send_timeout``: see the module docstring (None: no bound).
    """

    def __init__(
        self, inner: trio.SocketStream, ticket: Ticket, *, send_timeout: float | None = None
    ) -> None:
        self.inner = inner
        self.ticket = ticket
        self.send_timeout = send_timeout

    def __repr__(self) -> str:
        return f"<GuardedStream {self.ticket!r}>"

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    async def _broken(self) -> NoReturn:
        ticket = self.ticket
        if not ticket.dropped:
            if ticket.proven:
                ticket.guard.drop(ticket, f"the peer read nothing for {self.send_timeout:g}s")
            else:
                ticket.guard.expire(ticket)
        await trio.aclose_forcefully(self.inner)
        raise trio.BrokenResourceError(f"connection from {ticket.peer} dropped: {ticket.dropped}")

    async def _bounded(self, bound: float | None, wait: Callable[[], Awaitable[T]]) -> T:
        """``await wait()`` within the ticket's bounds (:meth:`Ticket.bounded`, ``bound``
        once proven); past them the connection is dropped and BrokenResourceError raised."""
        with self.ticket.bounded(bound):
            return await wait()
        await self._broken()  # the scope was cancelled: the wait was cut short

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._bounded(self.send_timeout, lambda: self.inner.send_all(data))

    async def wait_send_all_might_not_block(self) -> None:
        await self._bounded(self.send_timeout, self.inner.wait_send_all_might_not_block)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._bounded(None, lambda: self.inner.receive_some(max_bytes))

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        self.ticket.guard.release(self.ticket)
        await self.inner.aclose()


class GuardedListener(trio.abc.Listener[GuardedStream]):
    """``inner``'s connections, each let in (or refused at once) by ``guard``.

    ``refusal``: bytes written to a refused connection before it is closed (None: closed
    at once; a TLS listener wraps this one, so nothing can be said in the clear).
    ``send_timeout``: the streams' (see :class:`GuardedStream`).
    """

    def __init__(
        self,
        inner: trio.SocketListener,
        guard: ConnectionGuard,
        *,
        refusal: bytes | None = REFUSAL,
        send_timeout: float | None = None,
    ) -> None:
        self.inner = inner
        self.guard = guard
        self.refusal = refusal
        self.send_timeout = send_timeout

    def __repr__(self) -> str:
        return f"<GuardedListener {self.inner.socket.getsockname()} {self.guard!r}>"

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    async def accept(self) -> GuardedStream:
        while True:
            stream = await self.inner.accept()
            try:
                address = stream.socket.getpeername()
            except OSError:  # gone already
                await trio.aclose_forcefully(stream)
                continue
            peer = str(address[0]) if isinstance(address, tuple) else str(address)
            key = tuple(address[:2]) if isinstance(address, tuple) else address
            ticket = self.guard.admit(peer, key)
            if ticket is not None:
                return GuardedStream(stream, ticket, send_timeout=self.send_timeout)
            await self._refuse(stream)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        with trio.move_on_after(0.05):
            if self.refusal is not None:
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(self.refusal)
        await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def open_guarded_listeners(
    port: int,
    host: str,
    guard: ConnectionGuard,
    *,
    refusal: bytes | None = REFUSAL,
    send_timeout: float | None = None,
) -> list[GuardedListener]:
    """TCP listeners on ``host:port`` (0: any free port) guarded by ``guard``. OSError if
    the address cannot be bound."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    return [
        GuardedListener(listener, guard, refusal=refusal, send_timeout=send_timeout)
        for listener in listeners
    ]
