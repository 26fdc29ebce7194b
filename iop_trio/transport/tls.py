"""Opening a proto-socket's WebSocket, with TLS: contexts made from files, a
certificate check that fails in one clear line at once, and an opening bounded as a
whole.

trio-websocket opens a ``wss:`` connection lazily: a certificate the client does not
trust breaks its reader task, and the caller sees only a ``ConnectionTimeout`` when
its connect timeout runs out. :func:`check_tls` shakes hands first, on a connection of
its own, so the caller gets :class:`TLSFailed` ("certificate verify failed: ...")
at once instead. And trio-websocket's own connect timeout leaves its reader waiting on
a peer that never answers the upgrade (an edge that refused the client's certificate
after the handshake, say): :func:`open_websocket` bounds the opening as a whole.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import trio
from trio_websocket import ConnectionTimeout, WebSocketConnection, open_websocket_url

from .auth import bearer_header

#: Seconds :func:`check_tls` listens after the handshake for a server's refusal.
ALERT_WINDOW = 0.25


class TLSFailed(Exception):
    """The TLS handshake with the peer failed; the message says why, in one line."""


class OpeningTimeout(ConnectionTimeout):
    """The peer did not open the WebSocket within the connect timeout."""


@asynccontextmanager
async def open_websocket(
    url: str,
    *,
    token: str | None,
    ssl_context: ssl.SSLContext | None,
    max_message_size: int,
    connect_timeout: float,
    subprotocols: Sequence[str] = (),
) -> AsyncIterator[WebSocketConnection]:
    """The WebSocket at ``url``, with ``token`` as its bearer token, offering
    ``subprotocols``. TLSFailed at once for a ``wss:`` peer whose certificate is not
    trusted; OpeningTimeout if it is not open within ``connect_timeout`` seconds (the
    bound is lifted once it is open)."""
    with trio.move_on_after(connect_timeout):  # a bad certificate says so at once
        await check_tls(url, ssl_context)
    with trio.CancelScope(deadline=trio.current_time() + connect_timeout) as opening:
        async with open_websocket_url(
            url,
            ssl_context=ssl_context,
            extra_headers=bearer_header(token),
            max_message_size=max_message_size,
            connect_timeout=connect_timeout,
            subprotocols=subprotocols or None,
        ) as ws:
            opening.deadline = math.inf
            yield ws
    if opening.cancelled_caught:
        raise OpeningTimeout(f"the edge did not open the WebSocket within {connect_timeout:g}s")


def client_context(
    *,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    server_name: str | None = None,
) -> ssl.SSLContext:
    """A context that trusts ``ca_file`` (the system's CAs if None), presents
    ``cert_file``/``key_file`` if given (mutual TLS), and checks the peer's certificate
    against ``server_name`` instead of the host of the URL if given."""
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    if server_name is not None:
        _check_name(context, server_name)
    return context


def server_context(
    *, cert_file: str, key_file: str | None = None, client_ca_file: str | None = None
) -> ssl.SSLContext:
    """A server's context with its certificate; with ``client_ca_file`` every client must
    present a certificate signed by that CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _check_name(context: ssl.SSLContext, server_name: str) -> None:
    # ssl.SSLContext is a Python class: an instance attribute shadows its wrap_bio, which
    # trio's SSLStream calls with the URL's host; the certificate is checked against
    # server_name instead (trio-websocket has no parameter for it)
    wrap_bio = context.wrap_bio

    def wrap_for_name(
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        return wrap_bio(
            incoming,
            outgoing,
            server_side=server_side,
            server_hostname=server_name,
            session=session,
        )

    context.wrap_bio = wrap_for_name  # type: ignore[method-assign]


async def check_tls(url: str, context: ssl.SSLContext | None) -> None:
    """For a ``wss:`` URL, shake hands with its server and close; TLSFailed with the
    reason if the handshake fails (an OSError if nothing listens). ``ws:`` URLs pass."""
    parts = urlsplit(url)
    if parts.scheme != "wss":
        return
    host = parts.hostname or ""
    stream = await trio.open_ssl_over_tcp_stream(
        host, parts.port or 443, ssl_context=context or ssl.create_default_context()
    )
    try:
        await stream.do_handshake()
        # in TLS 1.3 a server that wants a client certificate says no after the client's
        # side of the handshake is done, in an alert that comes with the next read
        with trio.move_on_after(ALERT_WINDOW):
            await stream.receive_some(1)
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__
        if isinstance(cause, ssl.SSLCertVerificationError):
            raise TLSFailed(f"certificate verify failed: {cause.verify_message}") from None
        if isinstance(cause, ssl.SSLError):
            reason = cause.reason or str(cause)
            if "EOF" in reason.upper():
                # a server that refuses the client's certificate (or its lack of one) may
                # just hang up
                raise TLSFailed(
                    f"TLS handshake failed: the server closed the connection ({reason}): "
                    "does it require a client certificate, or not trust this one?"
                ) from None
            raise TLSFailed(f"TLS handshake failed: {reason}") from None
        raise
    finally:
        await trio.aclose_forcefully(stream)
