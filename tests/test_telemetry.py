"""Tracing's setup (iop_trio.telemetry): which settings win, each bad value's one line,
the provider installed (spans on stdout, to a real OTLP/HTTP receiver, or nothing at
all), and real `iop-node serve` / `iop-node edge` processes that flush on SIGTERM."""

from __future__ import annotations

import io
import json
import logging
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry import trace

from iop_trio import telemetry
from iop_trio.cli import main
from iop_trio.config import ConfigError, TracingConfig, load_config
from iop_trio.telemetry import TracingSettings, install, resolve, traces_url

NODE_YAML = """\
node_id: traced-node
adapters: {echo: {kind: echo}}
targets: [{adapter: echo, model: chat}]
store: {kind: memory}
metrics: {listen: ""}
"""


@pytest.fixture(autouse=True)
def _root_logging_kept() -> Iterator[None]:
    """The root logger as it was: main() sets up logging for serve and edge."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def write_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(NODE_YAML + extra)
    return path


def spans_in(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter wrote: JSON objects one after another."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) != -1:
        span, at = decoder.raw_decode(text, at)
        spans.append(span)
    return spans


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter (the global provider is set once a process)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


# --- resolution -----------------------------------------------------------------------


def test_nothing_said_is_off():
    settings = resolve(TracingConfig(), {})
    assert settings == TracingSettings() and not settings.enabled
    assert settings.describe() == "off" and repr(settings) == "<TracingSettings off>"


def test_the_standard_variables_say_it_when_the_config_does_not():
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_SERVICE_NAME": "gpu-box",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    assert resolve(TracingConfig(), env) == TracingSettings(
        exporter="otlp",
        endpoint="http://collector:4318/v1/traces",
        service_name="gpu-box",
        sampler="traceidratio",
        sampler_arg=0.25,
    )
    # the traces endpoint is a whole URL, and wins over the base one
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "https://traces.example/custom"
    assert resolve(TracingConfig(), env).endpoint == "https://traces.example/custom"


def test_the_config_or_the_flags_win_key_by_key_over_the_variables():
    env = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318",
        "OTEL_SERVICE_NAME": "from-env",
        "OTEL_TRACES_SAMPLER": "always_off",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    given = TracingConfig(exporter="otlp", endpoint="http://yaml:4318/", sampler_arg=0.1)
    assert resolve(given, env) == TracingSettings(
        exporter="otlp",
        endpoint="http://yaml:4318/v1/traces",
        service_name="from-env",
        sampler="always_off",
        sampler_arg=0.1,
    )
    # an explicit none turns tracing off whatever the variables say
    assert not resolve(TracingConfig(exporter="none"), env).enabled


def test_defaults_name_the_process_and_sample_as_opentelemetry_does():
    settings = resolve(
        TracingConfig(), {"OTEL_TRACES_EXPORTER": "Console"}, service_name="iop-edge"
    )
    assert settings == TracingSettings(
        exporter="console", service_name="iop-edge", sampler="parentbased_always_on"
    )
    assert settings.describe() == "console, sampler parentbased_always_on, service iop-edge"
    otlp = resolve(TracingConfig(exporter="otlp", sampler="parentbased_traceidratio"), {})
    assert otlp.endpoint == "http://localhost:4318/v1/traces" and otlp.sampler_arg == 1.0
    assert otlp.describe() == (
        "otlp to http://localhost:4318/v1/traces, sampler parentbased_traceidratio 1, "
        "service iop-node"
    )


def test_a_traces_url_is_given_either_as_a_base_or_whole():
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/otel/") == "http://c:4318/otel/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_with_tracing_off_the_other_variables_are_not_read():
    env = {"OTEL_TRACES_SAMPLER": "bogus", "OTEL_TRACES_SAMPLER_ARG": "lots"}
    assert not resolve(TracingConfig(), env).enabled


# --- bad values: one line each ---------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"OTEL_TRACES_EXPORTER": "jaeger"},
            "OTEL_TRACES_EXPORTER: must be one of 'none', 'console', 'otlp', not 'jaeger'",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp,console"},
            "OTEL_TRACES_EXPORTER: must be one of 'none', 'console', 'otlp', not 'otlp,console'",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "sometimes"},
            "OTEL_TRACES_SAMPLER: must be one of 'always_on', 'always_off', 'traceidratio', "
            "'parentbased_always_on', 'parentbased_always_off', 'parentbased_traceidratio', "
            "not 'sometimes'",
        ),
        (
            {"OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG: must be a ratio from 0 to 1, not 2.0",
        ),
        (
            {"OTEL_TRACES_SAMPLER_ARG": "half"},
            "OTEL_TRACES_SAMPLER_ARG: must be a ratio from 0 to 1, not 'half'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"},
            "OTEL_EXPORTER_OTLP_ENDPOINT: must be an http:// or https:// URL, not 'collector:4318'",
        ),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(env, line):
    with pytest.raises(ConfigError) as raised:
        resolve(TracingConfig(), {"OTEL_TRACES_EXPORTER": "console", **env})
    assert str(raised.value) == line


@pytest.mark.parametrize(
    ("section", "line"),
    [
        (
            "{exporter: zipkin}",
            "tracing.exporter: must be one of 'none', 'console', 'otlp', not 'zipkin'",
        ),
        ("{sampler_arg: 1.5}", "tracing.sampler_arg: must be a ratio from 0 to 1, not 1.5"),
        ("{sampler: maybe}", "tracing.sampler: must be one of 'always_on', "),
        ("{endpoint: 'grpc://c:4317'}", "tracing.endpoint: must be an http:// or https:// URL"),
        ("{service_name: ''}", "tracing.service_name: must not be empty"),
        ("{exporter: console, colour: red}", "tracing: unknown key(s) colour"),
    ],
)
def test_a_bad_tracing_section_is_one_config_error_line(tmp_path, capsys, section, line):
    path = write_config(tmp_path, f"tracing: {section}\n")
    assert main(["check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iop-node: {path}: {line}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--otel-sampler-arg", "1.5"], "--otel-sampler-arg: must be a ratio from 0 to 1, not 1.5"),
        (
            ["--otel-endpoint", "localhost:4318"],
            "--otel-endpoint: must be an http:// or https:// URL",
        ),
        (["--otel-service-name", " "], "--otel-service-name: must not be empty"),
    ],
)
def test_a_bad_edge_flag_is_one_line_naming_it(capsys, flags, line):
    assert main(["edge", "--otel-exporter", "console", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iop-node: {line}") and err.count("\n") == 1, err


def test_an_unknown_exporter_flag_is_the_usual_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["edge", "--otel-exporter", "jaeger"])
    assert exit_.value.code == 2
    assert "--otel-exporter: invalid choice: 'jaeger'" in capsys.readouterr().err


def test_a_bad_variable_stops_serve_before_it_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "-1")
    assert main(["serve", "--config", str(write_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err == "iop-node: OTEL_TRACES_SAMPLER_ARG: must be a ratio from 0 to 1, not -1.0\n"


def test_otlp_without_its_extra_is_one_line_and_installs_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ConfigError) as raised:
        install(TracingSettings(exporter="otlp"))
    assert str(raised.value) == (
        "tracing: the otlp exporter needs the otlp extra (pip install 'iop-trio[otlp]'); "
        "or use the console exporter"
    )
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


# --- the environment's overrides of node.yaml -----------------------------------------


def test_otel_variables_never_change_the_config_and_iop_tracing_ones_do(tmp_path):
    path = write_config(tmp_path)
    otel = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "x",
        "OTEL_TRACES_SAMPLER": "always_off",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
    }
    plain = load_config(path, environ={})
    with_otel = load_config(path, environ=otel)
    assert with_otel == plain and with_otel.warnings == ()
    assert with_otel.tracing == TracingConfig()
    iop = {
        "IOP_TRACING__EXPORTER": "otlp",
        "IOP_TRACING__ENDPOINT": "http://c:4318",
        "IOP_TRACING__SERVICE_NAME": "gpu-7",
        "IOP_TRACING__SAMPLER": "traceidratio",
        "IOP_TRACING__SAMPLER_ARG": "0.5",
    }
    assert load_config(path, environ=iop).tracing == TracingConfig(
        exporter="otlp",
        endpoint="http://c:4318",
        service_name="gpu-7",
        sampler="traceidratio",
        sampler_arg=0.5,
    )
    typo = load_config(path, environ={"IOP_TRACING__EXPORT": "console"})
    assert typo.tracing == TracingConfig() and "IOP_TRACING__EXPORT" in typo.warnings[0]
    with pytest.raises(ConfigError, match=r"tracing\.exporter: must be one of"):
        load_config(path, environ={"IOP_TRACING__EXPORTER": "jaeger"})


def test_check_config_says_tracing_in_one_line(tmp_path, monkeypatch):
    path = write_config(tmp_path, "tracing: {exporter: otlp, endpoint: 'http://c:4318'}\n")
    out = io.StringIO()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    assert main(["check-config", "--config", str(path)], out=out) == 0
    lines = [line for line in out.getvalue().splitlines() if line.startswith("  tracing")]
    assert lines == [
        "  tracing otlp to http://c:4318/v1/traces, sampler traceidratio 0.1, service iop-node"
    ]
    out = io.StringIO()
    assert main(["check-config", "--config", str(write_config(tmp_path))], out=out) == 0
    assert "  tracing off\n" in out.getvalue()


# --- install ---------------------------------------------------------------------------


def test_off_installs_nothing_and_imports_no_sdk():
    assert install(TracingSettings()) is None
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    done = python(
        """
        import sys
        import iop_trio.cli
        from iop_trio.config import TracingConfig
        from iop_trio.telemetry import install, installed, resolve
        with installed(resolve(TracingConfig(), {})) as provider:
            assert provider is None
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")))
        """
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


CONSOLE_SCRIPT = """
    import sys
    from opentelemetry import trace
    from iop_trio.telemetry import TracingSettings, installed
    settings = TracingSettings(exporter="console", sampler=sys.argv[1], sampler_arg=0.0)
    with installed(settings, node_id="n-1") as provider:
        assert trace.get_tracer_provider() is provider
        with trace.get_tracer("test").start_as_current_span("outer") as outer:
            outer.set_attribute("gen_ai.request.model", "m")
            with trace.get_tracer("test").start_as_current_span("inner"):
                pass
    print("after shutdown", flush=True)
"""


def test_the_console_exporter_writes_the_spans_to_stdout_by_shutdown():
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONSOLE_SCRIPT), "always_on"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    before, _, after = done.stdout.partition("after shutdown")
    assert after == "\n"  # flushed by the shutdown, not at exit
    spans = {span["name"]: span for span in spans_in(before)}
    assert set(spans) == {"outer", "inner"}
    outer, inner = spans["outer"], spans["inner"]
    assert inner["parent_id"] == outer["context"]["span_id"]
    assert inner["context"]["trace_id"] == outer["context"]["trace_id"]
    assert outer["attributes"] == {"gen_ai.request.model": "m"}
    resource = outer["resource"]["attributes"]
    assert resource["service.name"] == "iop-node"
    assert resource["service.version"] == telemetry.__version__
    assert (resource["service.instance.id"], resource["iop.node_id"]) == ("n-1", "n-1")


@pytest.mark.parametrize("sampler", ["always_off", "traceidratio", "parentbased_traceidratio"])
def test_a_sampler_that_keeps_nothing_exports_nothing(sampler):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONSOLE_SCRIPT), sampler],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "after shutdown\n"), done.stderr


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """A real HTTP server taking OTLP/HTTP posts on loopback: its URL and what it got."""
    got: list[tuple[str, bytes]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_otlp_exporter_posts_the_spans_to_the_collector(otlp_receiver):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    url, got = otlp_receiver
    done = python(
        f"""
        from opentelemetry import trace
        from iop_trio.config import TracingConfig
        from iop_trio.telemetry import installed, resolve
        settings = resolve(TracingConfig(exporter="otlp", endpoint={url!r}), {{}})
        with installed(settings):
            trace.get_tracer("test").start_span("sent").end()
        """
    )
    assert done.returncode == 0, done.stderr
    assert [path for path, _ in got] == ["/v1/traces"]
    request = ExportTraceServiceRequest.FromString(got[0][1])
    (resource_spans,) = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "iop-node"
    names = [s.name for scope in resource_spans.scope_spans for s in scope.spans]
    assert names == ["sent"]


def test_a_second_install_in_one_process_is_refused():
    done = python(
        """
        from iop_trio.telemetry import TracingSettings, install
        first = install(TracingSettings(exporter="console"))
        try:
            install(TracingSettings(exporter="console"))
        except RuntimeError as exc:
            print(exc)
        first.shutdown()
        """
    )
    assert done.stdout == "a global tracer provider is set already; it is set once a process\n"


# --- real processes --------------------------------------------------------------------

#: ``iop-node serve`` through the real CLI, with one span of the test's own around
#: serve(): it ends only when the drain is over, so it is on stdout only if the
#: provider was flushed after the node stopped.
SERVE_SCRIPT = """
    import sys
    from opentelemetry import trace
    import iop_trio.cli.serve as serving
    from iop_trio.cli import main

    real_serve = serving.serve

    async def serve(config, **kwargs):
        with trace.get_tracer("test").start_as_current_span("test.serving"):
            return await real_serve(config, **kwargs)

    serving.serve = serve
    sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


async def read_lines_until(
    stream: trio.abc.ReceiveStream, lines: list[str], want: str, seen: trio.Event
) -> None:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            lines.append(line.decode())
            if want in lines[-1]:
                seen.set()


async def test_serve_with_the_console_exporter_flushes_its_spans_on_sigterm(tmp_path):
    path = write_config(tmp_path, "logging: {format: json}\n")
    env = {**_environ(), "OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "always_on"}
    logs: list[str] = []
    serving = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", textwrap.dedent(SERVE_SCRIPT), str(path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            assert process.stdout is not None and process.stderr is not None
            nursery.start_soon(read_lines_until, process.stderr, logs, "serving", serving)
            out = bytearray()

            async def read_stdout() -> None:
                assert process.stdout is not None
                async for chunk in process.stdout:
                    out.extend(chunk)

            nursery.start_soon(read_stdout)
            await serving.wait()
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    messages = [json.loads(line)["msg"] for line in logs]
    assert "tracing: console, sampler always_on, service iop-node" in messages
    assert "node traced-node stopped" in messages
    (span,) = spans_in(out.decode())
    assert span["name"] == "test.serving" and span["status"]["status_code"] == "UNSET"
    assert span["resource"]["attributes"]["service.instance.id"] == "traced-node"


async def test_the_edge_with_console_tracing_starts_and_stops_cleanly(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0k\n")
    token.chmod(0o600)
    argv = [sys.executable, "-m", "iop_trio.cli", "edge", "--listen", "127.0.0.1:0"]
    argv += ["--token-file", str(token), "--otel-exporter", "console"]
    argv += ["--otel-service-name", "edge-7", "--otel-sampler", "traceidratio"]
    logs: list[str] = []
    listening = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_environ()
            )
            assert process.stdout is not None and process.stderr is not None
            nursery.start_soon(read_lines_until, process.stdout, [], "edge listening", listening)
            nursery.start_soon(read_lines_until, process.stderr, logs, "@", trio.Event())
            await listening.wait()
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    assert any("tracing: console, sampler traceidratio 1, service edge-7" in m for m in logs)


def _environ() -> dict[str, str]:
    """This process's environment without any OTEL_* variable of the machine's."""
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_the_examples_tracing_section_is_off_and_right_when_uncommented(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "node.yaml"
    text = example.read_text()
    assert load_config(example, environ={}).tracing == TracingConfig()  # commented: off
    at = text.index("# tracing:\n")
    block = [line.removeprefix("# ") for line in text[at:].splitlines() if line.strip()]
    section = "\n".join(line for line in block if not line.lstrip().startswith("#"))
    path = write_config(tmp_path, section + "\n")
    assert load_config(path, environ={}).tracing == TracingConfig(
        exporter="otlp",
        endpoint="http://collector:4318",
        service_name="iop-node-gpu7",
        sampler="parentbased_traceidratio",
        sampler_arg=0.1,
    )
