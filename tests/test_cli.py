"""iop-node: check-config, runs list/show/cancel, submit, demo (real files and processes)."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from iop_trio.cli import CliError, StoreLock, main, parse_when
from iop_trio.runtime import RunState, RunStatus, Usage
from iop_trio.store.sqlite import SqliteStore

from .support import read_only
from .test_wire import TOKEN, echo_node, stack

IOP_NODE = [sys.executable, "-m", "iop_trio.cli"]


def write_config(tmp_path: Path, **sections: str) -> Path:
    db = tmp_path / "var" / "node.db"
    text = (
        "node_id: cli-node\n"
        "adapters: {echo: {kind: echo, delay: 0.01}}\n"
        "targets:\n  - {adapter: echo, model: m, concurrency: 2}\n"
        f"store: {{path: {db}}}\n"
        "metrics: {listen: ''}\n"
    )
    for name, body in sections.items():
        text += f"{name}: {body}\n"
    path = tmp_path / "node.yaml"
    path.write_text(text)
    return path


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("iop-node 0.")


def test_check_config_ok_and_bad(tmp_path, capsys):
    path = write_config(tmp_path)
    code, out = run_cli("check-config", "--config", str(path))
    assert code == 0
    assert f"{path}: ok" in out and "target echo/m limit=2" in out
    bad = write_config(tmp_path, runtime="{concurrency: 0}")
    code, _ = run_cli("check-config", "--config", str(bad))
    assert code == 2
    assert f"{bad}: runtime.concurrency: must be an integer >= 1, not 0" in capsys.readouterr().err


def seed_store(db: Path) -> dict[str, str]:
    """A store left by a stopped node: one run done, one still QUEUED, one RUNNING."""

    async def seed() -> None:
        store = SqliteStore(db)
        for run_id, steps in (
            ("done-1", [RunStatus.RUNNING, RunStatus.SUCCEEDED]),
            ("queued-1", []),
            ("running-1", [RunStatus.RUNNING]),
        ):
            state, first = RunState.create(
                run_id=run_id,
                target="echo/m",
                background=True,
                time=1.0,
                prompt="p",
                tenant="acme" if run_id == "done-1" else "",
                priority=7 if run_id == "done-1" else 0,
            )
            await store.create(state.record, first)
            for step in steps:
                # a run that started ran on a replica (credentials are never stored)
                await store.append(state.transition(step, time=2.0, replica="http://gpu1:8000"))
        await store.aclose()

    db.parent.mkdir(parents=True, exist_ok=True)
    trio.run(seed)
    return {"done": "done-1", "queued": "queued-1", "running": "running-1"}


def test_runs_list_show_and_offline_cancel(tmp_path, capsys):
    path = write_config(tmp_path)
    db = tmp_path / "var" / "node.db"
    ids = seed_store(db)

    code, out = run_cli("runs", "list", "--config", str(path))
    assert code == 0
    assert all(run_id in out for run_id in ids.values())
    code, out = run_cli("runs", "list", "--config", str(path), "--status", "succeeded", "--json")
    assert [json.loads(line)["run_id"] for line in out.splitlines()] == ["done-1"]

    code, out = run_cli("runs", "list", "--config", str(path), "--tenant", "acme")
    assert [line.split()[:4] for line in out.splitlines()[1:]] == [
        ["done-1", "echo/m", "acme", "7"]
    ]
    code, out = run_cli("runs", "list", "--config", str(path), "--tenant", "", "--json")
    assert {json.loads(line)["run_id"] for line in out.splitlines()} == {"queued-1", "running-1"}

    code, out = run_cli("runs", "show", "done-1", "--events", "--config", str(path))
    assert code == 0
    assert "status: succeeded" in out and "#3     succeeded" in out
    assert "tenant: acme" in out and "priority: 7" in out
    assert "model: m\n" in out and "prompt: p\n" in out and "ran: 0.00s\n" in out
    assert "  replica: http://gpu1:8000\n" in out
    code, out = run_cli("runs", "show", "queued-1", "--config", str(path))
    assert "replica" not in out  # it never started: it ran nowhere

    code, out = run_cli("runs", "cancel", "queued-1", "--config", str(path), "--reason", "ops")
    assert (code, out.strip()) == (0, "queued-1: cancelled (no node was running)")
    code, out = run_cli("runs", "show", "queued-1", "--json", "--config", str(path))
    shown = json.loads(out)
    assert (shown["status"], shown["reason"]) == ("cancelled", "ops")
    code, out = run_cli("runs", "list", "--config", str(path))
    header, *rows = out.splitlines()
    at = header.index("STATUS")
    assert any(row[at:].startswith("cancelled(ops) ") for row in rows), out  # columns hold
    code, out = run_cli("runs", "cancel", "done-1", "--config", str(path))
    assert (code, out.strip()) == (0, "done-1: already succeeded")

    code, _ = run_cli("runs", "show", "nope", "--config", str(path))
    assert code == 1
    assert "no run 'nope'" in capsys.readouterr().err


def test_the_store_folder_the_cli_makes_is_private(tmp_path):
    from iop_trio.cli import open_store
    from iop_trio.config import load_config

    path = write_config(tmp_path)

    async def make_it() -> None:  # as serve makes it
        store = open_store(load_config(path, environ={}))
        await store.ready()
        await store.aclose()

    trio.run(make_it)
    code, _ = run_cli("runs", "list", "--config", str(path))
    assert code == 0
    folder = tmp_path / "var"
    assert oct(folder.stat().st_mode & 0o777) == oct(0o700)
    assert oct((folder / "node.db").stat().st_mode & 0o777) == oct(0o600)


def test_one_node_per_store(tmp_path):
    db = str(tmp_path / "node.db")
    first = StoreLock(db)
    first.acquire()
    assert StoreLock(db).held_elsewhere()
    second = StoreLock(db)
    with pytest.raises(CliError, match="another node is using this store"):
        second.acquire()
    assert oct(Path(first.path).stat().st_mode & 0o777) == oct(0o600)  # the lock is private
    first.release()
    assert not StoreLock(db).held_elsewhere()


async def cli(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """``iop-node ARGV`` as a real process; output captured, exit code not checked."""
    return await trio.run_process(
        [*IOP_NODE, *argv], capture_stdout=True, capture_stderr=True, check=False
    )


async def test_submit_streams_deltas_through_the_edge(tmp_path):
    async with stack(echo_node(("a", 1))) as s:
        result = await cli(
            "submit",
            "--edge",
            s.edge.url,
            "--token",
            TOKEN,
            "--target",
            "echo/a",
            "hello from the cli",
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.decode() == "hello from the cli\n"
        assert result.stderr.decode().endswith("succeeded\n")

        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        from_file = await cli(
            "submit", "--edge", s.edge.url, "--token-file", str(token_file),
            "--target", "echo/a", "from a file",
        )  # fmt: skip
        assert from_file.returncode == 0, from_file.stderr

        refused = await cli(
            "submit", "--edge", s.edge.url, "--token", "wrong", "--target", "echo/a", "x"
        )
        assert refused.returncode == 1
        assert "401" in refused.stderr.decode()

        unknown = await cli(
            "submit", "--edge", s.edge.url, "--token", TOKEN, "--target", "echo/zz", "x"
        )
        assert unknown.returncode == 1
        assert "no connected node serves 'echo/zz'" in unknown.stderr.decode()
        for result in (refused, unknown):  # one line, no traceback
            assert len(result.stderr.decode().strip().splitlines()) == 1, result.stderr
            assert b"Traceback" not in result.stderr


async def test_submit_failures_before_any_edge_are_one_line(tmp_path):
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = closed.getsockname()[1]
        refused = await cli("submit", "--edge", f"ws://127.0.0.1:{port}", "--target", "t", "x")
    scheme = await cli("submit", "--edge", f"http://127.0.0.1:{port}", "--target", "t", "x")
    assert refused.returncode == 1 and scheme.returncode == 2
    assert refused.stderr.decode().strip() == (
        f"iop-node: cannot reach the edge at ws://127.0.0.1:{port}/client: "
        f"all attempts to connect to 127.0.0.1:{port} failed"
    )
    assert scheme.stderr.decode().strip() == (
        f"iop-node: --edge must be a ws:// or wss:// URL, not 'http://127.0.0.1:{port}'"
    )


async def test_submit_says_when_to_retry_a_rejected_run():
    async with stack(echo_node(("a", 0))) as s:  # a paused target: nothing starts
        result = await cli(
            "submit",
            "--edge",
            s.edge.url,
            "--token",
            TOKEN,
            "--target",
            "echo/a",
            "--queue-timeout",
            "0",
            "--priority",
            "3",
            "not now",
        )
        assert result.returncode == 1
        last = result.stderr.decode().splitlines()[-1]
        assert last.startswith("rejected (queue_timeout: no capacity and queue_timeout is 0)")
        assert re.search(r"; retry after \d+(\.\d+)?s$", last), last
        [record] = await s.node.store.list_runs()
        assert (record.priority, record.tenant, record.status) == (3, "", RunStatus.REJECTED)
        assert record.retry_after is not None and record.retry_after > 0

        bad = await cli(
            "submit", "--edge", s.edge.url, "--token", TOKEN, "--target", "echo/a",
            "--priority", "5000", "x",
        )  # fmt: skip
        assert bad.returncode == 1
        assert "priority must be an integer from -1000 to 1000" in bad.stderr.decode()
        huge = await cli(
            "submit", "--edge", s.edge.url, "--token", TOKEN, "--target", "echo/a",
            "--priority", "99999999999", "x",
        )  # fmt: skip
        assert huge.returncode == 2  # more than the wire carries: one line, no traceback
        assert huge.stderr.decode().splitlines() == [
            "iop-node: priority must be an integer from -1000 to 1000, not 99999999999"
        ]


async def test_demo_once_runs_end_to_end_and_keeps_its_runs(tmp_path):
    var = tmp_path / "var"
    ports = ("--port", "0", "--api-port", "0", "--metrics-port", "0")
    result = await cli("demo", "--once", *ports, "--var", str(var))
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr
    assert "demo run: hello from the iop-trio demo  [succeeded]" in out
    assert "submit --edge ws://127.0.0.1:" in out
    assert re.search(r"OpenAI-compatible +http://127\.0\.0\.1:\d+/v1", out)
    assert re.search(r"metrics +http://127\.0\.0\.1:\d+/metrics", out)
    assert f"runs list --config {var / 'demo.yaml'}" in out
    # the run ended in the log, and is in the store that runs list reads
    assert re.search(r"run \w+ succeeded", result.stderr.decode())
    listed = await cli("runs", "list", "--config", str(var / "demo.yaml"))
    assert listed.returncode == 0, listed.stderr
    assert "echo/chat" in listed.stdout.decode() and "succeeded" in listed.stdout.decode()


def test_hash_token_prints_what_an_identities_file_keeps(monkeypatch):
    from iop_trio.edge.identities import Identities

    monkeypatch.setattr(sys, "stdin", io.StringIO("my-long-random-token\n"))
    code, out = run_cli("hash-token")
    assert code == 0
    found = Identities.from_data({"callers": {"me": {"token_sha256": out.strip()}}})
    caller = found.caller("my-long-random-token")
    assert caller is not None and caller.name == "me"


async def test_the_edge_command_serves_nodes_and_callers_with_identities(tmp_path):
    import signal

    import yaml

    from iop_trio.edge.identities import token_digest
    from iop_trio.runtime import RunSpec
    from iop_trio.transport import NodeLink, open_runner

    from .test_wire import FAST

    identities = tmp_path / "identities.yaml"
    identities.write_text(
        yaml.safe_dump(
            {
                "callers": {"cli": {"token_sha256": token_digest("caller-token")}},
                "nodes": {"n1": {"token_sha256": token_digest("node-token")}},
            }
        )
    )
    with trio.fail_after(30):
        process = await trio.lowlevel.open_process(
            [
                *IOP_NODE,
                "edge",
                "--listen",
                "127.0.0.1:0",
                "--identities",
                str(identities),
                "--openai-listen",
                "127.0.0.1:0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            lines = b""
            while lines.count(b"\n") < 2:
                lines += await process.stdout.receive_some(1)
            url = re.search(r"ws://127\.0\.0\.1:\d+", lines.decode())
            assert url is not None, lines
            api = re.search(r"http://127\.0\.0\.1:\d+/v1", lines.decode())
            assert api is not None, lines
            node = echo_node(("a", 1))
            async with node.running(), trio.open_nursery() as nursery:
                link = NodeLink(node, f"{url.group()}/node", token="node-token", backoff=FAST)
                nursery.start_soon(link.run)
                await link.wait_connected()
                async with (
                    open_runner(f"{url.group()}/client", token="caller-token") as client,
                    client.run(RunSpec("echo/a", "through the edge command")) as stream,
                ):
                    assert (await stream.collect())[0] == "through the edge command"
                assert stream.run_id.startswith("cli:")
                # the same caller, through the OpenAI-compatible API
                async with httpx.AsyncClient(
                    headers={"Authorization": "Bearer caller-token"}
                ) as http:
                    answer = await http.post(
                        f"{api.group()}/chat/completions",
                        json={"model": "echo/a", "messages": [{"role": "user", "content": "hi"}]},
                    )
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"] == "hi"
                assert answer.headers["x-iop-run-id"].startswith("cli:")
                await link.aclose()
        finally:
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0


async def test_the_edge_command_says_what_is_wrong_in_one_line(tmp_path):
    import socket

    missing = await cli("edge", "--listen", "127.0.0.1:0")
    assert missing.returncode == 2
    assert b"needs who may use it" in missing.stderr and b"Traceback" not in missing.stderr
    token = tmp_path / "token"
    token.write_text("t0k")
    token.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = await cli("edge", "--listen", f"127.0.0.1:{port}", "--token-file", str(token))
        busy_api = await cli(
            "edge",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(token),
            "--openai-listen",
            f"127.0.0.1:{port}",
        )
    assert busy.returncode == 1
    lines = busy.stderr.decode().strip().splitlines()
    assert lines[-1].startswith(f"iop-node: cannot listen on 127.0.0.1:{port}: "), lines
    assert "Traceback" not in busy.stderr.decode()
    assert busy_api.returncode == 1
    assert (
        busy_api.stderr.decode()
        .strip()
        .splitlines()[-1]
        .startswith(f"iop-node: cannot listen on 127.0.0.1:{port}: ")
    )
    assert "Traceback" not in busy_api.stderr.decode()
    token.chmod(0o644)
    loose = await cli("edge", "--listen", "127.0.0.1:0", "--token-file", str(token))
    assert loose.returncode == 2 and b"chmod 600" in loose.stderr


async def test_submit_background_prints_the_run_id_at_once():
    async with stack(echo_node(("a", 1), delay=30)) as s:  # a run that takes a while
        with trio.fail_after(20):
            result = await cli(
                "submit", "--edge", s.edge.url, "--token", TOKEN, "--target", "echo/a",
                "--background", "slow words here",
            )  # fmt: skip
        assert result.returncode == 0, result.stderr
        run_id = result.stdout.decode().strip()
        record = await s.node.store.get(run_id)
        assert record is not None and record.background and not record.status.terminal


async def test_serve_with_its_metrics_port_taken_says_so_in_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write_config(tmp_path, metrics=f"{{listen: '127.0.0.1:{port}'}}")
        text = path.read_text().replace("metrics: {listen: ''}\n", "")
        path.write_text(text)
        result = await cli("serve", "--config", str(path))
    stderr = result.stderr.decode()
    assert result.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        f"iop-node: cannot listen on 127.0.0.1:{port} (metrics.listen): Address already in use"
    )
    assert "Traceback" not in stderr


def test_check_config_warns_of_settings_that_are_legal_but_suspicious(tmp_path):
    path = write_config(tmp_path, edge="{url: 'ws://10.0.0.5:8765/node', token: t}")
    text = path.read_text().replace("concurrency: 2}", "concurrency: 0}")
    path.write_text(text)
    code, out = run_cli("check-config", "--config", str(path))
    assert code == 0
    assert "warning: target echo/m has concurrency 0" in out
    assert "warning: edge.url ws://10.0.0.5:8765/node is not TLS and not on loopback" in out


def test_debug_adds_the_traceback_to_the_one_line(tmp_path, capsys):
    missing = str(tmp_path / "nope.yaml")
    assert main(["runs", "list", "--config", missing]) == 2
    quiet = capsys.readouterr().err
    assert quiet.startswith("iop-node: ") and "Traceback" not in quiet
    assert main(["--debug", "runs", "list", "--config", missing]) == 2
    loud = capsys.readouterr().err
    assert "Traceback" in loud and loud.strip().endswith(quiet.strip())


async def test_check_config_probe_reaches_each_engine_and_the_edge(tmp_path):
    from .engines import JSON, Reply, refused_port, serve

    served = b'{"object": "list", "data": [{"id": "qwen"}]}'
    async with serve() as engine, stack(echo_node(("a", 1))) as s:
        engine.handler = lambda exchange: Reply(
            content_type=JSON, parts=[served], content_length=True
        )
        token = tmp_path / "edge.token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        with refused_port() as dead:
            adapters = (
                f"{{vllm: {{kind: openai, base_url: '{engine.url}'}}, "
                f"gone: {{kind: openai, base_url: 'http://127.0.0.1:{dead}'}}}}"
            )
            targets = (
                "[{adapter: vllm, model: qwen}, {adapter: vllm, model: llama}, "
                "{adapter: gone, model: qwen}]"
            )
            config = write_config(
                tmp_path,
                edge=f"{{url: '{s.edge.node_url}', token_file: {token}}}",
            )
            text = config.read_text().replace(
                "adapters: {echo: {kind: echo, delay: 0.01}}\n", f"adapters: {adapters}\n"
            )
            text = text.replace(
                "targets:\n  - {adapter: echo, model: m, concurrency: 2}\n",
                f"targets: {targets}\n",
            )
            config.write_text(text)
            result = await cli("check-config", "--config", str(config), "--probe")
        out = result.stdout.decode()
        assert result.returncode == 1, (out, result.stderr)
        assert "probe target vllm/qwen: serves 'qwen'" in out
        assert "probe target vllm/llama: UNAVAILABLE: the engine does not serve model" in out
        assert "probe target gone/qwen: UNAVAILABLE: engine unreachable:" in out
        assert f"probe edge {s.edge.node_url}: reachable, the token is accepted" in out
        # a wrong token is one line too
        token.write_text("wrong")
        config.write_text(text.replace("{adapter: gone, model: qwen}", "").replace(", ]", "]"))
        result = await cli("check-config", "--config", str(config), "--probe")
        out = result.stdout.decode()
        assert result.returncode == 1
        assert "probe edge: UNREACHABLE: the edge refused the connection: HTTP 401" in out
        assert "Traceback" not in result.stderr.decode()


def test_every_flag_and_argument_has_help_text():
    import argparse

    from iop_trio.cli.commands import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path}: {action.dest}")

    walk(build_parser(), "iop-node")
    assert missing == []


def test_runs_commands_on_a_store_that_is_not_there_say_so(tmp_path, capsys):
    config = write_config(tmp_path)  # its store, var/node.db, was never made
    for argv in (["runs", "list"], ["runs", "show", "r1"], ["runs", "cancel", "r1"]):
        code, out = run_cli(*argv, "--config", str(config))
        err = capsys.readouterr().err
        assert code == 1 and out == ""
        assert err == (
            f"iop-node: no run store at {tmp_path / 'var' / 'node.db'}: no node has run "
            f"with this config yet (store.path in {config})\n"
        )
    assert not (tmp_path / "var").exists()  # nothing was made on the spot


FORGED = "ops\n2099-01-01 00:00:00  forged-run  echo/m  cancelled\x1b]0;pwned\x07\x1b[31m"


def test_what_a_caller_set_is_escaped_in_every_table_and_line(tmp_path):
    path = write_config(tmp_path)
    db = tmp_path / "var" / "node.db"
    seed_store(db)
    code, _ = run_cli("runs", "cancel", "queued-1", "--config", str(path), "--reason", FORGED)
    assert code == 0
    for argv in (("runs", "list"), ("runs", "show", "queued-1", "--events")):
        code, out = run_cli(*argv, "--config", str(path))
        assert code == 0
        assert "\x1b" not in out and "\x07" not in out  # no escape reaches the terminal
        assert not any(line.startswith("2099") for line in out.splitlines())  # no forged row
        assert "\\x0a2099-01-01" in out  # the reason, shown escaped


def test_json_lines_and_a_reader_that_goes_away(tmp_path):
    path = write_config(tmp_path)
    db = tmp_path / "var" / "node.db"

    async def seed() -> None:  # 300 runs of 2 KB each: more than a pipe holds
        store = SqliteStore(db)
        for i in range(300):
            state, first = RunState.create(
                run_id=f"r{i}", target="echo/m", background=True, time=1.0, prompt="p" * 2000
            )
            await store.create(state.record, first)
        await store.aclose()

    db.parent.mkdir(parents=True, exist_ok=True)
    trio.run(seed)
    listed = subprocess.run(
        [*IOP_NODE, "runs", "list", "--json", "--limit", "5", "--config", str(path)],
        capture_output=True,
        check=False,
    )
    lines = listed.stdout.decode().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["target"] == "echo/m" for line in lines)
    # `| head -c 10`: the pipe closes at once; the command ends quietly, exit 0
    command = " ".join(IOP_NODE) + f" runs list --json --limit 300 --config {path}"
    piped = subprocess.run(
        f"set -o pipefail; {command} | head -c 10 >/dev/null",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        check=False,
    )
    assert (piped.returncode, piped.stderr) == (0, b""), piped.stderr.decode()


def test_check_config_holds_the_edge_key_file_to_serves_rule_and_hides_its_password(
    tmp_path, capsys
):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("edge.example")
    key = tmp_path / "node-key.pem"
    cert.private_key_pem.write_to_path(str(key))
    key.chmod(0o644)
    chain = tmp_path / "node-cert.pem"
    cert.cert_chain_pems[0].write_to_path(str(chain))
    edge = f"{{url: 'wss://user:PASS@edge.example/node', cert_file: {chain}, key_file: {key}}}"
    path = write_config(tmp_path, edge=edge)
    code, _ = run_cli("check-config", "--config", str(path))
    err = capsys.readouterr().err
    assert code == 2 and "may be read by others" in err and "chmod 600" in err
    key.chmod(0o600)
    code, out = run_cli("check-config", "--config", str(path))
    assert code == 0
    assert "PASS" not in out and "wss://***@edge.example/node" in out


def test_an_unknown_iop_variable_is_a_warning_once_not_a_refusal(tmp_path, monkeypatch, capsys):
    path = write_config(tmp_path)
    monkeypatch.setenv("IOP_PY", "/usr/bin/python3")
    monkeypatch.setenv("IOP_EDGE_TOKEN", "the edge's own")
    code, out = run_cli("check-config", "--config", str(path))
    err = capsys.readouterr().err
    assert code == 0 and f"{path}: ok" in out
    assert err.count("warning") == 1 and "IOP_PY names no configuration key" in err


async def test_runs_cancel_works_on_the_running_demo(tmp_path):
    import signal

    var = tmp_path / "var"
    ports = ("--port", "0", "--api-port", "0", "--metrics-port", "0")
    demo = await trio.lowlevel.open_process(
        [*IOP_NODE, "demo", *ports, "--var", str(var)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(60):
            assert demo.stdout is not None
            said = b""
            while b"Ctrl-C stops" not in said:
                said += await demo.stdout.receive_some()
            edge = re.search(rb"submit --edge (ws://127\.0\.0\.1:\d+)", said)
            assert edge is not None
            words = " ".join(["slowly"] * 200)  # echo/chat: 80 ms a word
            submitted = await cli(
                "submit", "--edge", edge.group(1).decode(), "--token-file",
                str(var / "demo.token"), "--target", "echo/chat", "--background", words,
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr
            run_id = submitted.stdout.decode().strip()
            cancelled = await cli("runs", "cancel", run_id, "--config", str(var / "demo.yaml"))
            assert cancelled.returncode == 0, cancelled.stderr
            assert cancelled.stdout.decode().strip() == f"{run_id}: cancelled"
            demo.send_signal(signal.SIGINT)
            assert await demo.wait() == 0
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()
    assert oct((var / "demo.ops-token").stat().st_mode & 0o777) == oct(0o600)


@contextlib.asynccontextmanager
async def serving_node(config: Path) -> AsyncIterator[trio.Process]:
    """``iop-node serve`` of ``config`` as a real process, once it says it serves; stopped
    (SIGTERM) at the end."""
    process = await trio.lowlevel.open_process(
        [*IOP_NODE, "serve", "--config", str(config)], stderr=subprocess.PIPE
    )
    try:
        assert process.stderr is not None
        said = b""
        with trio.fail_after(30):
            while b" serving " not in said:
                chunk = await process.stderr.receive_some()
                assert chunk, f"the node ended: {said.decode()}"
                said += chunk
        yield process
    finally:
        process.terminate()
        with trio.CancelScope(shield=True), trio.fail_after(30):
            await process.wait()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_runs_commands_on_a_store_gone_from_under_its_node_say_so(tmp_path, how):
    """With the file a running node has open deleted, or another put in its place (as
    an old reader once made an empty one), ``runs list`` and ``runs show`` say so in one
    line and fail, rather than read nothing or another store."""
    config = write_config(tmp_path)
    db = tmp_path / "var" / "node.db"
    async with serving_node(config) as node:
        db.unlink()
        db.with_name("node.db-wal").unlink(missing_ok=True)
        if how == "replaced":
            db.touch(mode=0o600)
        for argv in (["runs", "list"], ["runs", "show", "r1"]):
            result = await cli(*argv, "--config", str(config))
            assert (result.returncode, result.stdout) == (1, b"")
            assert result.stderr.decode() == (
                f"iop-node: the run store {db} was {how} under the node that runs on it "
                f"(pid {node.pid}): that node refuses new runs, and an ERROR line in its log "
                "names the copy it made of its runs (docs/operations.md, 'When the store "
                "file is deleted')\n"
            )
    assert db.exists() is (how == "replaced")
    if how == "replaced":
        assert db.stat().st_size == 0  # nothing was made in it


@pytest.mark.parametrize("what", ["folder", "file"])
async def test_serve_on_a_store_it_may_not_write_says_so_in_one_line(tmp_path, what):
    config = write_config(tmp_path)
    folder = tmp_path / "var"
    db = folder / "node.db"
    await trio.to_thread.run_sync(seed_store, db)  # a store a node kept before
    with read_only(folder if what == "folder" else db):
        result = await cli("serve", "--config", str(config))
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr
    fix = (
        "make it writable for this user, or point store.path"
        if what == "folder"
        else "make it writable for this user (chmod u+w), or point store.path"
    )
    assert (result.returncode, stderr.splitlines()[-1]) == (
        2,
        f"iop-node: the node may not write the run store's {what} "
        f"{folder if what == 'folder' else db}: {fix} (in {config}) at one it may",
    ), stderr


# --- usage ------------------------------------------------------------------------------------

T0 = datetime.datetime(2025, 3, 14, 10, 0).timestamp()  # local time, as the CLI reads one


def seed_usage(db: Path) -> None:
    """Runs that ended at 10:00, 11:00 and 12:00 on 2025-03-14 (local time), with their
    usage; one rejected (never started, no usage); one still RUNNING."""

    async def seed() -> None:
        store = SqliteStore(db)
        guessed = Usage("", 3, 2, prompt_estimated=True, completion_estimated=True)
        for run_id, tenant, target, hour, usage in (
            ("a1", "acme", "echo/m", 0, Usage("stop", 10, 5)),
            ("a2", "acme", "echo/x", 1, guessed),
            ("d1", "", "echo/m", 2, Usage("stop", 7, 1, prompt_estimated=True)),
            ("evil", "t\x1b[31m", "echo/\nforged 1 2 3 4", 2, Usage("stop", 1, 1)),
        ):
            state, first = RunState.create(
                run_id=run_id, target=target, background=True, time=T0 - 60, tenant=tenant
            )
            await store.create(state.record, first)
            await store.append(state.transition(RunStatus.RUNNING, time=T0 - 30))
            end = state.transition(RunStatus.CANCELLED, time=T0 + hour * 3600, usage=usage)
            await store.append(end)
        for run_id in ("rejected", "running"):
            state, first = RunState.create(run_id=run_id, target="echo/m", background=True, time=T0)
            await store.create(state.record, first)
        await store.append(state.transition(RunStatus.RUNNING, time=T0))
        await store.append(state.delta("one two", time=T0, tokens=2))
        await store.aclose()

    db.parent.mkdir(parents=True, exist_ok=True)
    trio.run(seed)


def test_usage_totals_the_records_by_tenant_or_target_in_a_window(tmp_path):
    path = write_config(tmp_path)
    seed_usage(tmp_path / "var" / "node.db")
    code, out = run_cli("usage", "--config", str(path))
    assert code == 0
    assert out.splitlines() == [
        "TENANT     RUNS  PROMPT  COMPLETION  ESTIMATED",
        "(default)     1       7           1          7",
        "acme          2      13           7          5",
        "t\\x1b[31m     1       1           1          0",  # escaped: no colour, no row
    ]
    code, out = run_cli("usage", "--config", str(path), "--by", "target", "--json")
    assert [json.loads(line) for line in out.splitlines()] == [
        {"target": "echo/\nforged 1 2 3 4", "runs": 1, "prompt_tokens": 1,
         "completion_tokens": 1, "estimated_prompt_tokens": 0, "estimated_completion_tokens": 0},
        {"target": "echo/m", "runs": 2, "prompt_tokens": 17, "completion_tokens": 6,
         "estimated_prompt_tokens": 7, "estimated_completion_tokens": 0},
        {"target": "echo/x", "runs": 1, "prompt_tokens": 3, "completion_tokens": 2,
         "estimated_prompt_tokens": 3, "estimated_completion_tokens": 2},
    ]  # fmt: skip
    code, out = run_cli("usage", "--config", str(path), "--by", "target")
    assert "echo/\\x0aforged 1 2 3 4" in out and len(out.splitlines()) == 4
    # from 11:00 (in) until 12:00 (out), local time; a zone given is that zone's
    window = ["--since", "2025-03-14T11:00", "--until", "2025-03-14 12:00:00", "--json"]
    code, out = run_cli("usage", "--config", str(path), *window)
    assert [json.loads(line)["tenant"] for line in out.splitlines()] == ["acme"]
    utc = datetime.datetime.fromtimestamp(T0 + 7200, datetime.UTC).isoformat()
    code, out = run_cli("usage", "--config", str(path), "--since", utc, "--json")
    assert [json.loads(line)["tenant"] for line in out.splitlines()] == ["", "t\x1b[31m"]
    code, out = run_cli("usage", "--config", str(path), "--since", "2025-03-15", "--json")
    assert (code, out) == (0, "")
    code, out = run_cli("usage", "--config", str(path), "--since", "24h")  # years ago
    assert (code, out.splitlines()) == (0, ["TENANT  RUNS  PROMPT  COMPLETION  ESTIMATED"])


def test_when_is_a_date_and_time_or_a_time_ago():
    now = 1_000_000.0
    assert parse_when("90m", now=now, flag="--since") == now - 5400
    assert parse_when("24h", now=now, flag="--since") == now - 86400
    assert parse_when("7d", now=now, flag="--since") == now - 7 * 86400
    assert parse_when("1.5w", now=now, flag="--since") == now - 1.5 * 7 * 86400
    assert parse_when("2025-03-14T10:00", now=now, flag="--since") == T0
    assert parse_when("2025-03-14T09:00:00Z", now=now, flag="--since") == 1741942800.0
    with pytest.raises(CliError, match=r"--until 'yesterday' is neither a date and time"):
        parse_when("yesterday", now=now, flag="--until")


def test_usage_failures_are_one_line(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path)
    for argv, code, said in (
        (["--since", "soon"], 2, "--since 'soon' is neither a date and time (2025-03-14, "),
        (["--since=-3d"], 2, "--since '-3d' is neither"),
        (["--since", "1h", "--until", "2h"], 2, "--until '2h' is before --since '1h'"),
        ([], 1, f"no run store at {tmp_path / 'var' / 'node.db'}: no node has run"),
    ):
        assert run_cli("usage", "--config", str(path), *argv) == (code, "")
        err = capsys.readouterr().err
        assert err.startswith(f"iop-node: {said}") and err.count("\n") == 1, err
    monkeypatch.setenv("IOP_STORE__KIND", "memory")
    assert run_cli("usage", "--config", str(path)) == (1, "")
    assert "store.kind is memory, so the node keeps no runs" in capsys.readouterr().err


def test_runs_show_says_what_is_estimated_and_an_offline_cancel_settles_a_running_run(tmp_path):
    path = write_config(tmp_path)
    seed_usage(tmp_path / "var" / "node.db")
    code, out = run_cli("runs", "show", "d1", "--config", str(path))
    assert "    usage: stop in=7 out=1 (estimated: in)\n" in out
    code, out = run_cli("runs", "cancel", "running", "--config", str(path))
    assert (code, out) == (0, "running: cancelled (no node was running)\n")
    code, out = run_cli("runs", "show", "running", "--json", "--events", "--config", str(path))
    shown = json.loads(out)
    assert shown["usage"] == {  # its prompt is "", its stored delta held 2
        "done_reason": "",
        "prompt_tokens": 0,
        "completion_tokens": 2,
        "prompt_estimated": True,
        "completion_estimated": True,
    }
    assert [e.get("tokens") for e in shown["events"]] == [None, None, 2, None]
    assert shown["events"][-1]["usage"] == shown["usage"]


async def test_check_config_says_which_signal_each_auto_pool_learns_from(tmp_path):
    from .engines import JSON, Reply, refused_port, serve

    listed = b'{"object": "list", "data": [{"id": "qwen"}]}'
    metrics = (
        b"# TYPE vllm:num_requests_waiting gauge\n"
        b'vllm:num_requests_waiting{model_name="qwen"} 3\n'
        b"# TYPE vllm:kv_cache_usage_perc gauge\n"
        b'vllm:kv_cache_usage_perc{model_name="qwen"} 0.5\n'
    )

    def vllm(exchange):
        body = metrics if exchange.path.endswith("/metrics") else listed
        return Reply(content_type=JSON, parts=[body], content_length=True)

    def bare(exchange):
        if exchange.path.endswith("/metrics"):
            return Reply(404, parts=[b"{}"], content_length=True)
        return Reply(content_type=JSON, parts=[listed], content_length=True)

    async with serve() as with_metrics, serve() as without:
        with_metrics.handler, without.handler = vllm, bare
        with refused_port() as dead:
            adapters = (
                f"{{vllm: {{kind: openai, base_url: '{with_metrics.url}', concurrency: auto}}, "
                f"cpp: {{kind: openai, base_url: '{without.url}'}}, "
                f"gone: {{kind: openai, base_url: 'http://127.0.0.1:{dead}'}}, "
                "echo: {kind: echo}}"
            )
            targets = (
                "[{adapter: vllm, model: qwen}, "
                "{adapter: cpp, model: qwen, concurrency: auto, concurrency_max: 12}, "
                "{adapter: gone, model: qwen, concurrency: auto}, "
                "{adapter: echo, model: m, concurrency: auto, concurrency_min: 2}]"
            )
            config = write_config(tmp_path)
            text = config.read_text().replace(
                "adapters: {echo: {kind: echo, delay: 0.01}}\n", f"adapters: {adapters}\n"
            )
            text = text.replace(
                "targets:\n  - {adapter: echo, model: m, concurrency: 2}\n",
                f"targets: {targets}\n",
            )
            config.write_text(text)
            plain = await cli("check-config", "--config", str(config))
            probed = await cli("check-config", "--config", str(config), "--probe")
    out = plain.stdout.decode()
    assert plain.returncode == 0, (out, plain.stderr)
    root = with_metrics.url.removesuffix("/v1").rstrip("/")
    assert (
        f"adapter vllm (openai) limit=auto 1..64 "
        f"(signal: engine metrics at {root}/metrics, else latency)"
    ) in out
    assert "target echo/m limit=auto 2..64 (signal: latency)" in out
    assert "target cpp/qwen limit=auto 1..12 (signal: engine metrics at" in out
    out = probed.stdout.decode()
    assert "probe adapter vllm learns from engine (3 waiting, KV cache 50% used)" in out
    assert "probe target cpp/qwen learns from latency (the engine exposes no signals" in out
    assert "probe target gone/qwen learns from engine (its metrics cannot be read now:" in out
    assert "counted as saturated until they can)" in out
    assert "probe target echo/m learns from latency" in out
    assert "Traceback" not in probed.stderr.decode()
