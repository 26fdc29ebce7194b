"""The proto-socket protocol, sans I/O: envelopes, nonces, correlation, conversions."""

from .._gen.iop import runtime_pb2 as pb
from .connection import (
    ANSWERS,
    BATCH_SUBPROTOCOL,
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
    pack_batch,
    take_sendable,
)

__all__ = [
    "ANSWERS",
    "BATCH_SUBPROTOCOL",
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
    "pack_batch",
    "pb",
    "take_sendable",
]
