"""The small HTTP server over real loopback sockets (real clock; every wait is bounded)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import attrs
import httpx
import pytest
import trio

from iop_trio.httpserver import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    HttpSettings,
    Route,
    serve_http,
)

from .support import logged

WAIT = 10.0  # the bound of any single wait in these tests


@attrs.frozen
class Served:
    server: HttpServer
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def serving(
    routes: Mapping[tuple[str, str], Route], settings: HttpSettings | None = None
) -> AsyncIterator[Served]:
    server = HttpServer(routes, settings=settings)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(WAIT):
            port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield Served(server, port)
        nursery.cancel_scope.cancel()


async def echo(request: HttpRequest) -> HttpResponse:
    lines = [
        f"{request.method} {request.path}",
        f"subpath={request.subpath}",
        f"query={sorted(request.query.items())}",
        f"body={request.body.decode()}",
    ]
    return HttpResponse.text("\n".join(lines))


async def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("handler bug")


ROUTES: dict[tuple[str, str], Route] = {
    ("GET", "/echo"): echo,
    ("POST", "/echo"): echo,
    ("POST", "/runs/"): echo,
    ("GET", "/boom"): boom,
}


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with trio.fail_after(WAIT):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            received = b""
            while chunk := await stream.receive_some(65536):
                received += chunk
            return received


async def test_get_with_query_and_post_with_body():
    async with serving(ROUTES) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            got = await client.get("/echo", params={"a": "1", "b": "x y", "a2": ""})
            posted = await client.post("/echo", content=b"hello")
        assert got.status_code == 200
        assert got.headers["content-type"] == "text/plain; charset=utf-8"
        assert got.text.splitlines() == [
            "GET /echo",
            "subpath=",
            "query=[('a', '1'), ('a2', ''), ('b', 'x y')]",
            "body=",
        ]
        assert posted.text.splitlines()[3] == "body=hello"


async def test_prefix_route_gets_the_rest_of_the_path():
    async with serving(ROUTES) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            deep = await client.post("/runs/abc/cancel")
            bare = await client.post("/runs/")
            without_slash = await client.post("/runs")
        assert deep.text.splitlines()[:2] == ["POST /runs/abc/cancel", "subpath=abc/cancel"]
        assert bare.text.splitlines()[:2] == ["POST /runs/", "subpath="]
        assert without_slash.status_code == 404


async def test_404_and_405_with_allow():
    async with serving(ROUTES) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            missing = await client.get("/nope")
            wrong = await client.delete("/echo")
            wrong_prefix = await client.get("/runs/x")
        assert missing.status_code == 404
        assert wrong.status_code == 405
        assert wrong.headers["allow"] == "GET, HEAD, POST"
        assert wrong_prefix.status_code == 405
        assert wrong_prefix.headers["allow"] == "POST"


async def test_head_is_served_by_get_without_the_body():
    async with serving(ROUTES) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            head = await client.head("/echo", params={"q": "1"})
            again = await client.get("/echo")  # the connection is still in step
        assert head.status_code == 200
        assert head.content == b""
        # the GET handler ran (and saw HEAD): the length is that of its body
        length = len("HEAD /echo\nsubpath=\nquery=[('q', '1')]\nbody=")
        assert head.headers["content-length"] == str(length)
        assert again.text.startswith("GET /echo\n")
        assert s.server.connections_total == 1


async def test_keep_alive_serves_two_requests_on_one_connection():
    async with serving(ROUTES) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            first = await client.get("/echo")
            second = await client.post("/echo", content=b"2")
        assert (first.status_code, second.status_code) == (200, 200)
        assert s.server.connections_total == 1
        assert s.server.requests_total == 2


async def test_pipelined_requests_are_answered_in_order():
    async with serving(ROUTES) as s:
        data = (
            b"GET /echo?n=1 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /echo?n=3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        received = await raw_exchange(s.port, data)
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 3
    assert received.index(b"('n', '1')") < received.index(b"body=abc") < received.index(b"'3'")


async def test_a_handler_that_raises_gives_500_and_the_server_goes_on():
    async with serving(ROUTES) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT), logged("iop_trio.httpserver") as records:
            failed = await client.get("/boom")
            after = await client.get("/echo")
        assert failed.status_code == 500
        assert failed.text == "internal server error\n"  # no details leak
        assert after.status_code == 200
        assert s.server.connections_total == 1  # the connection survived too
    [logged_error] = [r for r in records if r.exc_info]
    assert logged_error.getMessage() == "HTTP handler for GET /boom failed"
    assert "handler bug" in str(logged_error.exc_info[1])  # type: ignore[index]


async def test_a_handler_returning_garbage_gives_500():
    async def bad_type(request: HttpRequest) -> HttpResponse:
        return "not a response"  # type: ignore[return-value]

    async def bad_header(request: HttpRequest) -> HttpResponse:
        return HttpResponse(headers=[("X-Bad", "line\r\nbreak")])

    async def body_on_204(request: HttpRequest) -> HttpResponse:
        return HttpResponse(204, b"body")

    routes: dict[tuple[str, str], Route] = {
        ("GET", "/type"): bad_type,
        ("GET", "/header"): bad_header,
        ("GET", "/204"): body_on_204,
        ("GET", "/echo"): echo,
    }
    async with serving(routes) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            statuses = [(await client.get(p)).status_code for p in ("/type", "/header", "/204")]
            after = await client.get("/echo")
        assert statuses == [500, 500, 500]
        assert after.status_code == 200


async def test_body_over_the_limit_gets_413():
    settings = HttpSettings(max_body=1000)
    async with serving(ROUTES, settings) as s, httpx.AsyncClient(base_url=s.url) as client:

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(5):
                yield b"x" * 300

        with trio.fail_after(WAIT):
            exact = await client.post("/echo", content=b"x" * 1000)
            declared = await client.post("/echo", content=b"x" * 1001)
            chunked = await client.post("/echo", content=chunks())
            after = await client.get("/echo")
        assert exact.status_code == 200
        assert declared.status_code == 413
        assert declared.headers["connection"] == "close"
        assert chunked.status_code == 413
        assert after.status_code == 200


async def test_413_reaches_a_client_that_sent_a_big_body_anyway():
    # the server answers without reading the body, then drains it so that
    # closing the socket does not reset the connection under the response
    settings = HttpSettings(max_body=1024)
    async with serving(ROUTES, settings) as s:
        body = b"y" * 300_000
        head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream("127.0.0.1", s.port)
            async with stream, trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, head.encode() + body)
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
    assert received.startswith(b"HTTP/1.1 413 ")


async def test_bad_requests_get_400_or_431():
    settings = HttpSettings(max_header_size=2048)
    async with serving(ROUTES, settings) as s:
        garbage = await raw_exchange(s.port, b"this is not http\r\n\r\n")
        dots = await raw_exchange(s.port, b"GET /runs/../echo HTTP/1.1\r\nHost: x\r\n\r\n")
        huge = await raw_exchange(
            s.port, b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000 + b"\r\n\r\n"
        )
        with trio.fail_after(WAIT):
            await s.server.wait_idle()
    assert garbage.startswith(b"HTTP/1.1 400 ")
    assert dots.startswith(b"HTTP/1.1 400 ")
    assert huge.startswith(b"HTTP/1.1 431 ")


async def test_a_stalled_half_request_is_dropped_after_the_read_timeout():
    timeout = 0.3
    settings = HttpSettings(read_timeout=timeout, linger=0.2)
    async with serving(ROUTES, settings) as s, httpx.AsyncClient(base_url=s.url) as client:
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream("127.0.0.1", s.port)
            async with stream:
                start = trio.current_time()
                await stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow:")
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
                elapsed = trio.current_time() - start
            # meanwhile, and after, others are served
            assert (await client.get("/echo")).status_code == 200
            await client.aclose()
            await s.server.wait_idle()
    assert received.startswith(b"HTTP/1.1 408 ")
    assert timeout * 0.9 <= elapsed < timeout + 5
    assert s.server.open_connections == 0


async def test_a_stalled_body_is_dropped_too():
    settings = HttpSettings(read_timeout=0.3, linger=0.2)
    async with serving(ROUTES, settings) as s:
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream("127.0.0.1", s.port)
            async with stream:
                await stream.send_all(
                    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"
                )
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
    assert received.startswith(b"HTTP/1.1 408 ")


async def test_an_idle_keep_alive_connection_is_closed_quietly():
    settings = HttpSettings(read_timeout=0.3)
    async with serving(ROUTES, settings) as s:
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream("127.0.0.1", s.port)
            async with stream:
                await stream.send_all(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
            await s.server.wait_idle()
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"408" not in received


async def test_concurrent_clients_are_served_at_once():
    n = 8
    inside = 0
    all_in = trio.Event()

    async def gather(request: HttpRequest) -> HttpResponse:
        nonlocal inside
        inside += 1
        if inside == n:
            all_in.set()
        await all_in.wait()  # only returns once every client is being served
        return HttpResponse.text(request.query["i"])

    results: dict[int, str] = {}
    async with serving({("GET", "/gather"): gather}) as s:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=s.url, limits=limits) as client:

            async def one(i: int) -> None:
                results[i] = (await client.get("/gather", params={"i": str(i)})).text

            with trio.fail_after(WAIT):
                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)
        assert results == {i: str(i) for i in range(n)}
        assert s.server.connections_total == n


async def test_connections_over_the_limit_are_refused_and_others_go_on():
    entered = trio.Event()
    release = trio.Event()

    async def hold(request: HttpRequest) -> HttpResponse:
        entered.set()
        await release.wait()
        return HttpResponse.text("held")

    settings = HttpSettings(max_connections=1)
    async with serving({("GET", "/hold"): hold, ("GET", "/echo"): echo}, settings) as s:
        async with httpx.AsyncClient(base_url=s.url) as first, trio.open_nursery() as nursery:
            held: list[httpx.Response] = []

            async def wait_held() -> None:
                held.append(await first.get("/hold"))

            with trio.fail_after(WAIT):
                nursery.start_soon(wait_held)
                await entered.wait()
                refused = await raw_exchange(s.port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
                assert refused == b""
                release.set()
        assert held[0].text == "held"


async def test_serve_http_reports_the_port_and_routes_are_checked():
    async with trio.open_nursery() as nursery:
        with trio.fail_after(WAIT):
            port = await nursery.start(serve_http, ROUTES, "127.0.0.1", 0)
            async with httpx.AsyncClient() as client:
                got = await client.get(f"http://127.0.0.1:{port}/echo")
        assert got.status_code == 200
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="upper-case"):
        HttpServer({("get", "/x"): echo})
    with pytest.raises(ValueError, match="start with"):
        HttpServer({("GET", "x"): echo})
    with pytest.raises(ValueError, match="read_timeout"):
        HttpSettings(read_timeout=-1)


def test_reprs_say_what_they_are():
    server = HttpServer(ROUTES)
    assert repr(server) == "<HttpServer routes=4 open=0 connections=0 requests=0>"
    request = HttpRequest("GET", "/x", query={"a": "1"}, body=b"abc")
    assert repr(request) == "<HttpRequest GET /x?1 params body=3B>"
    assert repr(HttpResponse.text("hi", 404)) == (
        "<HttpResponse 404 text/plain; charset=utf-8 body=2B>"
    )


async def test_request_target_forms():
    async with serving(ROUTES) as s:
        absolute = await raw_exchange(
            s.port, b"GET http://example/echo?a=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        double_slash = await raw_exchange(
            s.port, b"GET //x/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        encoded = await raw_exchange(
            s.port, b"GET /%65cho?b=%20 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
    assert absolute.startswith(b"HTTP/1.1 200 ") and b"query=[('a', '1')]" in absolute
    assert double_slash.startswith(b"HTTP/1.1 404 ")
    assert encoded.startswith(b"HTTP/1.1 200 ") and b"query=[('b', ' ')]" in encoded


async def test_expect_100_continue_is_answered_before_the_body():
    async with serving(ROUTES) as s:
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream("127.0.0.1", s.port)
            async with stream:
                await stream.send_all(
                    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                    b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
                )
                interim = await stream.receive_some(65536)
                assert interim.startswith(b"HTTP/1.1 100 ")
                await stream.send_all(b"ok")
                received = b""
                while chunk := await stream.receive_some(65536):
                    received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"body=ok" in received
