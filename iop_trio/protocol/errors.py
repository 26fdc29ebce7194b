"""The one error table: how each failure a request can meet is answered, sans I/O.

A failure raised while a request is handled (at a node, at the edge's ``/client``
endpoint, or behind the edge's OpenAI door) becomes a :class:`Refusal`, an error
code, a message and a retry hint, by the first rule of :data:`ERROR_RULES` that
matches it (:func:`refusal_for`); a failure no rule matches is a bug (the session
answers it INTERNAL). The OpenAI door then answers a refusal's code with the HTTP
status and OpenAI error of :data:`HTTP_ANSWERS` (:func:`http_answer`).

The failures the table names live where the layers that raise them can import
them: the model's own in :mod:`iop_trio.model`, the store's in
:mod:`iop_trio.failures`, and those of an exchange (``RemoteError``,
``SessionClosed``, ``ReplyTimeout``, ``TooLate``) and of the edge (``NoNode``,
``NodeGone``, ``Forbidden``, ``RateLimited``) here. Their old homes
(``iop_trio.transport``, ``iop_trio.edge``, ``iop_trio.store``) re-export them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final

import attrs

from .._gen.iop import runtime_pb2 as pb
from ..failures import StoreUnavailable
from ..model import InvalidRequest, NodeUnavailable, UnknownRun, UnknownTarget

#: The retry hint (seconds) when a target's node is not connected or was lost: about
#: the time a node takes to dial back (its backoff starts at a second).
NODE_RETRY_AFTER = 2.0


# --- the failures of an exchange ---------------------------------------------------------


class SessionClosed(Exception):
    """The session ended before the answer came."""


class ReplyTimeout(Exception):
    """The peer did not answer (or did not go on with a stream) in time."""


class TooLate(Exception):
    """The sender of a request gives up (its ``answer_within``) before an answer could
    reach it, so the request is not begun: answered UNAVAILABLE."""


class TooLateToRelay(TooLate):
    """The edge's :class:`TooLate`: a client's request whose sender gives up too soon for
    a node's answer to come back through the edge, so it is not relayed."""


class RemoteError(Exception):
    """The peer answered with an Error envelope; ``retry_after`` (seconds) is its hint
    of when to try again, None if it gave none. ``str()`` leads with the code's name;
    ``message`` is the peer's own text."""

    def __init__(self, code: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{pb.ErrorCode.Name(code)}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return (
            f"RemoteError({pb.ErrorCode.Name(self.code)}, {self.message!r}, "
            f"retry_after={self.retry_after})"
        )


# --- the edge's refusals -----------------------------------------------------------------


class NoNode(LookupError):
    """No connected node serves that target (or knows that run)."""


class NodeGone(NoNode):
    """The target was served by a node that is not connected now (retry later)."""


class Forbidden(Exception):
    """The caller may not do that (a target, a priority)."""


class RateLimited(Exception):
    """The caller is over its rate or its runs in flight; ``retry_after`` seconds is a
    hint of when it would not be."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"RateLimited({str(self)!r}, retry_after={self.retry_after})"


# --- the table ---------------------------------------------------------------------------


@attrs.frozen
class Refusal:
    """A request's Error answer: an error code, a message and a retry hint in seconds
    (None: none)."""

    code: int
    message: str
    retry_after: float | None = None


class Own(enum.Enum):
    """A rule's value that is the failure's own: its attribute of the same name."""

    OWN = "own"


OWN: Final = Own.OWN


@attrs.frozen(repr=False)
class ErrorRule:
    """How failures of type ``failure`` are answered.

    ``code`` and ``retry_after`` are the answer's, or :data:`OWN` for the failure's
    attribute of that name (a :class:`RemoteError` passes on the peer's). ``message``
    is a :meth:`str.format` template of the failure (``{0}`` is ``str(failure)``).
    ``requests`` limits the rule to those request kinds (empty: any).
    """

    failure: type[Exception]
    code: int | Own
    retry_after: float | Own | None = None
    message: str = "{0}"
    requests: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        code = "own" if self.code is OWN else pb.ErrorCode.Name(self.code)
        hint = "" if self.retry_after is None else f" retry_after={self.retry_after}"
        only = f" for {sorted(self.requests)}" if self.requests else ""
        return f"<ErrorRule {self.failure.__name__} -> {code}{hint}{only}>"

    def matches(self, failure: BaseException, request_kind: str) -> bool:
        return isinstance(failure, self.failure) and (
            not self.requests or request_kind in self.requests
        )

    def refusal(self, failure: BaseException) -> Refusal:
        """The answer to ``failure`` (which this rule :meth:`matches`)."""
        code: int = _own(failure, "code", self.code)
        hint: float | None = _own(failure, "retry_after", self.retry_after)
        return Refusal(code, self.message.format(failure), hint)


def _own(failure: BaseException, name: str, value: object) -> Any:
    """``value``, or for :data:`OWN` the failure's attribute ``name``."""
    return getattr(failure, name) if value is OWN else value


#: Every failure a request can meet and its answer; the first rule that matches wins
#: (so a subclass's rule comes before its base's).
ERROR_RULES: tuple[ErrorRule, ...] = (
    # the model's, at a node
    ErrorRule(UnknownTarget, pb.ERROR_CODE_UNKNOWN_TARGET),
    ErrorRule(UnknownRun, pb.ERROR_CODE_UNKNOWN_RUN),
    ErrorRule(InvalidRequest, pb.ERROR_CODE_INVALID),
    # a draining node, a store that cannot write (it retries every second, and catches
    # up when it can)
    ErrorRule(NodeUnavailable, pb.ERROR_CODE_UNAVAILABLE, 5.0),
    ErrorRule(StoreUnavailable, pb.ERROR_CODE_STORE_UNAVAILABLE, 5.0),
    # a sender that gives up before its answer could reach it: at the edge, about when
    # a node could answer; at a node, soon
    ErrorRule(TooLateToRelay, pb.ERROR_CODE_UNAVAILABLE, NODE_RETRY_AFTER),
    ErrorRule(TooLate, pb.ERROR_CODE_UNAVAILABLE, 1.0),
    # the edge's: no node for the target (or the run), a node's own answer passed on
    ErrorRule(NodeGone, pb.ERROR_CODE_UNAVAILABLE, NODE_RETRY_AFTER),
    ErrorRule(NoNode, pb.ERROR_CODE_UNKNOWN_TARGET, requests=frozenset({"run_request"})),
    ErrorRule(NoNode, pb.ERROR_CODE_UNKNOWN_RUN),
    ErrorRule(RemoteError, OWN, OWN, message="{0.message}"),
    ErrorRule(RateLimited, pb.ERROR_CODE_RATE_LIMITED, OWN),
    ErrorRule(SessionClosed, pb.ERROR_CODE_UNAVAILABLE, NODE_RETRY_AFTER, "node lost: {0}"),
    ErrorRule(ReplyTimeout, pb.ERROR_CODE_UNAVAILABLE, NODE_RETRY_AFTER, "node lost: {0}"),
    ErrorRule(Forbidden, pb.ERROR_CODE_FORBIDDEN),
)


def refusal_for(failure: BaseException, request_kind: str = "") -> Refusal | None:
    """The answer to a ``request_kind`` request that failed with ``failure`` (the first
    matching rule of :data:`ERROR_RULES`), or None if it is no failure a request can
    meet: a bug, to be raised on."""
    for rule in ERROR_RULES:
        if rule.matches(failure, request_kind):
            return rule.refusal(failure)
    return None


# --- the OpenAI door's answers -----------------------------------------------------------


@attrs.frozen
class HttpAnswer:
    """How the OpenAI-compatible door answers an error code: the HTTP status, OpenAI's
    error ``type``, the stable ``code`` name it gives, and the ``param`` it names."""

    status: int
    kind: str
    name: str
    param: str | None = None


#: An error code (a node's or the edge's) -> the door's answer.
HTTP_ANSWERS: Mapping[int, HttpAnswer] = {
    pb.ERROR_CODE_INVALID: HttpAnswer(400, "invalid_request_error", "invalid_request"),
    pb.ERROR_CODE_UNKNOWN_TARGET: HttpAnswer(
        404, "invalid_request_error", "model_not_found", param="model"
    ),
    pb.ERROR_CODE_UNKNOWN_RUN: HttpAnswer(404, "invalid_request_error", "not_found"),
    pb.ERROR_CODE_FORBIDDEN: HttpAnswer(403, "permission_error", "forbidden"),
    pb.ERROR_CODE_UNAVAILABLE: HttpAnswer(503, "server_error", "unavailable"),
    pb.ERROR_CODE_STORE_UNAVAILABLE: HttpAnswer(503, "server_error", "store_unavailable"),
    pb.ERROR_CODE_RATE_LIMITED: HttpAnswer(429, "rate_limit_error", "rate_limited"),
}
#: The door's answer to any other code (a node's INTERNAL, say): the node failed.
HTTP_OTHER = HttpAnswer(502, "server_error", "node_error")


def http_answer(code: int) -> HttpAnswer:
    """The door's answer to an error ``code`` (:data:`HTTP_ANSWERS`, else :data:`HTTP_OTHER`)."""
    return HTTP_ANSWERS.get(code, HTTP_OTHER)
