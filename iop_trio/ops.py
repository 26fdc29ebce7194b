"""The node's local operator endpoints: a small ASGI app on hypercorn's Trio worker.

Routes (served on ``metrics.listen``):

- ``GET /metrics``: prometheus_client's ASGI exposition of
  :class:`~iop_trio.metrics.NodeMetrics` (text format 0.0.4 unless the
  scraper asks for OpenMetrics; gzip if it accepts it);
- ``GET /healthz``: 200 ``alive`` while the process answers (liveness);
- ``GET /readyz``: 200 while the node can take runs (running and admitting, its
  store writable, its edge link up if it has one), else 503; the JSON body
  gives each component's state (readiness);
- ``GET /runs/<run_id>``: the run as JSON (404 if unknown);
- ``POST /runs/<run_id>/cancel?reason=...``: cancel it and answer once its final
  status is recorded: ``{"run_id", "status", "cancelled"}`` (404 if unknown).

A path no route matches gets 404; a known path asked with another method 405
with ``Allow``; ``HEAD`` is answered like ``GET``, without the body. The run
routes answer 503 while the node is not running, and 503 with the store's
error (JSON, as every run route's error) when it must read a store that
cannot answer (its file deleted under the node, say).

The run routes show prompts and cancel runs, so they need the ops token
(``Authorization: Bearer <metrics.token>``; 401 otherwise, and always 401 with
no token configured). ``/metrics``, ``/healthz`` and ``/readyz`` are open unless
``open_metrics`` is false. The CLI refuses to serve the port on an address
that is not loopback without a token.

:func:`serve_ops` (:func:`~iop_trio.transport.asgi.serve_asgi`) runs the app until its
``shutdown`` event is set or until cancelled.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

import attrs
from prometheus_client import make_asgi_app

from .metrics import NodeMetrics
from .model import RunRecord, UnknownRun
from .runtime import Node
from .store import StoreError
from .transport.asgi import (
    Receive,
    Scope,
    Send,
    is_http,
    respond,
    respond_json,
    respond_text,
    serve_asgi,
)
from .transport.auth import bearer_token

log = logging.getLogger(__name__)


def record_json(record: RunRecord) -> dict[str, Any]:
    """A run record as plain JSON data (what ``GET /runs/<id>`` and ``runs show --json`` give)."""
    data = attrs.asdict(record, recurse=True)
    data["status"] = record.status.value
    data["options"] = dict(record.options)  # a live run's may be a read-only mapping
    return data


Handler = Callable[[Scope, Receive, Send, list[str]], Awaitable[None]]


class OpsApp:
    """The ASGI app of the routes above, for ``node`` and its ``metrics``.

    Routing is by path segments: ``/metrics``, ``/healthz``, ``/runs/<id>``,
    ``/runs/<id>/cancel``; the handler gets the segments after the route's
    fixed part (the run id).
    """

    def __init__(
        self,
        node: Node,
        metrics: NodeMetrics,
        *,
        token: str | None = None,
        open_metrics: bool = True,
    ) -> None:
        self.node = node
        self.metrics = metrics
        self._token = token.encode() if token else None
        self.open_metrics = open_metrics
        self._told_no_token = False
        self._exposition = make_asgi_app(metrics.exposition())
        # path segments ("*" = any one segment, passed to the handler) -> method -> handler
        self._routes: dict[tuple[str, ...], dict[str, Handler]] = {
            ("metrics",): {"GET": self._metrics},
            ("healthz",): {"GET": self._healthz},
            ("readyz",): {"GET": self._readyz},
            ("runs", "*"): {"GET": self._show},
            ("runs", "*", "cancel"): {"POST": self._cancel},
        }

    def __repr__(self) -> str:
        return f"<OpsApp node={self.node.node_id!r} routes={len(self._routes)}>"

    def _match(self, path: str) -> tuple[dict[str, Handler], list[str]] | None:
        segments = path.strip("/").split("/")
        for pattern, methods in self._routes.items():
            if len(pattern) == len(segments) and all(
                s != "" if p == "*" else p == s for p, s in zip(pattern, segments, strict=True)
            ):
                return methods, [s for p, s in zip(pattern, segments, strict=True) if p == "*"]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await is_http(scope, receive, send):
            return
        path: str = scope["path"]
        matched = self._match(path)
        if matched is None:
            await respond_text(send, f"no route for {path}\n", 404)
            return
        methods, args = matched
        method: str = scope["method"]
        handler = methods.get("GET" if method == "HEAD" else method)
        if handler is None:
            allow = ", ".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
            await respond(
                send, 405, f"{method} not allowed\n".encode(), "text/plain", {"Allow": allow}
            )
            return
        if (path.strip("/").split("/")[0] == "runs" or not self.open_metrics) and not (
            await self._authorized(scope, send)
        ):
            return
        try:
            await handler(scope, receive, send, args)
        except StoreError as exc:  # raised before the handler answered
            # the store cannot answer (deleted under the node, say; it logged why once)
            await respond_json(send, {"error": str(exc)}, 503)

    async def _authorized(self, scope: Scope, send: Send) -> bool:
        """Whether the request bears the ops token; if not, answer 401 (and False).

        Only a request with an ``Authorization: Bearer`` header can pass, so no page a
        browser shows can make one (a form posts no such header).
        """
        if self._token is None:
            if not self._told_no_token:
                self._told_no_token = True
                log.warning(
                    "ops: a /runs request was refused: the run routes need a token; set "
                    "metrics.token (or metrics.token_file) in the node's config"
                )
            await respond_json(
                send,
                {"error": "the run routes need a token: set metrics.token in the node's config"},
                401,
                {"WWW-Authenticate": "Bearer"},
            )
            return False
        given = bearer_token(scope.get("headers") or [])
        # the header's own bytes (bearer_token decodes them as latin-1)
        if given is not None and hmac.compare_digest(given.encode("latin-1"), self._token):
            return True
        await respond_json(
            send, {"error": "a wrong or missing ops token"}, 401, {"WWW-Authenticate": "Bearer"}
        )
        return False

    async def _metrics(self, scope: Scope, receive: Receive, send: Send, _: list[str]) -> None:
        await self._exposition(scope, receive, send)

    async def _healthz(self, scope: Scope, receive: Receive, send: Send, _: list[str]) -> None:
        # liveness: the process answers; whether it can take runs is /readyz's to say
        await respond_text(send, "alive\n")

    async def _readyz(self, scope: Scope, receive: Receive, send: Send, _: list[str]) -> None:
        ready, components = self.metrics.readiness()
        await respond_json(send, {"ready": ready, "components": components}, 200 if ready else 503)

    async def _show(self, scope: Scope, receive: Receive, send: Send, args: list[str]) -> None:
        if not self.node.is_running:
            await respond_json(send, {"error": "the node is not running"}, 503)
            return
        record = await self.node.manager.get(args[0])
        if record is None:
            await respond_json(send, {"error": f"unknown run {args[0]!r}"}, 404)
            return
        await respond_json(send, record_json(record))

    async def _cancel(self, scope: Scope, receive: Receive, send: Send, args: list[str]) -> None:
        if not self.node.is_running:
            await respond_json(send, {"error": "the node is not running"}, 503)
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        run_id = args[0]
        try:
            outcome = await self.node.manager.cancel(run_id, query.get("reason") or "cancelled")
        except UnknownRun as exc:
            await respond_json(send, {"error": str(exc)}, 404)
            return
        await respond_json(
            send, {"run_id": run_id, "status": outcome.status.value, "cancelled": outcome.cancelled}
        )


#: Serve an :class:`OpsApp` (see :func:`iop_trio.transport.asgi.serve_asgi`).
serve_ops = serve_asgi
