"""The ``openai`` adapter: OpenAI-compatible chat completions (vLLM, llama.cpp, ...) over httpx.

Every run POSTs ``{base_url}/v1/chat/completions`` with ``"stream": true``
(``base_url`` may already end in ``/v1``); a prompt-only run is sent as one
user message. The response is read as server-sent events (see
:class:`~iop_trio.adapters.stream_formats.SSEDecoder`): each event's data is one JSON
chunk; ``choices[0].delta.content`` becomes a :class:`Delta` (one token; the chunks
of one read are one Delta of as many tokens),
``choices[0].finish_reason`` the ``done_reason``, and a ``usage`` object (a
final chunk with no choices, asked for with ``stream_options``) the token
counts. ``data: [DONE]`` ends the stream and yields the :class:`Completion`;
anything after it is ignored. A server that ignores ``stream`` and answers
with one ``application/json`` completion is accepted too.

Params (target profile overlaid by run options; None means "not set"):
``temperature``, ``top_p``, ``max_tokens``, ``stop``, ``seed``,
``presence_penalty`` and ``frequency_penalty`` go into the body as they are;
``extra_body`` (a mapping) is merged into the top level of the body last, so
it can set anything except ``stream``. Other params are ignored.

Failures (see :mod:`iop_trio.adapters.http_errors` for transport faults): a non-2xx
status -> ``engine_error`` with the status and the engine's message (OpenAI
error JSON, a JSON string or plain text), or ``model_not_found`` for a 404
about the model; an error mid-stream (``data: {"error": ...}``, an
``event: error`` or llama.cpp's ``error:`` field) -> ``engine_error``; data
that is not a JSON object -> ``bad_response``; a 2xx body with nothing in it
-> ``empty_response``; a stream that ends without ``[DONE]`` ->
``bad_response`` (truncated).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ..model import EngineSignals, Usage, estimate_prompt_tokens, redact_url
from ._http import HEALTH_TIMEOUT, EngineResponse, HTTPAdapter, HTTPSettings
from .base import AdapterError, AdapterRequest, Chunk, Completion, Delta
from .http_errors import json_error, parse_json, quote
from .stream_formats import MAX_LINE, LineTooLong, SSEDecoder, SSEEvent

#: The engine metrics :meth:`OpenAIAdapter.engine_signals` reads, by what they say:
#: vLLM's names (and its older ``gpu_cache_usage_perc``), then llama.cpp server's.
ENGINE_METRICS: Mapping[str, tuple[str, ...]] = {
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing"),
    "kv_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "llamacpp:kv_cache_usage_ratio",
    ),
}


def engine_signals_from(text: str, now: float) -> EngineSignals | None:
    """The signals in a Prometheus exposition (summed over the samples of each name);
    None if it has no count of waiting requests (an engine that exposes none)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for what, names in ENGINE_METRICS.items():
                if sample.name in names:
                    found[what] = found.get(what, 0.0) + sample.value
    if "waiting" not in found:
        return None
    return EngineSignals(found["waiting"], found.get("running"), found.get("kv_usage"), now)


#: Params sent at the top level of the body as they are.
PARAM_KEYS = (
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
)


def _count(usage: Mapping[str, Any] | None, key: str) -> int | None:
    value = usage.get(key) if usage is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AdapterError(
            "bad_response", f"{where}: a chunk is not an object: {quote(str(value))}"
        )
    return value


class _Progress:
    """What the stream said so far about the end of the run."""

    def __init__(self) -> None:
        self.finish_reason = ""
        self.usage: Mapping[str, Any] | None = None

    def completion(self) -> Completion:
        return Completion(
            Usage(
                self.finish_reason,
                prompt_tokens=_count(self.usage, "prompt_tokens"),
                completion_tokens=_count(self.usage, "completion_tokens"),
            )
        )

    def take(self, chunk: Mapping[str, Any], key: str, where: str) -> str:
        """Note finish_reason and usage of ``chunk``; return the text of choice 0 (``key`` is
        ``delta`` for a stream chunk, ``message`` for a whole completion)."""
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            self.usage = usage
        choices = chunk.get("choices")
        if not choices:
            return ""
        if not isinstance(choices, list):
            raise AdapterError("bad_response", f"{where}: 'choices' is not a list")
        choice = next(
            (c for c in choices if isinstance(c, Mapping) and c.get("index", 0) == 0), None
        )
        if choice is None:
            return ""
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self.finish_reason = reason
        part = choice.get(key)
        content = part.get("content") if isinstance(part, Mapping) else None
        if content is None or isinstance(content, str):
            return content or ""
        raise AdapterError("bad_response", f"{where}: content is not a string: {content!r}")


@attrs.frozen(kw_only=True)
class OpenAISettings(HTTPSettings):
    """The config keys of kind ``openai``: those of every HTTP adapter, and

    ``api_key``, sent as ``Authorization: Bearer ...`` (never shown by
    ``repr``); ``include_usage``, which sends ``stream_options:
    {"include_usage": true}`` so the server reports token counts (turn it off
    for servers that reject unknown fields).
    """

    api_key: str | None = attrs.field(default=None, repr=False)
    include_usage: bool = True


class OpenAIAdapter(HTTPAdapter):
    """An OpenAI-compatible server at ``settings.base_url``; see the module docstring and
    :class:`~iop_trio.adapters._http.HTTPAdapter`."""

    kind = "openai"
    caller_options = frozenset(PARAM_KEYS)
    settings_type = OpenAISettings
    output_limit_options = ("max_tokens", "max_completion_tokens")

    def __init__(
        self,
        name: str,
        settings: OpenAISettings,
        *,
        max_concurrency: int | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(name, settings, max_concurrency=max_concurrency, client=client)
        self.api_key = settings.api_key
        self.include_usage = settings.include_usage
        root = self.base_url if self.base_url.endswith("/v1") else self.base_url + "/v1"
        self.endpoint = root + "/chat/completions"

    def request_headers(self) -> dict[str, str]:
        headers = super().request_headers()
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def request_body(self, request: AdapterRequest) -> dict[str, Any]:
        params = request.params
        extra = params.get("extra_body")
        if extra is not None and not isinstance(extra, Mapping):
            raise AdapterError(
                "invalid_params", f"openai param 'extra_body' must be a mapping, not {extra!r}"
            )
        body: dict[str, Any] = {
            "model": request.model,
            "messages": _messages(request),
            "stream": True,
        }
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        body.update({k: params[k] for k in PARAM_KEYS if params.get(k) is not None})
        body.update(extra or {})
        body["stream"] = True
        return body

    def url(self, request: AdapterRequest) -> str:
        return self.endpoint

    def models_url(self) -> str:
        return self.endpoint.removesuffix("/chat/completions") + "/models"

    @property
    def server_root(self) -> str:
        """The engine server's root, where vLLM and llama.cpp's server serve
        ``/tokenize`` and ``/metrics`` (``base_url`` less its ``/v1``)."""
        return self.base_url.removesuffix("/v1")

    async def _get_json(self, url: str, body: Mapping[str, Any]) -> Any:
        where = f"{self.kind} engine at {url}"
        timeout = httpx.Timeout(HEALTH_TIMEOUT)
        with trio.move_on_after(HEALTH_TIMEOUT * 2) as bounded:
            try:
                response = await self.client.post(
                    url, json=body, headers=self.request_headers(), timeout=timeout
                )
            except httpx.HTTPError as exc:
                raise AdapterError("connection", f"{where}: {type(exc).__name__}: {exc}") from None
        if bounded.cancelled_caught:
            raise AdapterError("timeout", f"{where}: no answer within {HEALTH_TIMEOUT}s")
        if not response.is_success:
            raise AdapterError(
                "engine_error", f"{where}: HTTP {response.status_code}: {quote(response.text)}"
            )
        try:
            return response.json()
        except ValueError:
            raise AdapterError("bad_response", f"{where}: the answer is not JSON") from None

    async def count_tokens(self, request: AdapterRequest, tokenizer: str) -> int | None:
        """``POST <root>/tokenize``: vLLM's with the model and the messages (its chat
        template applied, as the run will be: ``{"count": n}``), llama.cpp server's with
        the text (``{"tokens": [...]}``; its chat template's few tokens not counted)."""
        url = self.server_root + "/tokenize"
        messages = _messages(request)
        if tokenizer == "vllm":
            body: dict[str, Any] = {"model": request.model, "messages": messages}
            answer = await self._get_json(url, body)
            count = answer.get("count") if isinstance(answer, Mapping) else None
        elif tokenizer == "llamacpp":
            text = "\n".join(m["content"] for m in messages)
            answer = await self._get_json(url, {"content": text})
            tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
            count = len(tokens) if isinstance(tokens, list) else None
        else:
            return None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise AdapterError("bad_response", f"{url}: no token count in {quote(str(answer))}")
        return count

    @property
    def signals_url(self) -> str:
        """``<root>/metrics``: vLLM's own, or ``llama-server --metrics``."""
        return self.server_root + "/metrics"

    async def engine_signals(self, now: float) -> EngineSignals | None:
        """``GET <root>/metrics`` (vLLM's own, or ``llama-server --metrics``), read for
        :data:`ENGINE_METRICS`; None for a 404 or an exposition without them."""
        url = self.signals_url
        where = f"{self.kind} engine at {redact_url(url)}"
        response = await self.health_get(url, "metrics")
        if response.status_code in (404, 501):
            return None
        if not response.is_success:
            raise AdapterError("engine_error", f"{where}: HTTP {response.status_code}")
        try:
            return engine_signals_from(response.text, now)
        except ValueError as exc:
            raise AdapterError(
                "bad_response", f"{where}: not a Prometheus exposition: {exc}"
            ) from None

    def model_names(self, body: Any) -> frozenset[str] | None:
        """``{"data": [{"id": ...}, ...]}``: the ids."""
        data = body.get("data") if isinstance(body, Mapping) else None
        if not isinstance(data, list):
            return None
        return frozenset(
            m["id"] for m in data if isinstance(m, Mapping) and isinstance(m.get("id"), str)
        )

    def probe_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        probe = {k: v for k, v in body.items() if k != "stream_options"}
        return {**probe, "stream": False, "max_tokens": 1}

    @staticmethod
    def _event_text(event: SSEEvent, progress: _Progress, where: str) -> str | None:
        """The text of one server-sent event of the stream; None for ``[DONE]``.
        AdapterError for an error event, an error object or a bad chunk."""
        if event.event == "error":
            try:
                message = json_error(parse_json(event.data, where)) or event.data
            except AdapterError:
                message = event.data
            raise AdapterError(
                "engine_error", f"{where}: engine error mid-stream: {quote(message)}"
            )
        if event.data.strip() == "[DONE]":
            if not progress.finish_reason:
                # llama.cpp's server ends a stream it interrupts this way
                raise AdapterError(
                    "bad_response",
                    f"{where}: the engine ended the stream without finishing "
                    "(no finish_reason before [DONE])",
                )
            return None
        chunk = _object(parse_json(event.data, where), where)
        error = json_error(chunk)
        if error is not None:
            raise AdapterError("engine_error", f"{where}: engine error mid-stream: {quote(error)}")
        return progress.take(chunk, "delta", where)

    async def chunks(
        self, response: EngineResponse, request: AdapterRequest
    ) -> AsyncGenerator[Chunk, None]:
        where = response.where
        progress = _Progress()
        if response.content_type.startswith("application/json"):
            # not streamed: one whole completion (or an error object)
            body = await response.read_all(MAX_LINE)
            if not body.strip():
                raise AdapterError("empty_response", f"{where}: the engine sent an empty response")
            completion = _object(parse_json(body, where), where)
            message = json_error(completion)
            if message is not None:
                raise AdapterError("engine_error", f"{where}: engine error: {message}")
            text = progress.take(completion, "message", where)
            if text:  # one answer, not a chunk a token: its tokens estimated from its size
                yield Delta(text, tokens=estimate_prompt_tokens(text))
            yield progress.completion()
            return
        decoder = SSEDecoder()
        seen = False
        # the texts of the events that came in one read go on as one delta: a node that
        # is behind its engine takes fewer, larger deltas; one that keeps up, one a token
        texts: list[str] = []
        while data := await response.read():
            seen = seen or bool(data.strip())
            try:
                for event in decoder.feed(data):
                    piece = self._event_text(event, progress, where)
                    if piece is None:  # [DONE]
                        if texts:
                            yield Delta("".join(texts), tokens=len(texts))
                        yield progress.completion()
                        await response.drain()
                        return
                    if piece:  # a chunk with content: one token
                        texts.append(piece)
            except AdapterError:
                if texts:  # what came before the fault is the run's
                    yield Delta("".join(texts), tokens=len(texts))
                raise
            except LineTooLong as exc:
                raise AdapterError("bad_response", f"{where}: {exc}") from None
            if texts:
                yield Delta("".join(texts), tokens=len(texts))
                texts.clear()
        if not seen:
            raise AdapterError("empty_response", f"{where}: the engine sent an empty response")
        raise AdapterError(
            "bad_response",
            f"{where}: the stream ended without 'data: [DONE]': truncated "
            f"(content-type {response.content_type or 'not given'!r})",
        )


def _messages(request: AdapterRequest) -> list[dict[str, str]]:
    if request.is_chat:
        return [{"role": role, "content": content} for role, content in request.messages]
    return [{"role": "user", "content": request.prompt}]
