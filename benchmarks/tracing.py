"""What tracing costs a node, a run at a time, split into making spans and exporting them.

    python benchmarks/tracing.py [--runs N] [--rounds K]

Runs ``--runs`` echo runs (one delta each; a Node, a MemoryStore, in this process)
one after another, and reports the process CPU time a run (``time.process_time``: the
SDK's export thread included) for each way of tracing, round-robin ``--rounds`` times,
taking the median of each:

- ``off``: no provider (OpenTelemetry's no-op; what a node runs by default);
- ``spans, no export``: the SDK's TracerProvider, sampler always_on, spans made and
  ended into a BatchSpanProcessor whose exporter drops them (the cost of making them);
- ``console``: the BatchSpanProcessor and the ConsoleSpanExporter, to /dev/null (what
  ``OTEL_TRACES_EXPORTER=console`` costs, and ``relay.py --tracing`` measures);
- ``otlp``: the BatchSpanProcessor and the OTLP/HTTP exporter, posting to a collector
  on loopback in this process that answers 200 to everything (protobuf encoding and
  an HTTP POST a batch; skipped if the ``otlp`` extra is not installed).

The baseline is ``off`` of the same round; the ratios are to it. Figures are printed,
never asserted. It leaves out the edge (its two spans a run) and the engine's HTTP
call (echo has none), so a run here is cheaper than a relayed one and the ratios are
an upper bound of what tracing adds to a run through ``iop-node serve``.
"""

from __future__ import annotations

import argparse
import http.server
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from iop_trio.adapters.echo import EchoAdapter
from iop_trio.runtime import Node, RunSpec, RuntimeLimits, TargetSpec
from iop_trio.store.memory import MemoryStore


class _Collector(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def collector() -> Iterator[str]:
    """An OTLP/HTTP collector on loopback that takes every POST; yields its traces URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        thread.join(timeout=5)


def provider_with(exporter: Any) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    provider = TracerProvider(sampler=ALWAYS_ON)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def dropping() -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    return provider_with(Drop())


async def runs(n: int, provider: Any) -> float:
    """CPU seconds a run, over ``n`` runs one after another (export flushed included)."""
    node = Node(
        node_id="bench",
        adapters=[EchoAdapter()],
        targets=[TargetSpec("echo", "m", concurrency=4)],
        limits=RuntimeLimits(concurrency=4, max_queued=n, queue_timeout=3600),
        store=MemoryStore(),
        tracer_provider=provider,
    )
    spec = RunSpec("echo/m", "one two three four five six seven eight")
    async with node.running():
        manager = node.manager
        for _ in range(min(n, 50)):  # warm
            submitted = await manager.submit(spec)
            async for _event in manager.watch(submitted.record.run_id):
                pass
        start = time.process_time()
        for _ in range(n):
            submitted = await manager.submit(spec)
            async for _event in manager.watch(submitted.record.run_id):
                pass
        if provider is not None:
            provider.force_flush()
        return (time.process_time() - start) / n


def ways(devnull: Any, otlp_url: str | None) -> dict[str, Callable[[], Any]]:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    found: dict[str, Callable[[], Any]] = {
        "off": lambda: None,
        "spans, no export": dropping,
        "console": lambda: provider_with(ConsoleSpanExporter(out=devnull)),
    }
    if otlp_url is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        found["otlp"] = lambda: provider_with(OTLPSpanExporter(endpoint=otlp_url))
    return found


def main(ns: argparse.Namespace) -> None:
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401

        have_otlp = True
    except ImportError:
        have_otlp = False
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}; {ns.runs} runs a figure")
    with open("/dev/null", "w") as devnull, collector() as url:
        chosen = ways(devnull, url if have_otlp else None)
        seen: dict[str, list[float]] = {name: [] for name in chosen}
        for _ in range(ns.rounds):
            for name, make in chosen.items():
                provider = make()
                seen[name].append(trio.run(runs, ns.runs, provider))
                if provider is not None:
                    provider.shutdown()
    base = statistics.median(seen["off"])
    print(f"{'tracing':<18} {'cpu us a run':>12} {'ratio':>7}   (median of {ns.rounds} rounds)")
    for name, figures in seen.items():
        cost = statistics.median(figures)
        print(f"{name:<18} {cost * 1e6:>12,.0f} {cost / base:>7.2f}")
    if not have_otlp:
        print("otlp: skipped (pip install 'iop-trio[otlp]')")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    main(parser.parse_args())
