"""Bearer tokens in the WebSocket handshake: the header a caller sends, the check a server makes."""

from __future__ import annotations


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of the handshake's ``Authorization: Bearer`` header, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return given.strip()
    return None


def bearer_header(token: str | None) -> list[tuple[bytes, bytes]]:
    """The handshake header carrying ``token`` (none for None)."""
    return [] if token is None else [(b"Authorization", f"Bearer {token}".encode())]
