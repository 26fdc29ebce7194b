"""The node's local operator endpoints, served on ``metrics.listen``.

- ``GET /metrics``, ``GET /healthz`` (from :class:`iop_trio.metrics.NodeMetrics`);
- ``GET /runs/<run_id>``: the run as JSON (404 if unknown);
- ``POST /runs/<run_id>/cancel?reason=...``: cancel it and answer once its final
  status is recorded: ``{"run_id", "status", "cancelled"}`` (404 if unknown).

These are for the machine the node runs on (``iop-node runs cancel`` uses
them); the listener binds to loopback unless configured otherwise, and has no
authentication of its own.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from .httpserver import HttpRequest, HttpResponse, Route
from .metrics import NodeMetrics
from .model import RunRecord, UnknownRun
from .runtime import Node


def record_json(record: RunRecord) -> dict[str, Any]:
    """A run record as plain JSON data (what ``GET /runs/<id>`` and ``runs show --json`` give)."""
    data = attrs.asdict(record, recurse=True)
    data["status"] = record.status.value
    data["options"] = dict(record.options)  # a live run's may be a read-only mapping
    return data


def _json(data: Any, status: int = 200) -> HttpResponse:
    body = json.dumps(data, default=str).encode()
    return HttpResponse(status, body, content_type="application/json")


def ops_routes(node: Node, metrics: NodeMetrics) -> dict[tuple[str, str], Route]:
    """The routes above, for :func:`iop_trio.httpserver.serve_http`."""

    async def show(request: HttpRequest) -> HttpResponse:
        run_id = request.subpath
        record = await node.manager.get(run_id) if run_id and "/" not in run_id else None
        if record is None:
            return _json({"error": f"unknown run {run_id!r}"}, 404)
        return _json(record_json(record))

    async def cancel(request: HttpRequest) -> HttpResponse:
        run_id, _, action = request.subpath.partition("/")
        if action != "cancel" or not run_id:
            return _json({"error": "POST /runs/<run_id>/cancel"}, 404)
        try:
            outcome = await node.manager.cancel(run_id, request.query.get("reason") or "cancelled")
        except UnknownRun as exc:
            return _json({"error": str(exc)}, 404)
        return _json(
            {"run_id": run_id, "status": outcome.status.value, "cancelled": outcome.cancelled}
        )

    return {**metrics.routes(), ("GET", "/runs/"): show, ("POST", "/runs/"): cancel}
