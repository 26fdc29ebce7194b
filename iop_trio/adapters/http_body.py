"""An HTTP/1.1 response body's framing, undone: sans-IO, bytes in, body bytes out.

h11 reads a run's response head (:mod:`.engine_http`); the body's framing is undone here,
a whole network read at a time. h11 gives one event a chunk, about 6 us each on this
project's machines, and an engine writes one chunk a token; :class:`ChunkedBody` takes
every chunk of a read in one pass (about 1.5 us a chunk), which at tens of thousands of
tokens a second is a sixth of a core.

Three framings (RFC 9112 section 6), chosen by :func:`body_for` from a head h11 has
already validated: ``Transfer-Encoding: chunked``, ``Content-Length``, or neither, a
body that ends when the engine closes the connection (an HTTP/1.0 answer, say).

Semantics, the same for each:

- :meth:`~Body.feed` takes the bytes of one read and returns the body bytes in them (the
  framing taken off), ``b""`` when there are none yet; :attr:`~Body.done` turns True at
  the body's end, and bytes past it are kept in :attr:`~Body.extra` (an engine that
  sends them cannot be trusted with another request on that connection).
- A fault in the framing (a chunk size that is not hex, a chunk not ended by CRLF, a
  header line past :data:`MAX_LINE`) raises :class:`BodyError`; if the read held body
  bytes before the fault they are returned first and the fault is raised by the next
  :meth:`~Body.feed` or :meth:`~Body.eof`, so what the engine sent whole is kept.
- :meth:`~Body.eof`: the engine closed the connection. The end of a close-delimited
  body; for the others, :class:`BodyError` unless the body was done.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: The longest chunk-size or trailer line taken, and the most trailer bytes.
MAX_LINE = 4096
MAX_TRAILERS = 64 * 1024

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
#: What the engine closing mid-body is called (httpcore's words, so messages read as
#: they did on httpx).
INCOMPLETE = "peer closed connection without sending complete message body"


class BodyError(Exception):
    """The body's framing is broken, or the engine closed the connection before its end."""


class Body:
    """The framing of one response body (module docstring); a subclass a framing."""

    kind = "body"

    def __init__(self) -> None:
        self.done = False
        self.extra = b""  # bytes after the body's end
        self.fault: BodyError | None = None  # found after body bytes a feed returned

    def __repr__(self) -> str:
        return f"<{type(self).__name__} done={self.done} fault={self.fault!r}>"

    def feed(self, data: bytes) -> bytes:
        """The body bytes in ``data``; see the module docstring."""
        if self.fault is not None:
            raise self.fault
        if self.done:
            self.extra += data
            return b""
        return self._take(data)

    def eof(self) -> None:
        """The engine closed the connection; BodyError if the body is not whole."""
        if self.fault is not None:
            raise self.fault
        if not self.done:
            raise BodyError(f"{INCOMPLETE}: {self.kind} cut short")

    def _take(self, data: bytes) -> bytes:
        raise NotImplementedError


class UntilClose(Body):
    """A body that ends when the engine closes the connection."""

    kind = "close-delimited body"

    def _take(self, data: bytes) -> bytes:
        return data

    def eof(self) -> None:
        self.done = True


class LengthBody(Body):
    """A body of ``Content-Length`` bytes."""

    kind = "content-length body"

    def __init__(self, length: int) -> None:
        super().__init__()
        self.left = length
        self.done = length == 0

    def _take(self, data: bytes) -> bytes:
        if len(data) < self.left:
            self.left -= len(data)
            return data
        body, self.extra = data[: self.left], data[self.left :]
        self.left = 0
        self.done = True
        return body


#: The states of a chunked body: what the next bytes are.
SIZE, DATA, DATA_END, TRAILER = "size", "data", "data end", "trailer"


class ChunkedBody(Body):
    """A ``Transfer-Encoding: chunked`` body: chunks of ``size CRLF data CRLF``, ended
    by a chunk of size 0 and trailer lines up to an empty one (the trailers are
    dropped, as httpx drops them)."""

    kind = "chunked body"

    def __init__(self) -> None:
        super().__init__()
        self.state = SIZE
        self.left = 0  # bytes of the chunk's data still to come
        self.trailers = 0  # trailer bytes so far
        self._buffer = b""  # a line (or a CRLF) not yet whole

    def __repr__(self) -> str:
        return f"<ChunkedBody {self.state} left={self.left} done={self.done}>"

    def _take(self, data: bytes) -> bytes:
        if self._buffer:
            data, self._buffer = self._buffer + data, b""
        parts: list[bytes] = []
        try:
            at = self._chunks(data, parts)
        except BodyError as exc:
            if not parts:
                raise
            self.fault = exc
            return b"".join(parts)
        if self.done:
            self.extra = data[at:]
        else:
            self._buffer = data[at:]
            if len(self._buffer) > MAX_LINE and self.state is not DATA:
                raise BodyError(f"a chunk's {self.state} line is over {MAX_LINE} bytes")
        return b"".join(parts)

    def _chunks(self, data: bytes, parts: list[bytes]) -> int:
        """Take what ``data`` holds from ``at`` 0 on, appending the body bytes to
        ``parts``; the offset of the first byte not taken (a line not yet whole)."""
        at, end = 0, len(data)
        while at < end and not self.done:
            if self.state is DATA:
                take = min(self.left, end - at)
                parts.append(data[at : at + take])
                at += take
                self.left -= take
                if self.left == 0:
                    self.state = DATA_END
            elif self.state is DATA_END:
                if end - at < 2:
                    return at
                if data[at : at + 2] != b"\r\n":
                    raise BodyError("a chunk's data is not followed by CRLF")
                at += 2
                self.state = SIZE
            else:
                line_end = data.find(b"\r\n", at)
                if line_end < 0:
                    return at
                self._line(data[at:line_end])
                at = line_end + 2
        return at

    def _line(self, line: bytes) -> None:
        """A chunk-size line (``size [; extensions]``) or, after the last chunk, a
        trailer line (an empty one ends the body)."""
        if self.state is TRAILER:
            self.trailers += len(line) + 2
            if self.trailers > MAX_TRAILERS:
                raise BodyError(f"the trailers are over {MAX_TRAILERS} bytes")
            self.done = not line
            return
        size = line.split(b";", 1)[0].strip(b" \t")
        if not _HEX.fullmatch(size):
            raise BodyError(f"bad chunk size {line[:40]!r}")
        self.left = int(size, 16)
        self.state = DATA if self.left else TRAILER


#: Statuses whose answers have no body, whatever their head says (RFC 9112 6.3).
NO_BODY = frozenset({204, 304})


def body_for(status: int, headers: Mapping[str, str]) -> Body:
    """The framing of a response's body, from its status and its head (lower-case names,
    as h11 validated them: one framing, a well-formed length)."""
    if status in NO_BODY or 100 <= status < 200:
        return LengthBody(0)
    coding = headers.get("transfer-encoding", "")
    if coding.strip().lower().endswith("chunked"):
        return ChunkedBody()
    length = headers.get("content-length")
    if length is not None:
        return LengthBody(int(length.split(",")[0].strip()))
    return UntilClose()
