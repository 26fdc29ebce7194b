"""The proto-socket protocol, sans I/O: envelopes, nonces, correlation, conversions."""

from .._gen.iop import runtime_pb2 as pb
from .connection import (
    ANSWERS,
    Incoming,
    PeerError,
    ProtocolError,
    ProtoConnection,
    Reply,
    Request,
    Role,
    StaleReply,
    decode,
    encode,
)

__all__ = [
    "ANSWERS",
    "Incoming",
    "PeerError",
    "ProtoConnection",
    "ProtocolError",
    "Reply",
    "Request",
    "Role",
    "StaleReply",
    "decode",
    "encode",
    "pb",
]
