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

- the connection: the edge's connection guard bounds the connections that have not
  yet sent a request with a good token (per peer address and in all), and how long
  they may take (:mod:`iop_trio.transport.guard`): such a connection is closed, or
  refused at once with 503;
- a wrong or missing token: 401; a caller over its rate or with its most runs open
  (identities): 429 ``rate_limited`` with ``Retry-After``; a body over the edge's
  ``max_message_size``: 413; a body not whole within :data:`BODY_TIMEOUT`
  seconds: 408; not JSON (``NaN`` and ``Infinity`` are not JSON, nor is a number
  too large for a float), nested deeper than :data:`MAX_DEPTH`, a string that is
  not Unicode text (a lone surrogate), or a field of the wrong shape or out of
  range: 400 naming the field (``param``, e.g. ``messages[0].content``); a target
  the caller may not use or a priority above its own: 403; a target no connected
  node serves: 404 (``model_not_found``), or 503 if its node is gone for now;
- the run is refused by the gate (REJECTED ``queue_full``, ``queue_timeout``, or
  ``rate_limited``: its tenant is over its token rate or tokens in flight): 429 with
  ``Retry-After`` (whole seconds, rounded up, from the run's own hint); ``too_large``
  (it reserves more tokens than a budget holds, so it could never start): 400;
  the node is draining, its store cannot write, or it was lost: 503 with
  ``Retry-After``. A streaming answer's headers wait for the engine's first
  words, so these come as statuses, not as events in a 200 stream, and so does an
  engine's own refusal (below);
- the run fails once started (the engine fails, the run's time or output bound):
  502 (504 for ``run_timeout``; 429 for ``engine_busy`` and 503 for
  ``engine_unavailable``, the engine's own 429 or 503, with ``Retry-After`` from
  its hint), or in a stream that has begun (the engine failed after its first
  words), an ``error`` event (which the
  ``openai`` package raises as ``APIError``) and no ``[DONE]``;
- the client goes away before the run ends (it closes the connection, or has not
  read what it was sent for the edge's ``send_timeout``, the bound the proto-socket
  sets its slow readers): the run is cancelled with reason ``client_lost`` and its
  slot is free.

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
from contextlib import ExitStack, suppress
from typing import Any

import attrs
import cattrs
import trio

from ..model import EventKind, RunEvent, RunSpec, Usage, field_check
from ..protocol.errors import (
    NODE_RETRY_AFTER,
    NoNode,
    Refusal,
    RemoteError,
    ReplyTimeout,
    SessionClosed,
    http_answer,
    refusal_for,
)
from ..structure import problems, strict_converter
from ..transport.asgi import Receive, Scope, Send, is_http, respond_json, serve_asgi
from ..transport.auth import bearer_token
from ..transport.caller import RunStream
from .edge import Edge
from .identities import Caller
from .spans import DoorSpan, door_span

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
#: Seconds a request's body may take to arrive, whole.
BODY_TIMEOUT = 30.0
#: How deep a request body's JSON may nest (objects and arrays): a run's options cross
#: the proto-socket as protobuf, which refuses deeper nesting than about 50.
MAX_DEPTH = 32

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
#: A REJECTED run's reason -> (HTTP status, OpenAI error type), where it is not the 429 of
#: a full or slow queue: a run over a token budget on its own could never start.
REJECTED_STATUS: dict[str, tuple[int, str]] = {
    "too_large": (400, "invalid_request_error"),
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

    @classmethod
    def refused(cls, refusal: Refusal) -> DoorError:
        """The answer to a request refused with ``refusal``: its code's HTTP status and
        OpenAI error (:func:`~iop_trio.protocol.errors.http_answer`)."""
        answer = http_answer(refusal.code)
        return cls(
            answer.status,
            refusal.message,
            kind=answer.kind,
            code=answer.name,
            param=answer.param,
            retry_after=refusal.retry_after,
        )


@attrs.frozen
class ChatRequest:
    """A chat completion request, checked: the run it asks for and how to answer."""

    target: str
    messages: tuple[tuple[str, str], ...]
    options: Mapping[str, Any]
    priority: int = 0
    stream: bool = False
    include_usage: bool = False


def _not_empty(value: object) -> str | None:
    return None if value else "must not be empty"


def _only_one(value: object) -> str | None:
    return None if value == 1 else f"must be 1, not {value!r}"


def _priority_range(value: object) -> str | None:
    ok = isinstance(value, int) and -1000 <= value <= 1000
    return None if ok else f"must be an integer from -1000 to 1000, not {value!r}"


def _text_part(value: object) -> str | None:
    return None if value == "text" else f"only text content is supported, not {value!r}"


@attrs.frozen
class _TextPart:
    type: str = attrs.field(validator=field_check(_text_part))
    text: str


@attrs.frozen
class _Message:
    role: str
    content: str | list[_TextPart]


@attrs.frozen
class _StreamOptions:
    include_usage: bool = False


@attrs.frozen
class _ChatBody:
    """The fields of a chat completion request that are the request itself (the rest
    are run options); other keys of a message or of ``stream_options`` are ignored."""

    model: str = attrs.field(validator=field_check(_not_empty))
    messages: list[_Message] = attrs.field(validator=field_check(_not_empty))
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    user: str | None = None
    n: int | None = attrs.field(default=None, validator=field_check(_only_one))
    priority: int | None = attrs.field(default=None, validator=field_check(_priority_range))


def _door_converter() -> cattrs.Converter:
    conv = strict_converter(forbid_extra_keys=False)

    def content(value: Any, _: type) -> str | list[_TextPart]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            structured: list[_TextPart] = conv.structure(value, list[_TextPart])
            return structured
        raise ValueError(f"must be a string or a list of text parts, not {value!r}")

    base_part = conv.get_structure_hook(_TextPart)

    def text_part(value: Any, _: type) -> _TextPart:
        # the type first: an image part has no text, and that is not what is wrong with it
        if isinstance(value, Mapping) and value.get("type") != "text":
            raise ValueError(f"type: {_text_part(value.get('type'))}")
        part: _TextPart = base_part(value, _TextPart)
        return part

    conv.register_structure_hook(_TextPart, text_part)
    conv.register_structure_hook(str | list[_TextPart], content)
    return conv


_CONVERTER = _door_converter()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_body(raw: bytes) -> object:
    """A request body's JSON; DoorError 400 naming the place for anything a run cannot
    carry: not JSON (``NaN``, ``Infinity`` and numbers too large for a float are not),
    nested deeper than :data:`MAX_DEPTH`, or a string that is not Unicode text."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise DoorError(400, f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise DoorError(400, f"the body is not JSON: {exc}") from None
    _check_json(body)
    return body


def _check_json(body: object) -> None:
    # iterative, so no depth of nesting can exhaust the stack
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise DoorError(400, f"nested deeper than {MAX_DEPTH} levels", param=path or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path or None)
                    where = f"{path}.{key}" if path else key
                else:
                    where = f"{path}[{key}]"
                stack.append((item, where, depth + 1))
        elif isinstance(value, str):
            _check_text(value, path or None)
        elif isinstance(value, float) and not math.isfinite(value):
            raise DoorError(400, "a number too large for a float", param=path or None)


def _check_text(text: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DoorError(
            400, "a string that is not Unicode text (a lone surrogate)", param=param
        ) from None


def parse_chat_request(body: object, adapter_kind: str = "") -> ChatRequest:
    """Check a decoded ``/v1/chat/completions`` body; DoorError (400) names the field.

    ``adapter_kind`` is the kind of the target's adapter, for :data:`OPTION_NAMES`.
    Option values are not checked here: the node checks them against the target.
    """
    if not isinstance(body, dict):
        raise DoorError(400, "the request body must be a JSON object")
    try:
        request = _CONVERTER.structure(
            {k: v for k, v in body.items() if k in REQUEST_FIELDS and v is not None}, _ChatBody
        )
    except Exception as exc:  # cattrs raises class validation groups
        found = problems(exc)
        path, problem = found[0] if found else ("", str(exc))
        raise DoorError(
            400, f"{path}: {problem}" if path else problem, param=path or None
        ) from None
    messages = tuple(
        (
            m.role,
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
        )
        for m in request.messages
    )
    renames: dict[str, str] = OPTION_NAMES.get(adapter_kind, {})
    options: dict[str, Any] = {}
    for key, value in body.items():
        if key in REQUEST_FIELDS or value is None:
            continue
        name = FIELD_ALIASES.get(str(key), str(key))
        options[renames.get(name, name)] = value
    stream_options = request.stream_options
    return ChatRequest(
        target=request.model,
        messages=messages,
        options=options,
        priority=request.priority or 0,
        stream=bool(request.stream),
        include_usage=stream_options is not None and stream_options.include_usage,
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
    elif event.kind is EventKind.REJECTED:
        status, kind = REJECTED_STATUS.get(event.reason, (status, kind))
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
            with door_span(self.edge.tracer, scope.get("headers") or []) as door:
                try:
                    caller = self._caller(scope)
                    body = await self._body(receive)
                    await self._chat(caller, body, receive, send, door)
                except DoorError as exc:
                    door.refused(exc.code, exc.status, exc.message)
                    raise
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
        """Who asks (None: anyone may, no identities), or DoorError 401 (429 for a caller
        over its rate). A good token proves the connection to the edge's guard."""
        who = self.edge.authorize("/client", bearer_token(scope.get("headers") or []))
        if who is None:
            raise DoorError(
                401,
                "a wrong or missing token: send Authorization: Bearer <token>",
                kind="invalid_request_error",
                code="invalid_api_key",
            )
        client = scope.get("client")
        self.edge.guard.prove_address(tuple(client) if client else None)
        caller = who if isinstance(who, Caller) else None
        self._refuse_on(lambda: self.edge.take_request(caller), "")
        return caller

    @staticmethod
    def _refuse_on(action: Any, kind: str) -> Any:
        """``action()``, or the DoorError for a failure a client can meet
        (:func:`~iop_trio.protocol.errors.refusal_for`)."""
        try:
            return action()
        except Exception as exc:
            refusal = refusal_for(exc, kind)
            if refusal is None:
                raise
            raise DoorError.refused(refusal) from None

    async def _body(self, receive: Receive) -> object:
        limit = self.edge.settings.max_message_size
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(BODY_TIMEOUT) as bounded:
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
        if bounded.cancelled_caught:
            raise DoorError(
                408, f"the request body did not arrive within {BODY_TIMEOUT:g}s", code="timeout"
            )
        return decode_body(b"".join(chunks))

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
        self, caller: Caller | None, body: object, receive: Receive, send: Send, door: DoorSpan
    ) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        request = parse_chat_request(
            body, self._adapter_kind(model if isinstance(model, str) else "")
        )
        tenant, run_id = self._refuse_on(
            lambda: self.edge.admit(caller, request.target, request.priority, ""), "run_request"
        )
        spec = RunSpec(
            request.target,
            messages=request.messages,
            options=request.options,
            priority=request.priority,
            tenant=tenant,
            run_id=run_id or None,
        )
        spec = door.requested(spec, self._adapter_kind(request.target))
        refused: DoorError | None = None
        with ExitStack() as counted:
            self._refuse_on(
                lambda: counted.enter_context(self.edge.counting_run(caller)), "run_request"
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                try:
                    await self._run(spec, request, send, door)
                except DoorError as exc:  # raised here, not in the nursery's group
                    refused = exc
                nursery.cancel_scope.cancel()
        if refused is not None:
            raise refused

    async def _run(self, spec: RunSpec, request: ChatRequest, send: Send, door: DoorSpan) -> None:
        created = int(time.time())
        try:
            async with self.edge.run(spec) as stream:
                try:
                    if request.stream:
                        await self._stream(stream, request, created, send)
                    else:
                        await self._whole(stream, request, created, send)
                finally:
                    door.ended(stream.last, stream.run_id)
                    if stream.last is None or not stream.last.kind.terminal:
                        await _cancel_abandoned(self.edge, stream.run_id)
        except DoorError:
            raise
        except Exception as exc:
            refusal = refusal_for(exc, "run_request")
            if refusal is None:
                raise
            raise DoorError.refused(refusal) from None

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
        await _first_words(stream)
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


async def _first_words(stream: RunStream) -> None:
    """Read ``stream`` to its first delta or its end: the headers wait for them, so a
    rejection, or an engine that turns the run away, is still a status (raised as the
    DoorError of its terminal event)."""
    async for event in stream:
        if event.kind is EventKind.DELTA:
            return
        if event.kind.terminal:
            if event.kind is not EventKind.SUCCEEDED:
                raise terminal_error(event)
            return


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


async def serve_door(
    edge: Edge,
    host: str,
    port: int,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``edge``'s OpenAI-compatible door on ``host:port`` (0: any free port) until
    cancelled (or ``shutdown``); ``task_status`` gets the port; OSError if it cannot be
    bound.

    https with the edge's ``ssl_context`` (and so its client certificates, if it asks
    for them), within the edge's connection guard, and a client that has not read for
    the edge's ``send_timeout`` is gone. No read timeout: a long stream is not an idle
    client.
    """
    await serve_asgi(
        OpenAIFrontDoor(edge),
        host,
        port,
        shutdown=shutdown,
        read_timeout=None,
        ssl_context=edge.ssl_context,
        guard=edge.guard,
        send_timeout=edge.settings.send_timeout,
        prove_on_request=False,  # the door proves a connection once its token is good
        task_status=task_status,
    )
