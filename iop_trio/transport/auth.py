"""Bearer tokens in the WebSocket handshake: the header a caller sends, the check a server makes."""

from __future__ import annotations

import hmac


def bearer_ok(headers: list[tuple[bytes, bytes]], token: str | None) -> bool:
    """True if ``token`` is None or the Authorization header carries exactly it.

    The comparison takes the same time whatever the given token, and the
    scheme name is case-insensitive (``bearer``, ``Bearer``).
    """
    if token is None:
        return True
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return hmac.compare_digest(given.strip().encode(), token.encode())
    return False


def bearer_header(token: str | None) -> list[tuple[bytes, bytes]]:
    """The handshake header carrying ``token`` (none for None)."""
    return [] if token is None else [(b"Authorization", f"Bearer {token}".encode())]
