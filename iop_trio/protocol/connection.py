"""The proto-socket state machine, sans I/O.

:class:`ProtoConnection` turns outgoing calls into frame bytes and incoming
frame bytes into :class:`Request` / :class:`Reply` / :class:`StaleReply`
objects, keeping the table of requests still waiting for an answer. It never
touches a socket; the Trio shell (``iop_trio.transport``) moves the bytes.

Exchanges:

- one request, one reply (``cancel_run`` -> ``cancel_result``, ...);
- streams: ``run_request`` -> ``run_accepted`` then ``run_event`` frames up
  to the terminal event; ``get_run`` with ``follow`` -> ``run_info`` then,
  if the run had not ended, ``run_event`` frames up to the terminal one.
- an ``error`` reply ends any exchange.

A frame that cannot be decoded, has no body, carries a body this side does
not serve, or answers a request with the wrong body raises
:class:`ProtocolError`; the connection stays usable and the shell answers
with :meth:`ProtoConnection.error`.

Batches: a frame may carry a ``Batch`` of envelopes, each what would otherwise
have been a frame of its own (:meth:`ProtoConnection.receive_all` classifies them
in order, a bad one as its ProtocolError in its place). What goes together is one
rule, :func:`take_sendable`: the frames that are ready now, in order, up to a bound
in bytes, and never a wait for more. A batch is made of the frames' bytes as they
are (:func:`pack_batch`), never decoded and encoded again, and only for a peer that
said it reads batches (``Hello.batches`` / ``HelloAck.batches`` on a node's link,
:data:`BATCH_SUBPROTOCOL` on a client's); an older peer gets one envelope a frame.

The table of pending requests is the only one: each entry keeps the
``waiter`` the shell gave :meth:`ProtoConnection.request` (whatever it
delivers replies to), and every answer comes back with it.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

import attrs
from google.protobuf.message import DecodeError, Message

from .._gen.iop import runtime_pb2 as pb
from .convert import TERMINAL_KINDS_PB, TERMINAL_STATUSES_PB

MAX_NONCE = 2**64 - 1

#: The WebSocket subprotocol a client offers, and a server accepts, to say that both
#: read Batch frames (a client's link has no Hello to say it in).
BATCH_SUBPROTOCOL = "iop.batches"
#: The most bytes of frames one Batch holds (a frame larger than this goes alone).
BATCH_BYTES = 64 * 1024
#: The most bytes of frames taken to be written in one send.
SEND_BYTES = 256 * 1024

W = TypeVar("W")

# which bodies each side serves as requests
RUNNER_REQUESTS = frozenset(
    {"run_request", "cancel_run", "get_run", "list_runs", "set_limits", "ping"}
)
EDGE_REQUESTS = frozenset({"hello", "ping"})

# request body -> the body of its (first) answer; "error" answers anything
ANSWERS: Mapping[str, str] = {
    "hello": "hello_ack",
    "run_request": "run_accepted",
    "cancel_run": "cancel_result",
    "get_run": "run_info",
    "list_runs": "run_list",
    "set_limits": "limits",
    "ping": "pong",
}


class Role(enum.Enum):
    """What a side serves: RUNNER takes run requests (a node, or the edge's client
    endpoint); EDGE takes Hello from nodes; CLIENT (a CLI on an edge) only pings."""

    RUNNER = "runner"
    EDGE = "edge"
    CLIENT = "client"

    @property
    def serves(self) -> frozenset[str]:
        return _SERVES[self]


_SERVES = {
    Role.RUNNER: RUNNER_REQUESTS,
    Role.EDGE: EDGE_REQUESTS,
    Role.CLIENT: frozenset({"ping"}),
}


class ProtocolError(Exception):
    """A frame broke the protocol.

    ``reply_to`` is the peer's offending nonce to answer (0 if none);
    ``broken`` is the nonce of our own request whose exchange it ended (0 if
    none): that request is no longer pending, and ``waiter`` (its waiter) should
    be failed.
    """

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reply_to: int = 0,
        broken: int = 0,
        waiter: object = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reply_to = reply_to
        self.broken = broken
        self.waiter = waiter

    def __repr__(self) -> str:
        name = pb.ErrorCode.Name(self.code)
        return f"ProtocolError({name}, {self.message!r}, reply_to={self.reply_to})"


def opens_stream(kind: str, message: Message) -> bool:
    """True for the requests answered by a stream of replies: ``run_request``, and
    ``get_run`` with ``follow``. Every other request gets one reply."""
    return kind == "run_request" or (
        kind == "get_run" and isinstance(message, pb.GetRun) and message.follow
    )


@attrs.frozen
class Request:
    """A request from the peer that this side serves; answer it with ``reply_to=nonce``.

    ``size`` is the frame's length in bytes; ``stream`` says whether it opens a
    stream of replies (:func:`opens_stream`). ``answer_within`` is the peer's bound, in
    seconds from when it sent the request, on the wait for its first answer (0: none):
    past it, the peer has given up, so a request not yet being handled is answered
    UNAVAILABLE and never handled.
    """

    nonce: int
    kind: str
    message: Message
    size: int = attrs.field(default=0, eq=False)
    answer_within: float = attrs.field(default=0.0, eq=False)

    @property
    def stream(self) -> bool:
        return opens_stream(self.kind, self.message)


@attrs.frozen
class Reply(Generic[W]):
    """An answer to one of our requests, for its ``waiter``. ``final`` = the exchange is over."""

    reply_to: int
    kind: str
    message: Message
    final: bool
    waiter: W | None = attrs.field(default=None, eq=False)


@attrs.frozen
class PeerError:
    """An Error the peer sent about no request of ours (e.g. a frame it could not parse).

    Never answer it: two sides answering each other's errors would loop.
    """

    code: int
    message: str


@attrs.frozen
class StaleReply:
    """An answer to a request nobody waits for any more (given up, or already over)."""

    reply_to: int
    kind: str


Incoming = Request | Reply[W] | StaleReply | PeerError


@attrs.define
class _Pending(Generic[W]):
    kind: str
    stream: bool
    waiter: W | None
    answered: bool = False


def encode(envelope: pb.Envelope) -> bytes:
    return envelope.SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Envelope.batch (field 26) and Batch.envelopes (field 1), both length-delimited
_BATCH_FIELD = _varint(26 << 3 | 2)
_ENVELOPES_FIELD = _varint(1 << 3 | 2)


def _batch_entry(frame: bytes) -> bytes:
    return _ENVELOPES_FIELD + _varint(len(frame)) + frame


def pack_batch(frames: Sequence[bytes]) -> bytes:
    """One frame holding ``frames`` (each an encoded Envelope) as a Batch, in order: their
    bytes as they are, with a few bytes of framing each (the wire form of a repeated
    message is its encoded entries), so nothing is decoded or encoded again."""
    body = b"".join(map(_batch_entry, frames))
    return _BATCH_FIELD + _varint(len(body)) + body


def batch_overhead(frame: bytes) -> int:
    """The bytes ``frame`` adds to a batch beyond its own."""
    return len(_ENVELOPES_FIELD) + len(_varint(len(frame)))


def take_sendable(
    outbox: deque[bytes],
    *,
    batches: bool,
    batch_bytes: int = BATCH_BYTES,
    send_bytes: int = SEND_BYTES,
) -> tuple[list[bytes], int]:
    """The rule of what goes together: take the frames ready in ``outbox`` (oldest first,
    at least one, then while the frames taken come to at most ``send_bytes``), to be
    written in one send. Returns the messages to write, in order, and the bytes taken.

    For a peer that reads ``batches``, neighbouring frames go in one Batch while it holds
    at most ``batch_bytes`` (with its framing); a frame alone, or larger than that, goes
    as itself. Nothing waits for frames that are not here: one ready frame is one
    message, written at once.
    """
    taken: list[bytes] = [outbox.popleft()]
    size = len(taken[0])
    while outbox and size + len(outbox[0]) <= send_bytes:
        frame = outbox.popleft()
        taken.append(frame)
        size += len(frame)
    if not batches or len(taken) == 1:
        return taken, size
    messages: list[bytes] = []
    group: list[bytes] = []
    group_bytes = 0
    for frame in taken:
        cost = len(frame) + batch_overhead(frame)
        if group and group_bytes + cost > batch_bytes:
            messages.append(group[0] if len(group) == 1 else pack_batch(group))
            group, group_bytes = [], 0
        group.append(frame)
        group_bytes += cost
    messages.append(group[0] if len(group) == 1 else pack_batch(group))
    return messages, size


def decode(data: bytes | bytearray | str) -> pb.Envelope:
    """Parse one frame; ProtocolError(MALFORMED) if it is text, undecodable or has no body."""
    if isinstance(data, str):
        raise ProtocolError(pb.ERROR_CODE_MALFORMED, "text frame: envelopes travel as binary")
    envelope = pb.Envelope()
    try:
        envelope.ParseFromString(bytes(data))
    except DecodeError as exc:
        raise ProtocolError(pb.ERROR_CODE_MALFORMED, f"undecodable envelope: {exc}") from None
    if envelope.WhichOneof("body") is None:
        raise ProtocolError(
            pb.ERROR_CODE_MALFORMED,
            "envelope without a known body",
            reply_to=envelope.nonce,
        )
    return envelope


class ProtoConnection(Generic[W]):
    """One side of a proto-socket; see the module docstring.

    ``W`` is the type of the waiters the shell registers with its requests.
    """

    def __init__(self, role: Role) -> None:
        self.role = role
        self._next_nonce = 1
        self._pending: dict[int, _Pending[W]] = {}

    def __repr__(self) -> str:
        return f"<ProtoConnection {self.role.value} pending={len(self._pending)}>"

    @property
    def pending(self) -> int:
        """Requests sent and not yet finally answered."""
        return len(self._pending)

    # --- sending -------------------------------------------------------------------------

    def _allocate_nonce(self) -> int:
        while True:
            nonce = self._next_nonce
            self._next_nonce = nonce + 1 if nonce < MAX_NONCE else 1
            if nonce not in self._pending:
                return nonce

    def request(
        self,
        kind: str,
        message: Message,
        waiter: W | None = None,
        *,
        answer_within: float = 0.0,
    ) -> tuple[int, bytes]:
        """A new request; returns its nonce and the frame.

        ``run_request`` and ``get_run`` with ``follow`` open a stream of
        replies; every other request expects one reply. Each reply carries
        ``waiter``. ``answer_within`` (seconds, 0: none): see :class:`Request`.
        """
        if kind not in ANSWERS:
            raise ValueError(f"{kind!r} is not a request")
        nonce = self._allocate_nonce()
        envelope = pb.Envelope(nonce=nonce, answer_within_s=max(0.0, answer_within))
        getattr(envelope, kind).CopyFrom(message)
        frame = encode(envelope)
        self._pending[nonce] = _Pending(kind, opens_stream(kind, message), waiter)
        return nonce, frame

    def forget(self, nonce: int) -> None:
        """Stop waiting for answers to ``nonce`` (later ones become StaleReply)."""
        self._pending.pop(nonce, None)

    def forget_all(self) -> list[W]:
        """Drop every pending request (the connection is gone); returns their waiters."""
        waiters = [p.waiter for p in self._pending.values() if p.waiter is not None]
        self._pending.clear()
        return waiters

    def reply(self, reply_to: int, kind: str, message: Message) -> bytes:
        """A frame answering the peer's request ``reply_to``."""
        envelope = pb.Envelope(reply_to=reply_to)
        getattr(envelope, kind).CopyFrom(message)
        return encode(envelope)

    def error(
        self, reply_to: int, code: int, message: str, *, retry_after: float | None = None
    ) -> bytes:
        """An Error answer; ``retry_after`` seconds is a hint of when to try again."""
        error = pb.Error(code=code, message=message, retry_after_s=retry_after or 0.0)  # type: ignore[arg-type]
        return self.reply(reply_to, "error", error)

    # --- receiving -----------------------------------------------------------------------

    def receive(self, data: bytes | bytearray | str) -> Incoming[W]:
        """Classify one incoming frame of one envelope; raises ProtocolError for a bad
        one, and for a Batch (:meth:`receive_all` reads those)."""
        return self._classify(decode(data), len(data))

    def receive_all(self, data: bytes | bytearray | str) -> list[Incoming[W] | ProtocolError]:
        """Classify each envelope of one incoming frame, in order: a Batch's, else the
        frame's one. A bad envelope is its ProtocolError, in its place, and the others
        are classified as usual; a frame that cannot be decoded is one ProtocolError."""
        try:
            envelope = decode(data)
        except ProtocolError as exc:
            return [exc]
        if envelope.WhichOneof("body") != "batch":
            return [self._classify_or_error(envelope, len(data))]
        return [self._classify_or_error(inner, 0) for inner in envelope.batch.envelopes]

    def _classify_or_error(self, envelope: pb.Envelope, size: int) -> Incoming[W] | ProtocolError:
        try:
            return self._classify(envelope, size)
        except ProtocolError as exc:
            return exc

    def _classify(self, envelope: pb.Envelope, size: int) -> Incoming[W]:
        """Classify one envelope (``size``: its frame's bytes; 0 for one in a batch, whose
        own size is then taken); raises ProtocolError for a bad one."""
        kind = envelope.WhichOneof("body")
        if kind is None:
            raise ProtocolError(
                pb.ERROR_CODE_MALFORMED,
                "envelope without a known body",
                reply_to=envelope.nonce,
            )
        if kind == "batch":
            raise ProtocolError(
                pb.ERROR_CODE_MALFORMED,
                "a batch where one envelope belongs (batches do not nest)",
                reply_to=envelope.nonce,
            )
        message: Message = getattr(envelope, kind)
        if envelope.reply_to == 0 and isinstance(message, pb.Error):
            return PeerError(message.code, message.message)
        if envelope.reply_to == 0:
            if kind not in self.role.serves:
                raise ProtocolError(
                    pb.ERROR_CODE_UNEXPECTED,
                    f"{kind!r} is not a request this {self.role.value} serves",
                    reply_to=envelope.nonce,
                )
            if envelope.nonce == 0:
                raise ProtocolError(pb.ERROR_CODE_MALFORMED, f"{kind!r} request without a nonce")
            within = envelope.answer_within_s
            # a bound that is no number, or none, is no bound: the old peers send 0
            within = within if 0 < within < float("inf") else 0.0
            return Request(envelope.nonce, kind, message, size or envelope.ByteSize(), within)
        return self._answer(envelope.reply_to, kind, message)

    def _answer(self, reply_to: int, kind: str, message: Message) -> Reply[W] | StaleReply:
        pending = self._pending.get(reply_to)
        if pending is None:
            return StaleReply(reply_to, kind)
        if kind == "error":
            final = True
        elif not pending.answered and kind == ANSWERS[pending.kind]:
            pending.answered = True
            final = not pending.stream or (
                isinstance(message, pb.RunInfo) and message.run.status in TERMINAL_STATUSES_PB
            )
        elif pending.answered and pending.stream and isinstance(message, pb.RunEvent):
            final = message.kind in TERMINAL_KINDS_PB
        else:
            self._pending.pop(reply_to)
            raise ProtocolError(
                pb.ERROR_CODE_UNEXPECTED,
                f"{kind!r} does not answer a {pending.kind!r} request here",
                broken=reply_to,
                waiter=pending.waiter,
            )
        if final:
            del self._pending[reply_to]
        return Reply(reply_to, kind, message, final, pending.waiter)
