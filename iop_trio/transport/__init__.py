"""The Trio shell around the protocol.

- :mod:`.session`: one proto-socket over one WebSocket (reader, writer, heartbeat, handlers);
- :mod:`.replies`: the replies to one request of ours, as the caller reads them;
- :mod:`.ws_send`: several WebSocket messages in one send;
- :mod:`.server`: a WebSocket server routing paths to session handlers, with bearer auth;
- :mod:`.auth`: the bearer-token header and its check;
- :mod:`.node_link`: the node's link to the edge (dial, Hello, serve, reconnect);
- :mod:`.run_service`: the node's answers to run requests;
- :mod:`.caller`: the calling side of run requests (the edge on a node, a CLI on an edge).
"""

from .caller import RunnerClient, RunStream, open_runner
from .node_link import Backoff, NodeLink
from .run_service import RunService
from .server import serve_proto
from .session import ProtoSession, RemoteError, ReplyTimeout, SessionClosed, SessionSettings

__all__ = [
    "Backoff",
    "NodeLink",
    "ProtoSession",
    "RemoteError",
    "ReplyTimeout",
    "RunService",
    "RunStream",
    "RunnerClient",
    "SessionClosed",
    "SessionSettings",
    "open_runner",
    "serve_proto",
]
