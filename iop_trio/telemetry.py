"""Tracing set up by the standard means: which exporter, where to, which sampler, and the
OpenTelemetry SDK's tracer provider made of them and installed as the global one.

:func:`resolve` makes :class:`TracingSettings` from what node.yaml's ``tracing:`` or the
edge's ``--otel-*`` flags give (a :class:`~iop_trio.config.TracingConfig`), taking each
key they leave null from its standard variable (:data:`ENV_VARS`), else its default;
the default exporter is ``none``: tracing is off. :func:`install` makes the SDK provider
(nothing when off) and sets it as the global one; :func:`installed` holds it for a block
and shuts it down (flushing what is batched) when the block ends, however it ends.

Only the CLI's ``serve``, ``edge`` and ``demo`` install a provider; every component takes
a ``tracer_provider`` or uses the global one, which until then is OpenTelemetry's no-op.
A bad value (an unknown exporter, a ratio out of range, ``otlp`` without the ``otlp``
extra) is one :class:`~iop_trio.config.ConfigError` line naming the variable or key.

This module sits above :mod:`iop_trio.config`; it imports the SDK only in
:func:`install`, so with tracing off the SDK is never imported.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

import attrs

from . import __version__
from .config import (
    TRACE_EXPORTERS,
    TRACE_SAMPLERS,
    ConfigError,
    TracingConfig,
    endpoint_problem,
    ratio_problem,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler

log = logging.getLogger("iop_trio.telemetry")

#: The default service names (``service.name``) of the two processes, and the demo's.
NODE_SERVICE = "iop-node"
EDGE_SERVICE = "iop-edge"
DEMO_SERVICE = "iop-demo"
#: Where OTLP/HTTP spans go when nothing says (the collector's default port, locally).
DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
TRACES_PATH = "/v1/traces"
#: OpenTelemetry's own default: follow the caller's decision, sample every root.
DEFAULT_SAMPLER = "parentbased_always_on"

#: The standard variable each setting falls back to (the endpoint has two: the traces
#: one is a whole URL, used as it is; the general one is a base, ``/v1/traces`` added).
ENV_VARS: Mapping[str, str] = {
    "exporter": "OTEL_TRACES_EXPORTER",
    "traces_endpoint": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "service_name": "OTEL_SERVICE_NAME",
    "sampler": "OTEL_TRACES_SAMPLER",
    "sampler_arg": "OTEL_TRACES_SAMPLER_ARG",
}

#: How the ``otlp`` extra is installed, said when it is chosen but missing.
OTLP_EXTRA = "pip install 'iop-trio[otlp]'"


@attrs.frozen
class TracingSettings:
    """Tracing as resolved: ``exporter`` ``none`` is off (the other keys then mean
    nothing); ``endpoint`` is the whole URL OTLP/HTTP posts spans to (``otlp`` only);
    ``sampler_arg`` is the ratio of ``traceidratio`` and ``parentbased_traceidratio``,
    and ignored by the other samplers."""

    exporter: str = attrs.field(default="none", validator=attrs.validators.in_(TRACE_EXPORTERS))
    endpoint: str = DEFAULT_ENDPOINT
    service_name: str = NODE_SERVICE
    sampler: str = attrs.field(
        default=DEFAULT_SAMPLER, validator=attrs.validators.in_(TRACE_SAMPLERS)
    )
    sampler_arg: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"

    def describe(self) -> str:
        """One line: ``off``, or the exporter (and its endpoint), sampler and service."""
        if not self.enabled:
            return "off"
        where = f" to {self.endpoint}" if self.exporter == "otlp" else ""
        ratio = f" {self.sampler_arg:g}" if self.sampler.endswith("traceidratio") else ""
        return f"{self.exporter}{where}, sampler {self.sampler}{ratio}, service {self.service_name}"

    def __repr__(self) -> str:
        return f"<TracingSettings {self.describe()}>"


def traces_url(base: str) -> str:
    """The traces URL of a collector's base URL: ``/v1/traces`` added to its path unless
    the path already ends with it (so either form may be given)."""
    path = urlsplit(base).path.rstrip("/")
    if path.endswith(TRACES_PATH):
        return base
    return base.rstrip("/") + TRACES_PATH


def _env(environ: Mapping[str, str], key: str) -> str | None:
    """The variable of ``key``, stripped; None when it is unset or empty."""
    value = environ.get(ENV_VARS[key], "").strip()
    return value or None


def _one_of(environ: Mapping[str, str], key: str, known: tuple[str, ...]) -> str | None:
    value = _env(environ, key)
    if value is None or value.lower() in known:
        return None if value is None else value.lower()
    names = ", ".join(repr(k) for k in known)
    raise ConfigError(f"{ENV_VARS[key]}: must be one of {names}, not {value!r}")


def _env_endpoint(environ: Mapping[str, str]) -> str | None:
    for key in ("traces_endpoint", "endpoint"):
        value = _env(environ, key)
        if value is None:
            continue
        problem = endpoint_problem(value)
        if problem is not None:
            raise ConfigError(f"{ENV_VARS[key]}: {problem}")
        return value if key == "traces_endpoint" else traces_url(value)
    return None


def _env_ratio(environ: Mapping[str, str]) -> float | None:
    value = _env(environ, "sampler_arg")
    if value is None:
        return None
    try:
        ratio: object = float(value)
    except ValueError:
        ratio = value
    problem = ratio_problem(ratio)
    if problem is not None:
        raise ConfigError(f"{ENV_VARS['sampler_arg']}: {problem}")
    assert isinstance(ratio, float)
    return ratio


def resolve(
    given: TracingConfig, environ: Mapping[str, str], *, service_name: str = NODE_SERVICE
) -> TracingSettings:
    """The settings of ``given`` (node.yaml's section or the edge's flags, already
    checked), each key it leaves null from its variable in ``environ``, else the
    default (``service_name`` for the service). When the exporter resolves to ``none``
    the other variables are not read, so a bad one then is no error; when it does not,
    a bad variable is a ConfigError naming it."""
    exporter = given.exporter or _one_of(environ, "exporter", TRACE_EXPORTERS) or "none"
    if exporter == "none":
        return TracingSettings()
    endpoint = traces_url(given.endpoint) if given.endpoint else _env_endpoint(environ)
    sampler = given.sampler or _one_of(environ, "sampler", TRACE_SAMPLERS) or DEFAULT_SAMPLER
    arg = given.sampler_arg if given.sampler_arg is not None else _env_ratio(environ)
    return TracingSettings(
        exporter=exporter,
        endpoint=endpoint or DEFAULT_ENDPOINT,
        service_name=given.service_name or _env(environ, "service_name") or service_name,
        sampler=sampler,
        sampler_arg=1.0 if arg is None else arg,
    )


def _sampler(settings: TracingSettings) -> Sampler:
    from opentelemetry.sdk.trace import sampling

    name = settings.sampler.removeprefix("parentbased_")
    root: Sampler
    if name == "traceidratio":
        root = sampling.TraceIdRatioBased(settings.sampler_arg)
    else:
        root = sampling.ALWAYS_ON if name == "always_on" else sampling.ALWAYS_OFF
    return sampling.ParentBased(root) if settings.sampler.startswith("parentbased_") else root


def _processor(settings: TracingSettings, out: TextIO | None) -> SpanProcessor:
    """A batch processor of the settings' exporter; ConfigError for ``otlp`` when the
    ``otlp`` extra is not installed."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    exporter: Any
    if settings.exporter == "console":
        exporter = ConsoleSpanExporter(out=out or sys.stdout)
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                f"tracing: the otlp exporter needs the otlp extra ({OTLP_EXTRA}); "
                "or use the console exporter"
            ) from None
        exporter = OTLPSpanExporter(endpoint=settings.endpoint)
    return BatchSpanProcessor(exporter)


def install(
    settings: TracingSettings, *, node_id: str | None = None, out: TextIO | None = None
) -> TracerProvider | None:
    """Make the SDK tracer provider of ``settings`` and set it as the global one; None
    (and nothing installed, nothing imported) when tracing is off. Its resource names the
    service, this version and, for a node, ``node_id``; the console exporter writes to
    ``out`` (stdout). The caller shuts it down (that flushes) when the process stops:
    see :func:`installed`. RuntimeError if another provider is global already (the
    global one can be set once a process)."""
    if not settings.enabled:
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    processor = _processor(settings, out)
    attributes: dict[str, str] = {
        "service.name": settings.service_name,
        "service.version": __version__,
    }
    if node_id is not None:
        attributes["service.instance.id"] = node_id
        attributes["iop.node_id"] = node_id
    provider = TracerProvider(
        sampler=_sampler(settings),
        resource=Resource.create(attributes),
        shutdown_on_exit=False,  # installed() shuts it down; not twice
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        processor.shutdown()
        raise RuntimeError("a global tracer provider is set already; it is set once a process")
    return provider


@contextmanager
def installed(
    settings: TracingSettings, *, node_id: str | None = None
) -> Iterator[TracerProvider | None]:
    """:func:`install` for the block, said in one log line, and shut down (flushing the
    spans batched) when the block ends, by return, signal or error."""
    provider = install(settings, node_id=node_id)
    if provider is None:
        yield None
        return
    log.info("tracing: %s", settings.describe())
    try:
        yield provider
    finally:
        provider.shutdown()
