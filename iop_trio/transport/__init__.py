"""The Trio shell around the protocol: sessions, server, node client, runner client."""

from .client import Backoff, NodeClient
from .runner_client import RunnerClient, RunStream, open_runner
from .server import serve_proto
from .session import ProtoSession, RemoteError, SessionClosed, SessionSettings

__all__ = [
    "Backoff",
    "NodeClient",
    "ProtoSession",
    "RemoteError",
    "RunStream",
    "RunnerClient",
    "SessionClosed",
    "SessionSettings",
    "open_runner",
    "serve_proto",
]
