"""TLS on both ends (issue 10, finding 7), with certificates made at test time (trustme).

Real wss:// on loopback: the edge serves its certificate, optionally asks every client
for one; the node trusts a CA from a file, presents its own certificate, and checks the
edge's against a server name of its choosing. An untrusted certificate is reported in
one line, at once, not as a timeout.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
import trustme

from iop_trio.edge import Edge
from iop_trio.edge.front_door import serve_door
from iop_trio.runtime import RunSpec
from iop_trio.transport import NodeLink, open_runner
from iop_trio.transport.tls import TLSFailed, client_context, server_context

from .test_wire import FAST, TOKEN, echo_node

WAIT = 20


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    """Files: a CA, the edge's certificate (127.0.0.1 and edge.example), a client's,
    and a second CA that signed nothing of ours."""
    ca = trustme.CA()
    other = trustme.CA()
    edge = ca.issue_cert("127.0.0.1", "edge.example")
    client = ca.issue_cert("node-1.example")
    files = {
        "ca": tmp_path / "ca.pem",
        "other_ca": tmp_path / "other-ca.pem",
        "edge": tmp_path / "edge.pem",
        "client": tmp_path / "client.pem",
        "named_only": tmp_path / "named.pem",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    other.cert_pem.write_to_path(str(files["other_ca"]))
    edge.private_key_and_cert_chain_pem.write_to_path(str(files["edge"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    ca.issue_cert("edge.example").private_key_and_cert_chain_pem.write_to_path(
        str(files["named_only"])
    )
    return {name: str(path) for name, path in files.items()}


async def link_once(edge: Edge, context, connect_timeout: float = 10.0) -> NodeLink:  # type: ignore[no-untyped-def]
    """Dial the edge once with ``context``; returns the link after its first attempt
    ended (or after it is up)."""
    node = echo_node(("a", 1))
    async with node.running():
        link = NodeLink(
            node,
            edge.node_url,
            token=TOKEN,
            backoff=FAST,
            ssl_context=context,
            connect_timeout=connect_timeout,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            with trio.fail_after(5):  # a certificate failure is said at once, not at 10 s
                while not link.sessions and not link.ended_attempts:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    return link


@asynccontextmanager
async def tls_edge(context: ssl.SSLContext) -> AsyncIterator[Edge]:
    """An edge serving wss:// with ``context``, for the body of a ``with``."""
    edge = Edge(token=TOKEN, ssl_context=context)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(edge.serve)
            yield edge
            nursery.cancel_scope.cancel()


async def test_the_node_reaches_a_wss_edge_with_a_ca_from_a_file(pki):
    trusting = client_context(ca_file=pki["ca"])
    async with tls_edge(server_context(cert_file=pki["edge"])) as edge:
        assert edge.url.startswith("wss://")
        node = echo_node(("a", 1))
        async with node.running(), trio.open_nursery() as nursery:
            link = NodeLink(node, edge.node_url, token=TOKEN, backoff=FAST, ssl_context=trusting)
            nursery.start_soon(link.run)
            await edge.wait_for_node("n1")
            async with (
                open_runner(edge.client_url, token=TOKEN, ssl_context=trusting) as client,
                client.run(RunSpec("echo/a", "over tls")) as stream,
            ):
                assert (await stream.collect())[0] == "over tls"
            await link.aclose()


async def test_an_untrusted_certificate_is_one_clear_line_at_once(pki):
    distrusting = client_context(ca_file=pki["other_ca"])
    async with tls_edge(server_context(cert_file=pki["edge"])) as edge:
        link = await link_once(edge, distrusting)
        assert link.sessions == 0
        assert link.last_error.startswith("certificate verify failed: ")
        with pytest.raises(TLSFailed, match="certificate verify failed"):
            async with open_runner(edge.client_url, token=TOKEN, ssl_context=distrusting):
                pass


async def test_the_server_name_checked_can_differ_from_the_host_dialled(pki):
    async with tls_edge(server_context(cert_file=pki["named_only"])) as edge:
        wrong = await link_once(edge, client_context(ca_file=pki["ca"]))
        assert "certificate verify failed" in wrong.last_error  # 127.0.0.1 is not in it
        right = await link_once(edge, client_context(ca_file=pki["ca"], server_name="edge.example"))
        assert right.sessions == 1


async def test_the_edge_can_require_client_certificates(pki):
    context = server_context(cert_file=pki["edge"], client_ca_file=pki["ca"])
    async with tls_edge(context) as edge:
        # refused after the client's side of the handshake; trio-websocket's server
        # leaves such a connection open, so the client learns it at its timeout
        anonymous = await link_once(edge, client_context(ca_file=pki["ca"]), 1.0)
        assert anonymous.sessions == 0 and anonymous.last_error
        known = await link_once(edge, client_context(ca_file=pki["ca"], cert_file=pki["client"]))
        assert known.sessions == 1


def test_the_nodes_tls_settings_come_from_its_config(pki, tmp_path):
    import copy
    import os

    from iop_trio.config import ConfigError

    from .test_config import check, example

    data = copy.deepcopy(example())
    os.chmod(pki["client"], 0o600)
    data["edge"] = {
        "url": "wss://127.0.0.1:1/node",
        "token": "t",
        "ca_file": pki["ca"],
        "cert_file": pki["client"],
        "server_name": "edge.example",
    }
    assert check(data).edge_ssl_context() is not None
    os.chmod(pki["client"], 0o644)  # a private key others may read
    with pytest.raises(ConfigError, match=r"edge.cert_file: .* may be read by others"):
        check(data).edge_ssl_context()
    data["edge"]["cert_file"] = str(tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match=r"edge.cert_file: .*No such file"):
        check(data).edge_ssl_context()
    data["edge"] = {"url": "ws://127.0.0.1:1/node", "token": "t"}
    assert check(data).edge_ssl_context() is None


async def test_the_door_asks_for_client_certificates_as_the_websocket_port_does(pki):
    context = server_context(cert_file=pki["edge"], client_ca_file=pki["ca"])
    edge = Edge(token=TOKEN, ssl_context=context)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_door, edge, "127.0.0.1", 0)
            url = f"https://127.0.0.1:{port}/v1/models"
            anonymous = client_context(ca_file=pki["ca"])
            async with httpx.AsyncClient(verify=anonymous) as http:
                with pytest.raises(httpx.TransportError):
                    await http.get(url, headers=headers)
            known = client_context(ca_file=pki["ca"], cert_file=pki["client"])
            async with httpx.AsyncClient(verify=known) as http:
                response = await http.get(url, headers=headers)
            assert response.status_code == 200
            assert response.json() == {"object": "list", "data": []}
            nursery.cancel_scope.cancel()


async def test_a_refused_client_certificate_is_said_at_once(pki):
    context = server_context(cert_file=pki["edge"], client_ca_file=pki["ca"])
    async with tls_edge(context) as edge:
        start = trio.current_time()
        anonymous = await link_once(edge, client_context(ca_file=pki["ca"]), 10.0)
        assert anonymous.sessions == 0
        assert trio.current_time() - start < 5  # not the connect timeout
        with pytest.raises(TLSFailed):
            async with open_runner(
                edge.client_url, token=TOKEN, ssl_context=client_context(ca_file=pki["ca"])
            ):
                pass
