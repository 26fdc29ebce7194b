"""The edge's OpenAI-compatible front door: any OpenAI client can use the nodes behind it.

An ASGI app (served like the node's ops routes, by
:func:`~iop_trio.transport.asgi.serve_asgi`) with three routes:

- ``POST /v1/chat/completions``: a chat run. The request's ``model`` names a
  target; ``messages`` (text content only) are the run's messages; every other
  field but ``stream``, ``stream_options``, ``user``, ``n`` (1 only) and
  ``priority`` (an iop-trio extension, as vLLM names it) becomes a run option
  under its own name (``max_completion_tokens`` as ``max_tokens``; on an
  ``ollama`` target ``max_tokens`` as ``num_predict``), so the target's
  ``allow_options`` decide what a caller may set: anything else is refused 400.
  With ``stream`` the answer is server-sent ``chat.completion.chunk`` events
  ending ``data: [DONE]`` (and a usage chunk first with
  ``stream_options.include_usage``); without, one ``chat.completion``.
- ``GET /v1/models`` and ``GET /v1/models/<id>``: the targets the caller may use
  on the nodes connected now, whose engine is available on at least one.

Who asks: ``Authorization: Bearer <token>``, the token a caller would give the
edge's ``/client`` WebSocket (so with identities, the caller's name, tenant,
targets and highest priority apply, and its run ids start with ``<caller>:``).

Edge cases, in the order a request meets them:

- a wrong or missing token: 401; a body over the edge's ``max_message_size``:
  413; not JSON, or a field of the wrong shape: 400; a target the caller may not
  use or a priority above its own: 403; a target no connected node serves: 404
  (``model_not_found``), or 503 if its node is gone for now;
- the run is refused by the gate (REJECTED ``queue_full`` or ``queue_timeout``):
  429 with ``Retry-After`` (whole seconds, rounded up, from the run's own hint);
  the node is draining, its store cannot write, or it was lost: 503 with
  ``Retry-After``. A streaming answer's headers wait for the run to start, so
  these come as statuses, not as events in a 200 stream;
- the run fails once started (the engine fails, the run's time or output bound):
  502 (504 for ``run_timeout``; 429 for ``engine_busy`` and 503 for
  ``engine_unavailable``, the engine's own 429 or 503, with ``Retry-After`` from
  its hint), or in a stream that has begun, an ``error`` event (which the
  ``openai`` package raises as ``APIError``) and no ``[DONE]``;
- the client goes away before the run ends (it closes the connection, or stops
  reading a stream): the run is cancelled with reason ``client_lost``.

Every error body is OpenAI's shape: ``{"error": {"message", "type", "param",
"code"}}``; ``code`` is a stable name (``model_not_found``,
``invalid_api_key``, ``queue_full``...). The response carries the run id in
``X-IOP-Run-Id``; the completion's ``id`` is ``chatcmpl-<run id>``. ``usage``
is given when the engine reported both token counts (see docs/operations.md
for which engines do), else null.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import attrs
import trio

from ..model import EventKind, InvalidRequest, RunEvent, RunSpec, Usage
from ..protocol import pb
from ..transport.asgi import Receive, Scope, Send, is_http, respond_json
from ..transport.auth import bearer_token
from ..transport.caller import RunStream
from ..transport.session import RemoteError, ReplyTimeout, SessionClosed
from .edge import NODE_RETRY_AFTER, Edge, Forbidden, NodeGone, NoNode
from .identities import Caller

log = logging.getLogger(__name__)

#: Request fields that are the request itself, not run options.
REQUEST_FIELDS = frozenset(
    {"model", "messages", "stream", "stream_options", "user", "n", "priority"}
)
#: Fields that arrive under another name (OpenAI renamed max_tokens).
FIELD_ALIASES = {"max_completion_tokens": "max_tokens"}
#: Run options an adapter kind knows by another name.
OPTION_NAMES: dict[str, dict[str, str]] = {"ollama": {"max_tokens": "num_predict"}}
#: The finish reasons OpenAI clients know; an engine's other done_reason says "stop".
FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})
#: Seconds the edge gives a node to confirm the cancel of a run whose client left.
CANCEL_TIMEOUT = 5.0

#: A node's error code -> (HTTP status, OpenAI error type, our code).
ERROR_STATUS: dict[int, tuple[int, str, str]] = {
    pb.ERROR_CODE_INVALID: (400, "invalid_request_error", "invalid_request"),
    pb.ERROR_CODE_UNKNOWN_TARGET: (404, "invalid_request_error", "model_not_found"),
    pb.ERROR_CODE_FORBIDDEN: (403, "permission_error", "forbidden"),
    pb.ERROR_CODE_UNAVAILABLE: (503, "server_error", "unavailable"),
    pb.ERROR_CODE_STORE_UNAVAILABLE: (503, "server_error", "store_unavailable"),
}
#: A run's terminal event (not SUCCEEDED) -> (HTTP status, OpenAI error type).
TERMINAL_STATUS: dict[EventKind, tuple[int, str]] = {
    EventKind.REJECTED: (429, "rate_limit_error"),
    EventKind.FAILED: (502, "server_error"),
    EventKind.CANCELLED: (503, "server_error"),
    EventKind.INTERRUPTED: (503, "server_error"),
}
#: A FAILED run's reason -> (HTTP status, OpenAI error type), where not 502: the run's
#: own time bound, and an engine that turned the run away for now (its 429 or 503, with
#: its hint as ``Retry-After``).
FAILED_STATUS: dict[str, tuple[int, str]] = {
    "run_timeout": (504, "server_error"),
    "engine_busy": (429, "rate_limit_error"),
    "engine_unavailable": (503, "server_error"),
}


class ClientGone(Exception):
    """The client went away before its request was read: nobody to answer."""


class DoorError(Exception):
    """A request's answer when it is not a completion: an HTTP status and OpenAI's error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str = "invalid_request",
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"<DoorError {self.status} {self.code}: {self.message}>"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return headers


@attrs.frozen
class ChatRequest:
    """A chat completion request, checked: the run it asks for and how to answer."""

    target: str
    messages: tuple[tuple[str, str], ...]
    options: Mapping[str, Any]
    priority: int = 0
    stream: bool = False
    include_usage: bool = False


def _text_of(content: object, index: int) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise DoorError(
                    400, "only text content is supported", param=f"messages[{index}].content"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise DoorError(400, "a text part needs text", param=f"messages[{index}].content")
            parts.append(text)
        return "".join(parts)
    raise DoorError(
        400, "content must be a string or a list of text parts", param=f"messages[{index}]"
    )


def parse_chat_request(body: object, adapter_kind: str = "") -> ChatRequest:
    """Check a decoded ``/v1/chat/completions`` body; DoorError (400) names the field.

    ``adapter_kind`` is the kind of the target's adapter, for :data:`OPTION_NAMES`.
    Option values are not checked here: the node checks them against the target.
    """
    if not isinstance(body, dict):
        raise DoorError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise DoorError(400, "model must name a target", param="model")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise DoorError(400, "messages must be a non-empty list", param="messages")
    messages = []
    for index, message in enumerate(raw_messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DoorError(400, "each message needs a role", param=f"messages[{index}]")
        messages.append((message["role"], _text_of(message.get("content"), index)))
    if body.get("n", 1) not in (1, None):
        raise DoorError(400, "n must be 1", param="n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise DoorError(400, "stream must be true or false", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise DoorError(400, "stream_options must be an object", param="stream_options")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise DoorError(400, "priority must be an integer", param="priority")
    renames: dict[str, str] = OPTION_NAMES.get(adapter_kind, {})
    options: dict[str, Any] = {}
    for key, value in body.items():
        if key in REQUEST_FIELDS or value is None:
            continue
        name = FIELD_ALIASES.get(str(key), str(key))
        options[renames.get(name, name)] = value
    return ChatRequest(
        target=model,
        messages=tuple(messages),
        options=options,
        priority=priority,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
    )


def _usage_json(usage: Usage | None) -> dict[str, int] | None:
    if usage is None or usage.prompt_tokens is None or usage.completion_tokens is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _finish_reason(event: RunEvent) -> str:
    reason = event.usage.done_reason if event.usage is not None else ""
    return reason if reason in FINISH_REASONS else "stop"


def terminal_error(event: RunEvent) -> DoorError:
    """The answer for a run that ended without succeeding."""
    status, kind = TERMINAL_STATUS[event.kind]
    if event.kind is EventKind.FAILED:
        status, kind = FAILED_STATUS.get(event.reason, (status, kind))
    retry_after = event.retry_after
    if event.kind is EventKind.INTERRUPTED and retry_after is None:
        retry_after = NODE_RETRY_AFTER
    message = f"the run was {event.kind.value}"
    if event.reason:
        message += f" ({event.reason})"
    if event.message:
        message += f": {event.message}"
    return DoorError(
        status, message, kind=kind, code=event.reason or event.kind.value, retry_after=retry_after
    )


class OpenAIFrontDoor:
    """The ASGI app of the module docstring, in front of ``edge``."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    def __repr__(self) -> str:
        return f"<OpenAIFrontDoor edge={self.edge.edge_id!r}>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await is_http(scope, receive, send):
            return
        try:
            await self._route(scope, receive, send)
        except DoorError as exc:
            await respond_json(send, exc.body(), exc.status, exc.headers())
        except ClientGone:
            pass

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"].rstrip("/")
        method: str = scope["method"]
        if path == "/v1/chat/completions":
            if method != "POST":
                raise DoorError(405, f"{method} not allowed; POST a chat completion")
            caller = self._caller(scope)
            body = await self._body(receive)
            await self._chat(caller, body, receive, send)
        elif path == "/v1/models" or path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                raise DoorError(405, f"{method} not allowed")
            caller = self._caller(scope)
            models = self._models(caller)
            if path == "/v1/models":
                await respond_json(send, {"object": "list", "data": list(models.values())})
                return
            model = models.get(path.removeprefix("/v1/models/"))
            if model is None:
                raise DoorError(404, "no such model", code="model_not_found", param="model")
            await respond_json(send, model)
        else:
            raise DoorError(404, f"no route for {path}", code="not_found")

    def _caller(self, scope: Scope) -> Caller | None:
        """Who asks (None: anyone may, no identities), or DoorError 401."""
        who = self.edge.authorize("/client", bearer_token(scope.get("headers") or []))
        if who is None:
            raise DoorError(
                401,
                "a wrong or missing token: send Authorization: Bearer <token>",
                kind="invalid_request_error",
                code="invalid_api_key",
            )
        return who if isinstance(who, Caller) else None

    async def _body(self, receive: Receive) -> object:
        limit = self.edge.settings.max_message_size
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise DoorError(413, f"the request is over {limit} bytes", code="too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            return json.loads(b"".join(chunks))
        except ValueError as exc:
            raise DoorError(400, f"the body is not JSON: {exc}") from None

    def _models(self, caller: Caller | None) -> dict[str, dict[str, Any]]:
        models: dict[str, dict[str, Any]] = {}
        for handle in self.edge.nodes.values():
            for target in handle.targets - set(handle.unavailable):
                if caller is None or caller.may_use(target):
                    models[target] = {
                        "id": target,
                        "object": "model",
                        "created": 0,
                        "owned_by": "iop",
                    }
        return dict(sorted(models.items()))

    def _adapter_kind(self, target: str) -> str:
        for handle in self.edge.nodes.values():
            for info in handle.hello.targets:
                if info.name == target:
                    kinds = {a.name: a.kind for a in handle.hello.adapters}
                    return kinds.get(info.adapter, "")
        return ""

    async def _chat(
        self, caller: Caller | None, body: object, receive: Receive, send: Send
    ) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        request = parse_chat_request(
            body, self._adapter_kind(model if isinstance(model, str) else "")
        )
        try:
            tenant, run_id = self.edge.admit(caller, request.target, request.priority, "")
        except Forbidden as exc:
            raise DoorError(403, str(exc), kind="permission_error", code="forbidden") from None
        except InvalidRequest as exc:
            raise DoorError(400, str(exc)) from None
        spec = RunSpec(
            request.target,
            messages=request.messages,
            options=request.options,
            priority=request.priority,
            tenant=tenant,
            run_id=run_id or None,
        )
        refused: DoorError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                await self._run(spec, request, send)
            except DoorError as exc:  # raised here, not in the nursery's group
                refused = exc
            nursery.cancel_scope.cancel()
        if refused is not None:
            raise refused

    async def _run(self, spec: RunSpec, request: ChatRequest, send: Send) -> None:
        created = int(time.time())
        try:
            async with self.edge.run(spec) as stream:
                try:
                    if request.stream:
                        await self._stream(stream, request, created, send)
                    else:
                        await self._whole(stream, request, created, send)
                finally:
                    if stream.last is None or not stream.last.kind.terminal:
                        await _cancel_abandoned(self.edge, stream.run_id)
        except NodeGone as exc:
            raise DoorError(
                503, str(exc), kind="server_error", code="unavailable", retry_after=NODE_RETRY_AFTER
            ) from None
        except NoNode as exc:
            raise DoorError(404, str(exc), code="model_not_found", param="model") from None
        except RemoteError as exc:
            status, kind, code = ERROR_STATUS.get(exc.code, (502, "server_error", "node_error"))
            raise DoorError(
                status, exc.message, kind=kind, code=code, retry_after=exc.retry_after
            ) from None
        except (SessionClosed, ReplyTimeout) as exc:
            raise DoorError(
                503,
                f"node lost: {exc}",
                kind="server_error",
                code="unavailable",
                retry_after=NODE_RETRY_AFTER,
            ) from None

    async def _whole(
        self, stream: RunStream, request: ChatRequest, created: int, send: Send
    ) -> None:
        text, last = await stream.collect()
        if last.kind is not EventKind.SUCCEEDED:
            raise terminal_error(last)
        await respond_json(
            send,
            {
                "id": f"chatcmpl-{stream.run_id}",
                "object": "chat.completion",
                "created": created,
                "model": request.target,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": _finish_reason(last),
                        "logprobs": None,
                    }
                ],
                "usage": _usage_json(last.usage),
            },
            headers={"X-IOP-Run-Id": stream.run_id},
        )

    async def _stream(
        self, stream: RunStream, request: ChatRequest, created: int, send: Send
    ) -> None:
        # the headers wait for the run to start, so a rejection is still a status
        async for event in stream:
            if event.kind is EventKind.STARTED or event.kind is EventKind.DELTA:
                break
            if event.kind.terminal:
                if event.kind is not EventKind.SUCCEEDED:
                    raise terminal_error(event)
                break
        head = {
            "id": f"chatcmpl-{stream.run_id}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.target,
        }

        async def chunk(data: Mapping[str, Any]) -> None:
            payload = json.dumps(data, separators=(",", ":"))
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {payload}\n\n".encode(),
                    "more_body": True,
                }
            )

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-iop-run-id", stream.run_id.encode()),
                ],
            }
        )
        await chunk({**head, "choices": [_choice({"role": "assistant", "content": ""})]})
        last = stream.last
        try:
            while last is not None and not last.kind.terminal:
                if last.kind is EventKind.DELTA and last.text:
                    await chunk({**head, "choices": [_choice({"content": last.text})]})
                last = await stream.__anext__()
        except (RemoteError, SessionClosed, ReplyTimeout) as exc:  # the headers are gone
            lost = DoorError(503, f"node lost: {exc}", kind="server_error", code="unavailable")
            await chunk(lost.body())
            await send({"type": "http.response.body", "body": b""})
            return
        assert last is not None
        if last.kind is EventKind.SUCCEEDED:
            await chunk({**head, "choices": [_choice({}, _finish_reason(last))]})
            if request.include_usage:
                await chunk({**head, "choices": [], "usage": _usage_json(last.usage)})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            await chunk(terminal_error(last).body())
            await send({"type": "http.response.body", "body": b""})


def _choice(delta: Mapping[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once the client has gone (hypercorn says http.disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _cancel_abandoned(edge: Edge, run_id: str) -> None:
    """Cancel a run whose client left before its end (shielded, bounded)."""
    with trio.move_on_after(CANCEL_TIMEOUT, shield=True) as bounded:
        with suppress(RemoteError, SessionClosed, ReplyTimeout, NoNode):
            await edge.cancel(run_id, "client_lost")
            log.info("edge: run %s cancelled: its HTTP client left", run_id)
    if bounded.cancelled_caught:
        log.warning("edge: the node did not confirm the cancel of run %s in time", run_id)
