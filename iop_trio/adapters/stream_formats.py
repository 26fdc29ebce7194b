"""The stream formats of the engines' bodies, sans I/O: NDJSON lines
(:class:`LineSplitter`) and server-sent events (:class:`SSEDecoder`), fed with the body
bytes as they come; a line longer than :data:`MAX_LINE` is refused (:class:`LineTooLong`).
"""

from __future__ import annotations

import re

import attrs

#: The longest line (NDJSON line, SSE field) accepted before the stream is refused.
MAX_LINE = 16 * 1024 * 1024


_ANY_EOL = re.compile(rb"\r\n|\r|\n")
_LF = re.compile(rb"\n")


class LineTooLong(ValueError):
    pass


class LineSplitter:
    """Cuts a byte stream into lines, whatever the chunking.

    With ``cr=True`` (server-sent events) CRLF, LF and a lone CR each end a
    line; otherwise (NDJSON) only LF does and a CR before it is dropped. Only
    these bytes split: a JSON string holding U+2028 or U+0085 stays one line
    (``str.splitlines`` would cut it). :meth:`feed` raises
    :class:`LineTooLong` when an unfinished line exceeds ``max_line`` bytes.
    """

    def __init__(self, *, cr: bool, max_line: int = MAX_LINE) -> None:
        self._cr = cr
        self._eol = _ANY_EOL if cr else _LF
        self._buffer = bytearray()
        self._after_cr = False
        self._max_line = max_line

    def __repr__(self) -> str:
        return f"<LineSplitter cr={self._cr} buffered={len(self._buffer)}>"

    def feed(self, data: bytes) -> list[bytes]:
        """The lines completed by ``data``, without their line ends."""
        if self._after_cr:
            # a CR ended the last chunk: an LF opening this one belongs to it
            self._after_cr = False
            if data.startswith(b"\n"):
                data = data[1:]
        start = len(self._buffer)  # the buffer holds no line end
        self._buffer += data
        buf = self._buffer
        lines: list[bytes] = []
        pos = 0
        for match in self._eol.finditer(buf, start):
            line = bytes(buf[pos : match.start()])
            lines.append(line if self._cr or not line.endswith(b"\r") else line[:-1])
            pos = match.end()
        if self._cr and pos == len(buf) and buf.endswith(b"\r"):
            self._after_cr = True
        del buf[:pos]
        if len(buf) > self._max_line:
            raise LineTooLong(f"a line is longer than {self._max_line} bytes")
        return lines

    @property
    def at_line_start(self) -> bool:
        """Whether the next byte fed starts a line (nothing of an unfinished one held)."""
        return not self._buffer and not self._after_cr

    def flush(self) -> bytes | None:
        """At the end of the stream: the unterminated last line, or None."""
        if not self._buffer:
            return None
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest if self._cr or not rest.endswith(b"\r") else rest[:-1]


@attrs.frozen
class SSEEvent:
    """One dispatched server-sent event; ``data`` lines are joined with LF."""

    data: str
    event: str = "message"
    id: str = ""


class SSEDecoder:
    """Server-sent events as the HTML standard parses them ("event stream interpretation").

    Lines end with CRLF, LF or CR; a leading BOM is dropped; ``:`` starts a
    comment; ``field: value`` loses one space after the colon; a line without
    a colon is a field with an empty value; ``data`` lines accumulate and a
    blank line dispatches the event (none if it had no data). An event cut off
    by the end of the stream is discarded, as the standard says. One
    deliberate extension: a field named ``error`` (llama.cpp's server writes
    ``error: {json}`` mid-stream) is taken as ``event: error`` with that
    value as its data; any other unknown field is ignored.
    """

    def __init__(self, *, max_line: int = MAX_LINE) -> None:
        self._lines = LineSplitter(cr=True, max_line=max_line)
        self._data: list[str] = []
        self._event = ""
        self._last_id = ""
        self._first = True

    def __repr__(self) -> str:
        return f"<SSEDecoder pending_data_lines={len(self._data)}>"

    def feed(self, data: bytes) -> list[SSEEvent]:
        """The events completed by ``data``. Raises :class:`LineTooLong`."""
        if (
            not self._first
            and not self._data
            and not self._event
            and data.endswith(b"\n\n")
            and self._lines.at_line_start
            and b"\r" not in data
        ):
            whole = self._whole_data_events(data)
            if whole is not None:
                return whole
        events = []
        for raw in self._lines.feed(data):
            event = self._line(raw.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        return events

    def _whole_data_events(self, data: bytes) -> list[SSEEvent] | None:
        """The events of ``data`` if it is whole ``data: ...`` events and nothing else (what
        an engine writes, one a token), else None: the line-by-line path decides. Between
        events (nothing held), they are parsed exactly as that path would."""
        events = []
        for block in data[:-2].split(b"\n\n"):
            if not block.startswith(b"data:") or b"\n" in block:
                return None
            value = block[6:] if block.startswith(b"data: ") else block[5:]
            events.append(SSEEvent(value.decode("utf-8", "replace"), "message", self._last_id))
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\0" not in value:
                self._last_id = value
        elif field == "error":
            self._event = "error"
            self._data.append(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEEvent("\n".join(data), event or "message", self._last_id)
