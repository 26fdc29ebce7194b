"""A response body's framing undone (adapters/http_body.py), held to h11's reading of the
same bytes: Hypothesis draws bodies, chunkings, extensions, trailers and reads."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_trio.adapters.http_body import (
    MAX_LINE,
    BodyError,
    ChunkedBody,
    LengthBody,
    UntilClose,
    body_for,
)

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def chunked(body: bytes, cuts: list[int], *, ext: bool, upper: bool, trailers: bool) -> bytes:
    bounds = [0, *sorted({c % max(len(body), 1) for c in cuts} - {0}), len(body)]
    out = bytearray()
    for start, end in itertools.pairwise(bounds):
        if end == start:
            continue
        size = f"{end - start:X}" if upper else f"{end - start:x}"
        out += size.encode() + (b";name=value" if ext else b"") + b"\r\n"
        out += body[start:end] + b"\r\n"
    out += b"0\r\n" + (b"x-usage: 7\r\n" if trailers else b"") + b"\r\n"
    return bytes(out)


def split(data: bytes, points: list[int]) -> list[bytes]:
    bounds = [0, *sorted({p % max(len(data), 1) for p in points}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def by_h11(wire: bytes) -> bytes:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "e")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD + wire)
    body = b""
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA
        if isinstance(event, h11.Data):
            body += event.data
    return body


def by_ours(reads: list[bytes]) -> tuple[bytes, ChunkedBody]:
    reader = ChunkedBody()
    body = b"".join(reader.feed(r) for r in reads)
    return body, reader


@given(
    body=st.binary(max_size=600),
    cuts=st.lists(st.integers(0, 1000), max_size=10),
    points=st.lists(st.integers(0, 2000), max_size=20),
    ext=st.booleans(),
    upper=st.booleans(),
    trailers=st.booleans(),
)
def test_a_chunked_body_reads_as_h11_reads_it_however_it_is_split(
    body, cuts, points, ext, upper, trailers
):
    wire = chunked(body, cuts, ext=ext, upper=upper, trailers=trailers)
    got, reader = by_ours(split(wire, points))
    assert got == by_h11(wire) == body
    assert reader.done and reader.extra == b""


@given(body=st.binary(min_size=1, max_size=300), cut=st.integers(0, 10_000))
def test_a_chunked_body_cut_short_gives_what_came_then_an_error_at_the_close(body, cut):
    wire = chunked(body, [len(body) // 2], ext=False, upper=False, trailers=False)
    at = cut % (len(wire) - 1)
    got, reader = by_ours([wire[:at]])
    assert body.startswith(got)
    assert not reader.done
    with pytest.raises(BodyError, match="peer closed connection"):
        reader.eof()


@pytest.mark.parametrize(
    ("wire", "words"),
    [
        (b"zz\r\nabc\r\n", "bad chunk size"),
        (b"3\r\nabcX\r\n", "not followed by CRLF"),
        (b"-1\r\n", "bad chunk size"),
        (b"1" * (MAX_LINE + 10), "over"),
    ],
)
def test_a_broken_framing_is_an_error_naming_it(wire, words):
    reader = ChunkedBody()
    with pytest.raises(BodyError, match=words):
        reader.feed(wire)  # at once, or after the bytes before the fault
        reader.eof()


def test_the_bytes_before_a_fault_are_given_and_the_fault_comes_next():
    reader = ChunkedBody()
    assert reader.feed(b"3\r\nabc\r\nzz\r\n") == b"abc"
    with pytest.raises(BodyError, match="bad chunk size"):
        reader.feed(b"more")
    with pytest.raises(BodyError, match="bad chunk size"):
        reader.eof()


def test_bytes_after_the_end_are_kept_apart():
    reader = ChunkedBody()
    assert reader.feed(b"1\r\na\r\n0\r\n\r\nHTTP/1.1") == b"a"
    assert reader.done and reader.extra == b"HTTP/1.1"
    length = LengthBody(2)
    assert length.feed(b"abcd") == b"ab"
    assert length.done and length.extra == b"cd"


def test_a_length_body_cut_short_and_one_ended_by_the_close():
    length = LengthBody(5)
    assert length.feed(b"abc") == b"abc"
    with pytest.raises(BodyError, match="content-length body cut short"):
        length.eof()
    until = UntilClose()
    assert until.feed(b"abc") == b"abc" and not until.done
    until.eof()
    assert until.done


@pytest.mark.parametrize(
    ("status", "headers", "kind"),
    [
        (200, {"transfer-encoding": "chunked", "content-length": "9"}, ChunkedBody),
        (200, {"content-length": "9"}, LengthBody),
        (200, {}, UntilClose),
        (204, {}, LengthBody),
        (304, {"content-length": "9"}, LengthBody),
    ],
)
def test_the_framing_is_the_head_s(status, headers, kind):
    body = body_for(status, headers)
    assert type(body) is kind
    if status in (204, 304):
        assert body.done
