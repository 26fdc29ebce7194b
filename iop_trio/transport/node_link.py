"""The node's side of the link: dial the edge, say Hello, serve, reconnect.

:class:`NodeLink` keeps one session to the edge at a time. When a session
is lost, the foreground runs it asked for are cancelled (reason
``session_lost``); background runs go on and can be fetched from the next
session with GetRun / ListRuns. Reconnection waits a jittered exponential
backoff ("full jitter": uniform in [0, min(max, initial * 2**attempt)]),
reset once a session has been up for ``stable_after`` seconds.
"""

from __future__ import annotations

import logging
import random
import ssl

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
)

from ..model import redact_url
from ..protocol import Role, pb
from ..protocol.convert import hello_from_info
from ..runtime import Node
from .run_service import RunService
from .server import closing_race, lone_error
from .session import ProtoSession, RemoteError, ReplyTimeout, SessionClosed, SessionSettings
from .tls import OpeningTimeout, TLSFailed, open_websocket

log = logging.getLogger(__name__)


@attrs.frozen
class Backoff:
    """Jittered exponential backoff between connection attempts."""

    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 30.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The wait before retry number ``attempt`` (0-based)."""
        ceiling = min(self.maximum, self.initial * 2 ** min(attempt, 64))
        return rng.uniform(0, ceiling)


class NodeLink:
    """Connects ``node`` to the edge at ``url`` and keeps it connected."""

    def __init__(
        self,
        node: Node,
        url: str,
        *,
        token: str | None = None,
        settings: SessionSettings | None = None,
        backoff: Backoff | None = None,
        connect_timeout: float = 10.0,
        hello_timeout: float = 10.0,
        rng: random.Random | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.node = node
        self.url = url
        self.token = token
        self.ssl_context = ssl_context
        self.settings = settings or SessionSettings()
        self.backoff = backoff or Backoff()
        self.connect_timeout = connect_timeout
        self.hello_timeout = hello_timeout
        self._rng = rng or random.Random()
        self.service = RunService(node)
        self.session: ProtoSession | None = None
        self.sessions = 0  # sessions that got a HelloAck
        self.attempts = 0  # connection attempts, all told
        self.ended_attempts = 0  # attempts that have ended (failed, or a session lost)
        self.last_error = ""
        self._connected = trio.Event()
        self._attempt_ended = trio.Event()
        self._stopping = False
        self._scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        state = "connected" if self.session is not None else "disconnected"
        url = redact_url(self.url)
        return f"<NodeLink {self.node.node_id!r} -> {url} {state} sessions={self.sessions}>"

    async def wait_connected(self) -> ProtoSession:
        """Return the current session, waiting for one if there is none."""
        while self.session is None:
            await self._connected.wait()
        await trio.lowlevel.checkpoint()
        return self.session

    async def wait_attempts(self, count: int) -> None:
        """Return once ``count`` connection attempts have ended (at once if they have)."""
        while self.ended_attempts < count:
            await self._attempt_ended.wait()
        await trio.lowlevel.checkpoint()

    async def aclose(self, reason: str = "node stopping") -> None:
        """Close the current session cleanly (close code 1001) and stop reconnecting.

        The foreground runs of that session are cancelled like on any session
        loss; call :meth:`RunManager.drain` first to let them finish.
        """
        self._stopping = True
        session = self.session
        if session is not None:
            await session.aclose(1001, reason)
        if self._scope is not None:
            self._scope.cancel()

    async def run(self) -> None:
        """Connect, serve and reconnect until cancelled or :meth:`aclose`."""
        with trio.CancelScope() as self._scope:
            await self._run()

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            self.attempts += 1
            up_since: float | None = None
            try:
                up_since = await self._connect_once()
            except ConnectionRejected as exc:
                self.last_error = f"edge refused the connection: HTTP {exc.status_code}"
                if exc.status_code == 401:
                    self.last_error += " (check the node's edge token)"
            except TLSFailed as exc:
                self.last_error = str(exc)
            except (HandshakeError, ConnectionClosed, OSError, trio.BrokenResourceError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            except Exception as exc:
                # whatever one connection raises (groups included), the loop goes on
                log.exception("node %s: connection attempt failed", self.node.node_id)
                self.last_error = f"{type(exc).__name__}: {exc}"
            self.ended_attempts += 1
            self._attempt_ended.set()
            self._attempt_ended = trio.Event()
            if self._stopping:
                return
            if up_since is not None and trio.current_time() - up_since >= self.backoff.stable_after:
                failures = 0
            delay = self.backoff.delay(failures, self._rng)
            failures += 1
            log.warning(
                "node %s: link to %s down (%s); retry in %.2fs",
                self.node.node_id,
                redact_url(self.url),
                self.last_error,
                delay,
            )
            await trio.sleep(delay)

    async def _connect_once(self) -> float | None:
        """One connection; returns when it ends (the time it came up, None if it never did)."""
        up_since: float | None = None
        try:
            async with open_websocket(
                self.url,
                token=self.token,
                ssl_context=self.ssl_context,
                max_message_size=self.settings.max_message_size,
                connect_timeout=self.connect_timeout,
            ) as ws:
                up_since = await self._serve(ws)
        except OpeningTimeout as exc:
            self.last_error = str(exc)
        except Exception as exc:
            if not closing_race(exc):
                raise
            # a ping came while the session closed the socket: the end it was having
            log.debug("node %s: %s while closing", self.node.node_id, lone_error(exc))
        return up_since

    async def _restate(self, session: ProtoSession, described: int) -> None:
        """Send Hello again on ``session`` whenever what the node serves changes (a
        target's engine goes or comes back), so the edge routes by what is true now. A
        Hello the edge does not acknowledge is logged; the next change sends another."""
        while True:
            described = await self.node.wait_described(described)
            hello = hello_from_info(self.node.describe())
            try:
                await session.request("hello", hello, ack_timeout=self.hello_timeout)
            except (RemoteError, SessionClosed, ReplyTimeout) as exc:
                if session.closed:
                    return
                log.warning(
                    "node %s: the edge did not take its new Hello: %s", self.node.node_id, exc
                )

    async def _serve(self, ws: WebSocketConnection) -> float | None:
        session = ProtoSession(
            ws, Role.RUNNER, handler=self.service.handle, settings=self.settings, name="edge"
        )
        up_since: float | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.run)
                described = self.node.description
                hello = hello_from_info(self.node.describe())
                try:
                    ack = await session.request("hello", hello, ack_timeout=self.hello_timeout)
                except (RemoteError, SessionClosed, ReplyTimeout) as exc:
                    self.last_error = f"hello failed: {exc}"
                    nursery.cancel_scope.cancel()
                    return None
                assert isinstance(ack, pb.HelloAck)
                session.peer_reads_batches = ack.batches  # an older edge reads one a frame
                up_since = trio.current_time()
                self.sessions += 1
                self.session = session
                self._connected.set()
                log.info(
                    "node %s: connected to edge %s (session %s)",
                    self.node.node_id,
                    ack.edge_id,
                    ack.session_id,
                )
                nursery.start_soon(self._restate, session, described)
                await session.ended.wait()
                self.last_error = session.close_reason
                nursery.cancel_scope.cancel()
        finally:
            self.session = None
            self._connected = trio.Event()
            lost = self.node.manager.abandon(session.key, "session_lost")
            if lost:
                log.warning(
                    "node %s: session lost, cancelled %d foreground runs",
                    self.node.node_id,
                    len(lost),
                )
        return up_since
