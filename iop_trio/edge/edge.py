"""The reference edge: accepts nodes, keeps their Hello, routes runs to them.

Two proto-socket endpoints on one port:

- ``/node``: nodes dial in and send Hello; the edge answers HelloAck and
  from then on sends them run requests. A node that reconnects with the
  same id replaces its old session.
- ``/client``: run requests from clients (the ``iop-node submit`` CLI),
  routed to a node that serves the target (the one with the fewest runs in
  flight through this edge) and relayed back, events and all. A client that
  goes away cancels the foreground runs it was following.

The Python API (:meth:`Edge.run`, :meth:`Edge.cancel`, :meth:`Edge.node`...)
does the same routing for code running next to the edge.

What a stranger can cost it is bounded (:mod:`iop_trio.transport.guard`): a
connection that has not authenticated within ``bounds.handshake_timeout`` is closed,
and the connections that wait to authenticate are bounded per peer address and in
all, as are all connections (the OpenAI door shares the same guard). With identities,
each caller's requests are bounded too (its rate and its runs in flight, see
:mod:`.identities`): over them, ``RATE_LIMITED`` with a retry hint.

A client's request that says when its sender gives up (``answer_within``) and waits
on the client's session past it is answered UNAVAILABLE and never relayed; one that
is relayed passes the time left on to the node, less :data:`HOP_MARGIN`, so the node
refuses it rather than make a run for a caller who is gone.
"""

from __future__ import annotations

import collections
import logging
import math
import ssl
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress

import trio
from opentelemetry.trace import Span, TracerProvider
from trio_websocket import WebSocketConnection

from ..model import InvalidRequest, RunSpec, TokenBucket, tenant_problem
from ..protocol import Request, Role, pb

# the edge's refusals are the protocol's error table's (re-exported: public names here)
from ..protocol.errors import NODE_RETRY_AFTER as NODE_RETRY_AFTER
from ..protocol.errors import Forbidden as Forbidden
from ..protocol.errors import NodeGone as NodeGone
from ..protocol.errors import NoNode as NoNode
from ..protocol.errors import RateLimited as RateLimited
from ..protocol.errors import TooLateToRelay, refusal_for
from ..tracing import context_of, fail, get_tracer, headers_of, parent
from ..transport.caller import ACK_TIMEOUT, RunnerClient, RunStream
from ..transport.guard import ConnectionBounds, ConnectionGuard
from ..transport.server import serve_proto, shared_token
from ..transport.session import (
    Gatekeeper,
    ProtoSession,
    Refusal,
    RemoteError,
    ReplyTimeout,
    SessionClosed,
    SessionSettings,
)
from .identities import Caller, Identities, NodeIdentity
from .spans import carry, client_span, relay_span

log = logging.getLogger(__name__)

RUN_OWNERS_KEPT = 100_000
#: The retry hint (seconds) of a caller refused for having its most runs open.
RUNS_RETRY_AFTER = 1.0
#: Seconds of a relayed request's time left that the edge keeps for the node's answer
#: to come back through it: the node is told its sender gives up that much sooner.
HOP_MARGIN = 1.0
#: The least time left (seconds) for which a request is still relayed to a node.
MIN_RELAY_TIME = 0.25


class NodeHandle(RunnerClient):
    """A connected node: its Hello and the calls the edge can make on it."""

    def __init__(
        self, hello: pb.Hello, session: ProtoSession, *, ack_timeout: float | None = ACK_TIMEOUT
    ) -> None:
        super().__init__(session, ack_timeout=ack_timeout)
        self.targets: frozenset[str] = frozenset()
        self.unavailable: dict[str, str] = {}
        self.hello = hello
        self.in_flight = 0

    def __repr__(self) -> str:
        return (
            f"<NodeHandle {self.node_id!r} targets={sorted(self.targets)} "
            f"in_flight={self.in_flight} {'closed' if self.session.closed else 'open'}>"
        )

    @property
    def hello(self) -> pb.Hello:
        """What the node said it serves, last (it says it again when that changes)."""
        return self._hello

    @hello.setter
    def hello(self, hello: pb.Hello) -> None:
        # read for every run the edge routes: worked out once per Hello, not per run
        self._hello = hello
        self.targets = frozenset(t.name for t in hello.targets)
        #: its targets whose engine cannot serve them now, with why
        self.unavailable = {t.name: t.unavailable for t in hello.targets if t.unavailable}

    @property
    def node_id(self) -> str:
        return self._hello.node_id


class Edge:
    """See the module docstring. ``token`` None accepts anyone (tests, demos).

    ``ack_timeout`` bounds the wait for a node's first answer to any request
    the edge makes or relays (a client then gets UNAVAILABLE).

    ``client_tenant`` is the tenant of every run a client asks for: the edge
    sets it, whatever the client sent.

    With ``identities`` (:mod:`iop_trio.edge.identities`) every caller and
    every node has a token of its own, and ``token`` is not used: a node's
    token is good for its own node id only, and a caller's runs are its own
    (its tenant, its targets, its highest priority, its rate and runs in flight;
    it sees, follows and cancels only its runs, whose ids start with ``<caller>:``).

    ``bounds`` bound the connections of :meth:`serve` and of the OpenAI door served
    with :func:`~iop_trio.edge.front_door.serve_door`, together (``guard``).

    Its spans (:mod:`.spans`) are made by ``tracer_provider`` (None: the global
    provider, which makes none until one is installed).
    """

    def __init__(
        self,
        *,
        token: str | None,
        edge_id: str = "edge",
        settings: SessionSettings | None = None,
        ack_timeout: float | None = ACK_TIMEOUT,
        client_tenant: str = "",
        identities: Identities | None = None,
        ssl_context: ssl.SSLContext | None = None,
        bounds: ConnectionBounds | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        problem = tenant_problem(client_tenant)
        if problem is not None:
            raise ValueError(problem)
        self.token = token
        self.identities = identities
        self.ssl_context = ssl_context  # wss:// (transport.tls.server_context)
        self._shared = shared_token(token)
        self.client_tenant = client_tenant
        self.edge_id = edge_id
        self.settings = settings or SessionSettings()
        self.ack_timeout = ack_timeout
        self.nodes: dict[str, NodeHandle] = {}
        # targets some node has served, so a target whose node is gone is retryable
        self._served: set[str] = set()
        self.clients: dict[str, ProtoSession] = {}  # the /client sessions open now, by key
        self.port: int | None = None
        self.host = "127.0.0.1"
        self._changed = trio.Event()
        self._run_owner: OrderedDict[str, str] = OrderedDict()
        self.guard = ConnectionGuard(bounds)
        # each caller's request rate, and its runs open through the edge, by name
        self._rates: dict[str, TokenBucket] = {}
        self.open_runs: collections.Counter[str] = collections.Counter()
        self.tracer = get_tracer(tracer_provider)

    def __repr__(self) -> str:
        return f"<Edge {self.edge_id!r} port={self.port} nodes={sorted(self.nodes)}>"

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the edge is not serving yet")
        scheme = "ws" if self.ssl_context is None else "wss"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def node_url(self) -> str:
        return f"{self.url}/node"

    @property
    def client_url(self) -> str:
        return f"{self.url}/client"

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen until cancelled; ``task_status`` gets the bound port. OSError if the
        port cannot be bound."""
        self.host = host
        edge = self

        class Started:
            def started(self, bound: int) -> None:
                edge.port = bound
                log.info("edge %s listening on %s", edge.edge_id, edge.url)
                task_status.started(bound)

        await serve_proto(
            {"/node": self._on_node, "/client": self._on_client},
            host,
            port,
            authorize=self.authorize,
            ssl_context=self.ssl_context,
            max_message_size=self.settings.max_message_size,
            guard=self.guard,
            task_status=Started(),  # type: ignore[arg-type]
        )

    def authorize(self, path: str, token: str | None) -> object | None:
        """Who a connection to ``path`` with ``token`` is (None: refused)."""
        if self.identities is None:
            return bool(self._shared(path, token)) or None
        if token is None:
            return None
        if path == "/node":
            return self.identities.node(token)
        return self.identities.caller(token)

    # --- nodes ---------------------------------------------------------------------------

    async def _on_node(self, ws: WebSocketConnection, who: object) -> None:
        node = who if isinstance(who, NodeIdentity) else None

        async def on_request(session: ProtoSession, request: Request) -> None:
            await self._on_node_request(session, request, node)

        session = ProtoSession(
            ws, Role.EDGE, handler=on_request, settings=self.settings, name="node?"
        )
        try:
            reason = await session.run()
        finally:
            for node_id, handle in list(self.nodes.items()):
                if handle.session is session:
                    del self.nodes[node_id]
                    self._notify()
                    log.info("edge: node %s left (%s)", node_id, session.close_reason)
        log.debug("edge: node session %s ended: %s", session.name, reason)

    async def _on_node_request(
        self, session: ProtoSession, request: Request, node: NodeIdentity | None
    ) -> None:
        hello = request.message
        assert isinstance(hello, pb.Hello)
        if not hello.node_id:
            await session.error(request.nonce, pb.ERROR_CODE_INVALID, "hello without a node_id")
            return
        if node is not None and hello.node_id != node.node_id:
            log.warning(
                "edge: refused a node saying it is %r with the token of node %r",
                hello.node_id,
                node.node_id,
            )
            await session.error(
                request.nonce,
                pb.ERROR_CODE_FORBIDDEN,
                f"this token is for node {node.node_id!r}, not {hello.node_id!r}",
            )
            await session.aclose(1008, "wrong node id for this token")
            return
        session.peer_reads_batches = hello.batches  # an older node reads one a frame
        old = self.nodes.get(hello.node_id)
        if old is not None and old.session is session:
            # the same session says what it serves now (a target's engine came or went)
            old.hello = hello
            self._served |= old.targets
            await session.reply(
                request.nonce,
                "hello_ack",
                pb.HelloAck(edge_id=self.edge_id, session_id=session.key, batches=True),
            )
            self._notify()
            return
        if old is not None:
            log.warning("edge: node %s reconnected; closing its old session", hello.node_id)
            await old.session.aclose(4000, "replaced by a newer session")
        session.name = f"node:{hello.node_id}"
        handle = NodeHandle(hello, session, ack_timeout=self.ack_timeout)
        self.nodes[hello.node_id] = handle
        self._served |= handle.targets
        await session.reply(
            request.nonce,
            "hello_ack",
            pb.HelloAck(edge_id=self.edge_id, session_id=session.key, batches=True),
        )
        log.info(
            "edge: node %s v%s joined with targets %s",
            hello.node_id,
            hello.version,
            ", ".join(t.name for t in hello.targets),
        )
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for_node(
        self,
        node_id: str | None = None,
        *,
        target: str = "",
        other_than: NodeHandle | None = None,
    ) -> NodeHandle:
        """Wait until a node (that one, or any serving ``target``, or any) is connected.

        ``other_than`` skips that handle: pass the old one to wait for a reconnection.
        """
        while True:
            for handle in self.nodes.values():
                if (
                    (node_id is None or handle.node_id == node_id)
                    and (not target or target in handle.targets)
                    and handle is not other_than
                ):
                    await trio.lowlevel.checkpoint()
                    return handle
            await self._changed.wait()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true, checked whenever a node or client
        comes or goes (at once if it is true now)."""
        while not predicate():
            await self._changed.wait()
        await trio.lowlevel.checkpoint()

    def node(self, node_id: str) -> NodeHandle:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise NoNode(f"node {node_id!r} is not connected") from None

    def route(self, target: str) -> NodeHandle:
        """The connected node for ``target`` with the fewest runs in flight through the edge.

        Only a node whose engine for ``target`` is available is chosen. Raises
        NodeGone if only nodes that are not connected now served it, or every node
        serving it says its engine is unavailable (a node says so in its Hello, again
        whenever that changes); NoNode if none ever did.
        """
        serving = [h for h in self.nodes.values() if target in h.targets]
        available = [h for h in serving if target not in h.unavailable]
        if not available:
            if serving:
                why = "; ".join(f"{h.node_id}: {h.unavailable[target]}" for h in serving)
                raise NodeGone(f"target {target!r} is unavailable on every node ({why})")
            if target in self._served:
                raise NodeGone(f"no node serving {target!r} is connected now; retry later")
            known = sorted({t for h in self.nodes.values() for t in h.targets})
            raise NoNode(f"no connected node serves {target!r} (served: {', '.join(known)})")
        return min(available, key=lambda h: h.in_flight)

    def _remember(self, run_id: str, node_id: str) -> None:
        self._run_owner[run_id] = node_id
        self._run_owner.move_to_end(run_id)
        while len(self._run_owner) > RUN_OWNERS_KEPT:
            self._run_owner.popitem(last=False)

    async def owner_of(self, run_id: str) -> NodeHandle:
        """The node that has ``run_id``: remembered, else asked of every node."""
        node_id = self._run_owner.get(run_id)
        if node_id is not None and node_id in self.nodes:
            await trio.lowlevel.checkpoint()
            return self.nodes[node_id]
        for handle in list(self.nodes.values()):
            try:
                await handle.get_run(run_id)
            except (RemoteError, SessionClosed, ReplyTimeout):
                continue
            self._remember(run_id, handle.node_id)
            return handle
        raise NoNode(f"no connected node knows run {run_id!r}")

    # --- the Python API ------------------------------------------------------------------

    @asynccontextmanager
    async def run(self, spec: RunSpec) -> AsyncIterator[RunStream]:
        """Route ``spec`` to a node and stream its events (raises NoNode). The relay is a
        span (``iop.relay``), the child of ``spec.traceparent``'s, and the node's parent."""
        handle = self.route(spec.target)
        handle.in_flight += 1
        relay = relay_span(self.tracer, parent(spec.traceparent, spec.tracestate), handle.node_id)
        try:
            async with handle.run(carry(spec, relay)) as stream:
                self._remember(stream.run_id, handle.node_id)
                yield stream
        except BaseException as exc:
            fail(relay, type(exc).__name__, str(exc))
            raise
        finally:
            handle.in_flight -= 1
            relay.end()

    async def cancel(self, run_id: str, reason: str = "") -> pb.CancelResult:
        return await (await self.owner_of(run_id)).cancel(run_id, reason)

    async def get_run(
        self, run_id: str, *, include_events: bool = False, after_seq: int = 0
    ) -> pb.RunInfo:
        handle = await self.owner_of(run_id)
        return await handle.get_run(run_id, include_events=include_events, after_seq=after_seq)

    # --- callers' limits -------------------------------------------------------------

    def take_request(self, caller: Caller | None) -> None:
        """Count one request of ``caller`` against its rate; RateLimited if it is over it.
        Without identities (None) nothing is counted."""
        if caller is None:
            return
        limits = caller.limits
        bucket = self._rates.get(caller.name)
        now = trio.current_time()
        if bucket is None:
            bucket = self._rates[caller.name] = TokenBucket(
                limits.requests_per_second, limits.bucket_size, now
            )
        wait = bucket.take(now)
        if wait is not None:
            raise RateLimited(
                f"caller {caller.name!r} is over its rate ({limits.requests_per_second:g} "
                f"requests a second, {limits.bucket_size:g} at once); retry in {wait:.2f}s",
                wait,
            )

    @contextmanager
    def counting_run(self, caller: Caller | None) -> Iterator[None]:
        """Count one run of ``caller`` open through the edge while in the block;
        RateLimited at once if it has its ``max_runs`` open already."""
        if caller is None:
            yield
            return
        if self.open_runs[caller.name] >= caller.limits.max_runs:
            raise RateLimited(
                f"caller {caller.name!r} has {caller.limits.max_runs} runs open through "
                "this edge (its max_runs); retry when one has ended",
                RUNS_RETRY_AFTER,
            )
        self.open_runs[caller.name] += 1
        try:
            yield
        finally:
            self.open_runs[caller.name] -= 1
            if not self.open_runs[caller.name]:
                del self.open_runs[caller.name]

    def _gatekeeper(self, caller: Caller) -> Gatekeeper:
        """Refuses a request of ``caller``'s over its rate before its session queues it."""

        def check(request: Request) -> Refusal | None:
            try:
                self.take_request(caller)
            except RateLimited as exc:
                return refusal_for(exc, request.kind)
            return None

        return check

    # --- clients -------------------------------------------------------------------------

    async def _on_client(self, ws: WebSocketConnection, who: object) -> None:
        caller = who if isinstance(who, Caller) else None

        async def handle(session: ProtoSession, request: Request) -> None:
            await self._on_client_request(session, request, caller)

        session = ProtoSession(
            ws,
            Role.RUNNER,
            handler=handle,
            settings=self.settings,
            name=f"client:{caller.name}" if caller else "client",
            gatekeeper=None if caller is None else self._gatekeeper(caller),
        )
        self.clients[session.key] = session
        self._notify()
        try:
            reason = await session.run()
        finally:
            del self.clients[session.key]
            self._notify()
        log.debug("edge: client session %s ended: %s", session.key, reason)

    def _relay_bounds(self, session: ProtoSession, nonce: int) -> tuple[float | None, float | None]:
        """How long to wait for a node's answer to the client's request ``nonce`` and the
        bound to give the node: the client's time left (less :data:`HOP_MARGIN` for the
        node), or for a client that gave none the edge's own ``ack_timeout`` and the
        bound that goes with it (None). TooLateToRelay if too little is left to relay it."""
        left = session.time_left(nonce)
        if left == math.inf:
            return self.ack_timeout, None
        within = left - HOP_MARGIN
        if within < MIN_RELAY_TIME:
            raise TooLateToRelay(
                f"its sender gives up in {max(left, 0):.2f}s: too soon for a node's answer; "
                "retry later"
            )
        # the node answers by ``within``; waiting a little past ``left`` lets a late answer
        # through on a busy machine (the client keeps more than that back for its answer)
        ack = left + HOP_MARGIN / 2
        return (ack if self.ack_timeout is None else min(self.ack_timeout, ack)), within

    async def _on_client_request(
        self, session: ProtoSession, request: Request, caller: Caller | None
    ) -> None:
        try:
            if request.kind == "run_request":
                with self.counting_run(caller):
                    await self._relay_run(session, request, caller)
            elif request.kind in ("cancel_run", "get_run"):
                run_id = request.message.run_id  # type: ignore[attr-defined]
                if caller is not None and not run_id.startswith(caller.run_prefix):
                    raise NoNode(f"no run {run_id!r}")  # another's run is no run to this one
                handle = await self.owner_of(run_id)
                ack, within = self._relay_bounds(session, request.nonce)
                async with handle.stream(
                    request.kind, request.message, ack_timeout=ack, answer_within=within
                ) as replies:
                    async for reply in replies:
                        await session.reply(request.nonce, _kind_of(reply), reply)
            elif request.kind == "list_runs":
                if caller is not None:
                    request.message.run_id_prefix = caller.run_prefix  # type: ignore[attr-defined]
                await self._relay_list(session, request)
            elif request.kind == "set_limits" and caller is not None:
                message = request.message
                assert isinstance(message, pb.SetLimits)
                if not caller.may_set_limits:
                    raise Forbidden(f"caller {caller.name!r} may not change limits")
                target_node = self.nodes.get(message.node_id)
                if target_node is None:
                    raise NodeGone(f"no node {message.node_id!r} is connected now")
                ack, within = self._relay_bounds(session, request.nonce)
                limits = await target_node.call(
                    "set_limits", message, ack_timeout=ack, answer_within=within
                )
                await session.reply(request.nonce, "limits", limits)
            else:
                await session.error(
                    request.nonce,
                    pb.ERROR_CODE_UNEXPECTED,
                    f"{request.kind!r} goes to a node; the edge does not take it from clients",
                )
        except Exception as exc:
            refusal = refusal_for(exc, request.kind)
            if refusal is None:
                raise
            if session.closed:
                return
            await session.error(
                request.nonce, refusal.code, refusal.message, retry_after=refusal.retry_after
            )

    async def _relay_run(
        self, session: ProtoSession, request: Request, caller: Caller | None
    ) -> None:
        message = request.message
        assert isinstance(message, pb.RunRequest)
        if not message.target:
            raise InvalidRequest("run request without a target")
        # who asks is the edge's to say, not the caller's
        message.tenant, message.run_id = self.admit(
            caller, message.target, message.priority, message.run_id
        )
        handle = self.route(message.target)
        owner = self._run_owner.get(message.run_id) if message.run_id else None
        if owner is not None and owner != handle.node_id and owner in self.nodes:
            raise InvalidRequest(f"run id {message.run_id!r} names a run on another node already")
        ack, within = self._relay_bounds(session, request.nonce)
        spans = self._relay_spans(message, handle.node_id)
        handle.in_flight += 1
        run_id = ""
        finished = False
        try:
            async with handle.stream(
                "run_request", message, ack_timeout=ack, answer_within=within
            ) as replies:
                async for reply in replies:
                    if isinstance(reply, pb.RunAccepted):
                        run_id = reply.run_id
                        self._remember(run_id, handle.node_id)
                        # with the events that came with it (a batch from the node)
                        await session.reply_with_events(
                            request.nonce,
                            "run_accepted",
                            reply,
                            replies.ready(),  # type: ignore[arg-type]
                        )
                        continue
                    # while the client is behind, events gather and deltas go merged
                    await session.reply_events(request.nonce, reply, replies.ready)  # type: ignore[arg-type]
                finished = True
        except BaseException as exc:
            for span in spans:
                fail(span, type(exc).__name__, str(exc))
            raise
        finally:
            for span in spans:
                span.end()
            handle.in_flight -= 1
            if run_id and not finished and not message.background:
                # the client went away (or the relay broke): its foreground run goes too
                with trio.move_on_after(5, shield=True), suppress(RemoteError, SessionClosed):
                    await handle.cancel(run_id, "client_lost")

    def _relay_spans(self, message: pb.RunRequest, node_id: str) -> tuple[Span, Span]:
        """The spans of a client's run request and of its relay to ``node_id``, the
        relay's context now ``message``'s (none when tracing is off)."""
        asked = client_span(self.tracer, message)
        relay = relay_span(self.tracer, context_of(asked), node_id)
        headers = headers_of(relay)
        message.traceparent = headers.get("traceparent", "")
        message.tracestate = headers.get("tracestate", "")
        return relay, asked

    def admit(
        self, caller: Caller | None, target: str, priority: int, run_id: str
    ) -> tuple[str, str]:
        """The tenant and run id of a run ``caller`` asks for (None: no identities).

        Raises Forbidden if the caller may not use ``target`` or ask for ``priority``,
        InvalidRequest if its run id is too long with the caller's prefix. Without
        identities the tenant is ``client_tenant`` and ``run_id`` is kept ("" lets the
        node choose one).
        """
        if caller is None:
            return self.client_tenant, run_id
        if not caller.may_use(target):
            raise Forbidden(f"caller {caller.name!r} may not use target {target!r}")
        if priority > caller.max_priority:
            raise Forbidden(
                f"caller {caller.name!r} may ask for priority {caller.max_priority} at most, "
                f"not {priority}"
            )
        run_id = caller.run_prefix + (run_id or uuid.uuid4().hex)
        if len(run_id) > 128:
            raise InvalidRequest(f"run_id too long with the caller's prefix: {run_id!r}")
        return caller.tenant, run_id

    async def _relay_list(self, session: ProtoSession, request: Request) -> None:
        message = request.message
        assert isinstance(message, pb.ListRuns)
        runs: list[pb.RunSummary] = []
        for handle in list(self.nodes.values()):
            try:
                ack, within = self._relay_bounds(session, request.nonce)
                reply = await handle.call(
                    "list_runs", message, ack_timeout=ack, answer_within=within
                )
            except (RemoteError, SessionClosed, ReplyTimeout) as exc:
                log.warning("edge: list_runs on node %s failed: %s", handle.node_id, exc)
                continue
            assert isinstance(reply, pb.RunList)
            runs.extend(reply.runs)
        runs.sort(key=lambda r: r.created, reverse=True)
        limit = message.limit or 100
        await session.reply(request.nonce, "run_list", pb.RunList(runs=runs[:limit]))


def _kind_of(message: object) -> str:
    """The Envelope field name for a reply message."""
    return {
        pb.RunAccepted: "run_accepted",
        pb.RunEvent: "run_event",
        pb.CancelResult: "cancel_result",
        pb.RunInfo: "run_info",
        pb.RunList: "run_list",
        pb.Limits: "limits",
    }[type(message)]
