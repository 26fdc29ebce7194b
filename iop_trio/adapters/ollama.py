"""The ``ollama`` adapter: Ollama's native streaming API (NDJSON) over httpx.

A run with messages POSTs ``/api/chat``, one with only a prompt
``/api/generate``, both with ``"stream": true``. Each response line is one
JSON object; each non-empty ``message.content`` (chat) or ``response``
(generate) piece becomes a :class:`Delta` (one token; the lines of one read are one
Delta of as many tokens), and the line with ``"done": true``
a :class:`Completion` with ``Usage(done_reason, prompt_eval_count,
eval_count)``. Anything after that line is ignored.

Params (target profile overlaid by run options; None means "not set"):

- sampling keys (``temperature``, ``top_p``, ``top_k``, ``num_predict``,
  ``num_ctx``, ``seed``, ``stop``, ``repeat_penalty``, ... see
  :data:`OPTION_KEYS`) go into the request's ``options``; a string ``stop``
  is sent as a one-item list;
- ``options`` (a mapping) is sent as ``options`` too; a sampling key given
  on its own wins over the same key inside ``options``;
- ``keep_alive`` and ``format`` go to the top level of the request;
- ``system``: the ``system`` field of a generate request; for a chat, a
  leading system message unless the conversation already starts with one.

Other params are ignored (a profile may carry params of other adapters).

Failures (see :mod:`iop_trio.adapters.http_errors` for transport faults): a non-2xx
status -> ``engine_error`` with the engine's ``{"error": ...}`` message, or
``model_not_found`` for a 404 about the model; an ``{"error": ...}`` line
mid-stream -> ``engine_error``; a line that is not a JSON object ->
``bad_response``; a 2xx body with no line at all -> ``empty_response``; a
body that ends before the ``done`` line -> ``bad_response`` (truncated).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import attrs
import httpx

from ..model import Usage
from ._http import EngineResponse, HTTPAdapter, HTTPSettings, check_base_url
from .base import AdapterError, AdapterRequest, Chunk, Completion, Delta
from .http_errors import json_error, parse_json, quote
from .stream_formats import LineSplitter, LineTooLong

#: Params that go into Ollama's ``options`` (its model parameters).
OPTION_KEYS = frozenset(
    {
        "num_keep",
        "seed",
        "num_predict",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "repeat_last_n",
        "temperature",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "penalize_newline",
        "stop",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "tfs_z",
        "numa",
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "num_thread",
    }
)
#: Params that go to the top level of the request.
TOP_LEVEL_KEYS = ("keep_alive", "format")
#: What a caller may set by default: sampling and length, not the context size, the
#: memory or the hardware (``num_ctx``, ``num_batch``, ``num_gpu``, ...), which are the
#: operator's.
CALLER_OPTIONS = OPTION_KEYS - {
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "use_mmap",
    "num_thread",
    "numa",
    "num_keep",
}


def _count(obj: Mapping[str, Any], key: str) -> int | None:
    value = obj.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@attrs.frozen(kw_only=True)
class OllamaSettings(HTTPSettings):
    """The config keys of kind ``ollama``: those of every HTTP adapter, with Ollama's
    default address."""

    base_url: str = attrs.field(default="http://127.0.0.1:11434", validator=check_base_url)


class OllamaAdapter(HTTPAdapter):
    """Ollama at ``settings.base_url``; see the module docstring and
    :class:`~iop_trio.adapters._http.HTTPAdapter`."""

    kind = "ollama"
    caller_options = CALLER_OPTIONS
    settings_type = OllamaSettings
    output_limit_options = ("num_predict", "options.num_predict")

    def __init__(
        self,
        name: str = "ollama",
        settings: HTTPSettings | None = None,
        *,
        max_concurrency: int | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            name, settings or OllamaSettings(), max_concurrency=max_concurrency, client=client
        )

    def url(self, request: AdapterRequest) -> str:
        return self.base_url + ("/api/chat" if request.is_chat else "/api/generate")

    def models_url(self) -> str:
        return self.base_url + "/api/tags"

    def model_names(self, body: Any) -> frozenset[str] | None:
        """``{"models": [{"name": "llama3:8b", "model": ...}, ...]}``: the names."""
        models = body.get("models") if isinstance(body, Mapping) else None
        if not isinstance(models, list):
            return None
        return frozenset(
            m[key]
            for m in models
            if isinstance(m, Mapping)
            for key in ("name", "model")
            if isinstance(m.get(key), str)
        )

    def serves(self, model: str, served: frozenset[str]) -> bool:
        """Ollama serves ``llama3`` as ``llama3:latest``."""
        return model in served or (":" not in model and f"{model}:latest" in served)

    def request_body(self, request: AdapterRequest) -> dict[str, Any]:
        params = request.params
        given = params.get("options")
        if given is not None and not isinstance(given, Mapping):
            raise AdapterError(
                "invalid_params", f"ollama param 'options' must be a mapping, not {given!r}"
            )
        options = dict(given or {})
        options.update({k: v for k, v in params.items() if k in OPTION_KEYS and v is not None})
        if isinstance(options.get("stop"), str):
            options["stop"] = [options["stop"]]
        body: dict[str, Any] = {"model": request.model, "stream": True}
        system = params.get("system")
        if system is not None and not isinstance(system, str):
            raise AdapterError("invalid_params", "ollama param 'system' must be a string")
        if request.is_chat:
            messages = [{"role": role, "content": content} for role, content in request.messages]
            if system is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system})
            body["messages"] = messages
        else:
            body["prompt"] = request.prompt
            if system is not None:
                body["system"] = system
        for key in TOP_LEVEL_KEYS:
            if params.get(key) is not None:
                body[key] = params[key]
        if options:
            body["options"] = options
        return body

    def probe_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        options = dict(body.get("options") or {})
        options["num_predict"] = 1
        return {**body, "stream": False, "options": options}

    async def chunks(
        self, response: EngineResponse, request: AdapterRequest
    ) -> AsyncGenerator[Chunk, None]:
        where = response.where
        chat = request.is_chat
        lines = LineSplitter(cr=False)
        seen = False
        while True:
            data = await response.read()
            try:
                batch = lines.feed(data) if data else [lines.flush() or b""]
            except LineTooLong as exc:
                raise AdapterError("bad_response", f"{where}: {exc}") from None
            # the texts of the lines that came in one read go on as one delta (see openai),
            # of one token a line with text
            texts: list[str] = []
            try:
                for raw in batch:
                    if not raw.strip():
                        continue
                    seen = True
                    obj = self._line(raw, where)
                    text = self._text(obj, chat, where)
                    if text:
                        texts.append(text)
                    if obj.get("done") is True:
                        if texts:
                            yield Delta("".join(texts), tokens=len(texts))
                        reason = obj.get("done_reason")
                        yield Completion(
                            Usage(
                                reason if isinstance(reason, str) else "",
                                prompt_tokens=_count(obj, "prompt_eval_count"),
                                completion_tokens=_count(obj, "eval_count"),
                            )
                        )
                        await response.drain()
                        return
            except AdapterError:
                if texts:  # what came before the fault is the run's
                    yield Delta("".join(texts), tokens=len(texts))
                raise
            if texts:
                yield Delta("".join(texts), tokens=len(texts))
            if not data:
                break
        if not seen:
            raise AdapterError("empty_response", f"{where}: the engine sent an empty response")
        raise AdapterError(
            "bad_response", f"{where}: the stream ended before its final (done) line: truncated"
        )

    @staticmethod
    def _line(raw: bytes, where: str) -> dict[str, Any]:
        """One NDJSON line as an object; AdapterError if it is not one or says an error."""
        obj = parse_json(raw, where)
        if not isinstance(obj, dict):
            raise AdapterError(
                "bad_response", f"{where}: a stream line is not an object: {quote(str(obj))}"
            )
        message = json_error(obj)
        if message is not None:
            raise AdapterError("engine_error", f"{where}: engine error: {message}")
        return obj

    @staticmethod
    def _text(obj: Mapping[str, Any], chat: bool, where: str) -> str:
        if chat:
            message = obj.get("message")
            content = message.get("content") if isinstance(message, Mapping) else None
        else:
            content = obj.get("response")
        if content is None or isinstance(content, str):
            return content or ""
        raise AdapterError("bad_response", f"{where}: text of a line is not a string: {content!r}")
