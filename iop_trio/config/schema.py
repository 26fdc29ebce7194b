"""The schema of node.yaml: one frozen attrs class a section (:class:`NodeConfig` at the
top), the validators of its keys, the cattrs converter that structures plain data into
them, and how a section builds what the node runs with (its limits, its adapters, its
TLS context, its tokens).
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import stat
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, get_args
from urllib.parse import urlsplit

import attrs
import cattrs

from ..adapters.base import Adapter
from ..adapters.registry import AdapterRegistry, default_registry
from ..model import (
    CHARS_PER_TOKEN,
    MAX_OUTPUT_TOKENS,
    TOKENIZERS,
    AutoConcurrency,
    TargetSpec,
    TenantLimits,
    field_check,
    limit_problem,
    positive_problem,
    redact_url,
    seconds_problem,
)
from ..runtime import AdapterSlot, ReplicaSlot, RuntimeLimits
from ..runtime.replicas import ROUTINGS
from ..runtime.tickets import HOLD_AFTER
from ..structure import problems, strict_converter
from ..transport.tls import client_context
from .errors import ConfigError

T = TypeVar("T")


def _int_at_least(low: int) -> Callable[[Any, Any, Any], None]:
    return field_check(lambda value: limit_problem(value, low))


_non_negative = field_check(seconds_problem)
_positive = field_check(lambda value: seconds_problem(value, positive=True))
_positive_number = field_check(positive_problem)


def _concurrency(low: int) -> Callable[[Any, Any, Any], None]:
    """A concurrency: an integer >= ``low``, or ``auto`` (a learned one)."""

    def problem(value: object) -> str | None:
        if value == "auto":
            return None
        found = limit_problem(value, low)
        return None if found is None else f"{found}, or auto"

    return field_check(problem)


def _tokenizer(value: object) -> str | None:
    if value in TOKENIZERS:
        return None
    return f"must be one of {', '.join(sorted(TOKENIZERS))}, not {value!r}"


def _auto(
    concurrency: object, low: int | None, high: int | None, where: str
) -> AutoConcurrency | None:
    """The learned concurrency that ``concurrency: auto`` with ``concurrency_min`` and
    ``concurrency_max`` asks for (None for a number); ValueError for bounds without auto
    or a minimum over the maximum."""
    if concurrency != "auto":
        if low is not None or high is not None:
            raise ValueError("concurrency_min, concurrency_max: only with concurrency: auto")
        return None
    auto = AutoConcurrency(
        1 if low is None else low, AutoConcurrency().maximum if high is None else high
    )
    if auto.minimum > auto.maximum:
        raise ValueError(
            f"concurrency_min: {auto.minimum} is over concurrency_max {auto.maximum} ({where})"
        )
    return auto


@attrs.frozen
class EdgeConfig:
    """Where the edge is. An empty ``url`` runs the node without an edge."""

    url: str = ""
    token: str | None = None
    token_file: str | None = None
    ping_interval: float = attrs.field(default=20.0, validator=_non_negative)
    ping_timeout: float = attrs.field(default=10.0, validator=_positive)
    max_message_size: int = attrs.field(default=4 * 1024 * 1024, validator=_int_at_least(1024))
    backoff_initial: float = attrs.field(default=0.5, validator=_positive)
    backoff_max: float = attrs.field(default=30.0, validator=_positive)
    # TLS (wss://): the CA to trust (default: the system's), this node's certificate and
    # key for mutual TLS, and the name to check the edge's certificate against
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.url and not re.match(r"wss?://", self.url):
            raise ValueError(f"url: must start with ws:// or wss://, not {self.url!r}")
        if self.token is not None and self.token_file is not None:
            raise ValueError("token, token_file: give one of them, not both")
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file: give cert_file with it")


@attrs.frozen
class StoreConfig:
    """The run store. ``retention_days`` 0 keeps runs forever."""

    kind: Literal["sqlite", "memory"] = "sqlite"
    path: str = "iop-node.db"
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    retention_days: float = attrs.field(default=30.0, validator=_non_negative)
    prune_interval: float = attrs.field(default=3600.0, validator=_positive)


@attrs.frozen
class RuntimeConfig:
    """Node-wide limits; the run bounds apply to targets that set none (null: no bound)."""

    concurrency: int = attrs.field(default=8, validator=_int_at_least(1))
    max_queued: int = attrs.field(default=1000, validator=_int_at_least(0))
    queue_timeout: float = attrs.field(default=30.0, validator=_non_negative)
    drain_timeout: float = attrs.field(default=30.0, validator=_non_negative)
    final_write_timeout: float = attrs.field(default=10.0, validator=_positive)
    max_prompt_bytes: int | None = attrs.field(default=4 * 1024 * 1024, validator=_int_at_least(1))
    max_output_bytes: int | None = attrs.field(default=16 * 1024 * 1024, validator=_int_at_least(1))
    max_run_time: float | None = attrs.field(default=3600.0, validator=_positive)
    # bounds a run's creation too, so 0 would refuse every run
    store_grace: float = attrs.field(default=10.0, validator=_positive)
    early_reject: bool = False
    #: seconds between asks of each engine which models it serves (null: never)
    probe_interval: float | None = attrs.field(default=30.0, validator=_positive)
    #: the most tokens all runs reserve at once (null: no budget)
    token_budget: int | None = attrs.field(default=None, validator=_int_at_least(1))
    #: the most output tokens a run reserves when neither it nor its target says
    max_output_tokens: int = attrs.field(default=MAX_OUTPUT_TOKENS, validator=_int_at_least(1))
    #: seconds a run that lacks tokens may be passed by smaller runs before it holds them
    hold_after: float = attrs.field(default=HOLD_AFTER, validator=_non_negative)
    #: characters (UTF-8 bytes) a token holds, for a prompt's tokens where an engine
    #: reports none (model.estimate_prompt_tokens)
    chars_per_token: float = attrs.field(
        default=CHARS_PER_TOKEN, validator=field_check(positive_problem)
    )


@attrs.frozen
class TenantConfig:
    """A tenant's share: fair-queueing ``weight``, and optional bounds on its waiting
    runs (node-wide) and its runs at once (null: none)."""

    weight: float = attrs.field(default=1.0, validator=field_check(positive_problem))
    max_queued: int | None = attrs.field(default=None, validator=_int_at_least(0))
    concurrency: int | None = attrs.field(default=None, validator=_int_at_least(0))
    max_tokens_in_flight: int | None = attrs.field(default=None, validator=_int_at_least(1))
    tokens_per_minute: float | None = attrs.field(default=None, validator=_positive_number)

    def limits(self) -> TenantLimits:
        return TenantLimits(
            self.weight,
            self.max_queued,
            self.concurrency,
            self.max_tokens_in_flight,
            self.tokens_per_minute,
        )


def _routing(value: object) -> str | None:
    if value in ROUTINGS:
        return None
    return f"must be one of {', '.join(ROUTINGS)}, not {value!r}"


@attrs.frozen
class ReplicaConfig:
    """One engine of an adapter with ``replicas:`` (a plain URL is one with only ``url``).
    ``concurrency`` null: learned if the adapter's is ``auto``, else bounded only by the
    adapter's."""

    url: str
    api_key: str | None = None
    weight: float = attrs.field(default=1.0, validator=_positive_number)
    concurrency: int | str | None = attrs.field(default=None, validator=_concurrency(1))
    token_budget: int | None = attrs.field(default=None, validator=_int_at_least(1))


@attrs.frozen
class AdapterConfig:
    """One adapter instance. ``settings`` are the kind's own keys (base_url, api_key, ...);
    ``replicas``: the engines it spreads its runs over (instead of one ``base_url``),
    picked per run by ``routing``."""

    kind: str
    # an integer, or "auto": learned between concurrency_min and concurrency_max
    concurrency: int | str | None = attrs.field(default=None, validator=_concurrency(1))
    max_concurrency: int | None = attrs.field(default=None, validator=_int_at_least(1))
    concurrency_min: int | None = attrs.field(default=None, validator=_int_at_least(1))
    concurrency_max: int | None = attrs.field(default=None, validator=_int_at_least(1))
    token_budget: int | None = attrs.field(default=None, validator=_int_at_least(1))
    replicas: list[ReplicaConfig] | None = None
    routing: str = attrs.field(default="least_loaded", validator=field_check(_routing))
    settings: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.replicas is not None:
            if not self.replicas:
                raise ValueError("replicas: must name at least one engine")
            if "base_url" in self.settings:
                raise ValueError("base_url: give either base_url or replicas, not both")
            urls = [r.url for r in self.replicas]
            if len(set(urls)) != len(urls):
                raise ValueError("replicas: a url is named twice")
        high = self.concurrency_max
        if self.concurrency == "auto" and high is None and self.max_concurrency is not None:
            high = self.max_concurrency  # learned up to the engine's own bound
        _auto(self.concurrency, self.concurrency_min, high, "the adapter")

    def auto(self) -> AutoConcurrency | None:
        high = self.concurrency_max
        if high is None and self.concurrency == "auto":
            high = self.max_concurrency
        return _auto(self.concurrency, self.concurrency_min, high, "the adapter")

    def static_concurrency(self) -> int | None:
        return None if self.concurrency == "auto" else self.concurrency  # type: ignore[return-value]


@attrs.frozen
class TargetConfig:
    adapter: str
    model: str
    profile: str = ""
    # an integer, or "auto": learned between concurrency_min and concurrency_max
    concurrency: int | str = attrs.field(default=1, validator=_concurrency(0))
    concurrency_min: int | None = attrs.field(default=None, validator=_int_at_least(1))
    concurrency_max: int | None = attrs.field(default=None, validator=_int_at_least(1))
    max_queued: int | None = attrs.field(default=None, validator=_int_at_least(0))
    queue_timeout: float | None = attrs.field(default=None, validator=_non_negative)
    params: dict[str, Any] = attrs.field(factory=dict)
    # tokens (see docs/operations.md): a budget for its runs' reservations, the most
    # output a run reserves when it sets no bound, how prompts are counted
    token_budget: int | None = attrs.field(default=None, validator=_int_at_least(1))
    max_output_tokens: int | None = attrs.field(default=None, validator=_int_at_least(1))
    tokenizer: str = attrs.field(default="estimate", validator=field_check(_tokenizer))
    chars_per_token: float | None = attrs.field(default=None, validator=_positive_number)
    max_prompt_bytes: int | None = attrs.field(default=None, validator=_int_at_least(1))
    max_output_bytes: int | None = attrs.field(default=None, validator=_int_at_least(1))
    max_run_time: float | None = attrs.field(default=None, validator=_positive)
    # run options callers may set (null: the adapter kind's default), and caps on them
    allow_options: list[str] | None = None
    # a number (the most a caller may ask; its low end from model.OPTION_FLOORS) or
    # {min, max}; checked with the rest of the target (model.option_rules_problem)
    option_caps: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        _auto(self.concurrency, self.concurrency_min, self.concurrency_max, "the target")

    def spec(self) -> TargetSpec:
        auto = _auto(self.concurrency, self.concurrency_min, self.concurrency_max, "the target")
        return TargetSpec(
            adapter=self.adapter,
            model=self.model,
            profile=self.profile,
            concurrency=auto.maximum if auto is not None else int(self.concurrency),
            auto=auto,
            token_budget=self.token_budget,
            max_output_tokens=self.max_output_tokens,
            tokenizer=self.tokenizer,
            chars_per_token=self.chars_per_token,
            max_queued=self.max_queued,
            queue_timeout=self.queue_timeout,
            params=dict(self.params),
            max_prompt_bytes=self.max_prompt_bytes,
            max_output_bytes=self.max_output_bytes,
            max_run_time=self.max_run_time,
            allow_options=None if self.allow_options is None else frozenset(self.allow_options),
            option_caps=dict(self.option_caps),
        )


@attrs.frozen
class MetricsConfig:
    """``listen`` is host:port for the ops port (/metrics, /healthz, /runs); empty turns it
    off. The /runs routes need ``token`` (or ``token_file``); ``open_metrics`` false
    makes /metrics and /healthz need it too. A listener not on loopback needs a token."""

    listen: str = "127.0.0.1:9464"
    token: str | None = None
    token_file: str | None = None
    open_metrics: bool = True

    def __attrs_post_init__(self) -> None:
        if self.listen:
            host, _ = split_listen(self.listen)
            if self.token is None and self.token_file is None and not is_loopback(host):
                raise ValueError(
                    f"listen: {self.listen} is not a loopback address; the ops port shows "
                    "prompts and cancels runs, so set token or token_file to serve it there"
                )
        if self.token is not None and self.token_file is not None:
            raise ValueError("token, token_file: give one of them, not both")

    @property
    def address(self) -> tuple[str, int] | None:
        return split_listen(self.listen) if self.listen else None


@attrs.frozen
class LoggingConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


TraceExporter = Literal["none", "console", "otlp"]
TraceSampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]
#: The exporters and samplers tracing knows, by their OTEL_* names.
TRACE_EXPORTERS: tuple[str, ...] = get_args(TraceExporter)
TRACE_SAMPLERS: tuple[str, ...] = get_args(TraceSampler)


def ratio_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a sampling ratio (a number from 0 to 1), or None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1:
        return None
    return f"must be a ratio from 0 to 1, not {value!r}"


def endpoint_problem(value: object) -> str | None:
    """What is wrong with ``value`` as an OTLP/HTTP endpoint (an http(s) URL), or None."""
    if isinstance(value, str):
        parts = urlsplit(value)
        if parts.scheme in ("http", "https") and parts.hostname:
            return None
    return f"must be an http:// or https:// URL, not {value!r}"


def _service_problem(value: object) -> str | None:
    return None if isinstance(value, str) and value.strip() else "must not be empty"


@attrs.frozen
class TracingConfig:
    """node.yaml's ``tracing:`` (and the edge's ``--otel-*`` flags): a key left null
    falls back to its standard OTEL_* variable, and with neither tracing is off
    (``iop_trio.telemetry.resolve``). ``endpoint`` is the collector's base URL, as
    OTEL_EXPORTER_OTLP_ENDPOINT (``/v1/traces`` is added unless it ends so);
    ``sampler_arg`` is the ratio of the ratio samplers (ignored by the others)."""

    exporter: TraceExporter | None = None
    endpoint: str | None = attrs.field(default=None, validator=field_check(endpoint_problem))
    service_name: str | None = attrs.field(default=None, validator=field_check(_service_problem))
    sampler: TraceSampler | None = None
    sampler_arg: float | None = attrs.field(default=None, validator=field_check(ratio_problem))


@attrs.frozen
class NodeConfig:
    node_id: str
    targets: list[TargetConfig]
    adapters: dict[str, AdapterConfig] = attrs.field(factory=dict)
    edge: EdgeConfig = attrs.field(factory=EdgeConfig)
    store: StoreConfig = attrs.field(factory=StoreConfig)
    runtime: RuntimeConfig = attrs.field(factory=RuntimeConfig)
    tenants: dict[str, TenantConfig] = attrs.field(factory=dict)
    metrics: MetricsConfig = attrs.field(factory=MetricsConfig)
    logging: LoggingConfig = attrs.field(factory=LoggingConfig)
    tracing: TracingConfig = attrs.field(factory=TracingConfig)
    source: str = "<config>"  # the file it came from, for messages
    #: what was ignored and should be said once (IOP_* variables that name no key)
    warnings: tuple[str, ...] = attrs.field(default=(), eq=False)

    def limits(self) -> RuntimeLimits:
        r = self.runtime
        return RuntimeLimits(
            concurrency=r.concurrency,
            max_queued=r.max_queued,
            queue_timeout=r.queue_timeout,
            final_write_timeout=r.final_write_timeout,
            max_prompt_bytes=r.max_prompt_bytes,
            max_output_bytes=r.max_output_bytes,
            max_run_time=r.max_run_time,
            store_grace=r.store_grace,
            early_reject=r.early_reject,
            probe_interval=r.probe_interval,
            token_budget=r.token_budget,
            max_output_tokens=r.max_output_tokens,
            hold_after=r.hold_after,
            chars_per_token=r.chars_per_token,
            tenants={name: t.limits() for name, t in self.tenants.items()},
        )

    def edge_token(self) -> str | None:
        """The token, read from ``token_file`` if that is how it is given."""
        if self.edge.token_file is None:
            return self.edge.token
        return read_secret_file(self.edge.token_file, f"{self.source}: edge.token_file")

    def edge_ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the link to a ``wss://`` edge (None for ``ws://``);
        ConfigError for a file that cannot be loaded, or a key others may read."""
        e = self.edge
        if not e.url.startswith("wss://"):
            return None
        where = f"{self.source}: edge"
        if e.key_file is not None or e.cert_file is not None:
            private = e.key_file or e.cert_file
            assert private is not None
            read_secret_file(private, f"{where}.{'key_file' if e.key_file else 'cert_file'}")
        try:
            return client_context(
                ca_file=e.ca_file,
                cert_file=e.cert_file,
                key_file=e.key_file,
                server_name=e.server_name,
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{where}: TLS files: {exc}") from None

    def ops_token(self) -> str | None:
        """The ops port's token, read from ``metrics.token_file`` if that is how it is given."""
        if self.metrics.token_file is None:
            return self.metrics.token
        return read_secret_file(self.metrics.token_file, f"{self.source}: metrics.token_file")

    def build_adapters(self, registry: AdapterRegistry | None = None) -> list[AdapterSlot]:
        """The adapter instances, each with its configured limit."""
        registry = registry or default_registry()
        slots = []
        for name, cfg in self.adapters.items():
            replicas = tuple(
                _replica_slot(registry, name, cfg, i, self.source)
                for i in range(len(cfg.replicas or ()))
            )
            adapter = replicas[0].adapter if replicas else None
            slots.append(
                AdapterSlot(
                    adapter or _make_adapter(registry, name, cfg, self.source),
                    cfg.static_concurrency(),
                    token_budget=cfg.token_budget,
                    auto=None if replicas else cfg.auto(),
                    replicas=replicas,
                    routing=cfg.routing,
                )
            )
        return slots

    def target_specs(self) -> list[TargetSpec]:
        return [t.spec() for t in self.targets]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) is this machine's
    loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_secret_file(path: str, what: str) -> str:
    """The text of a file holding a secret, stripped; ConfigError (``what: ...``) if it
    cannot be read or if its group or others may read it (as ssh refuses keys)."""
    try:
        with open(path, encoding="utf-8") as file:
            mode = os.fstat(file.fileno()).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(
                    f"{what}: {path} may be read by others (mode {stat.S_IMODE(mode):04o}); "
                    f"make it private: chmod 600 {path}"
                )
            return file.read().strip()
    except OSError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` as (host, port); ValueError if it is not one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen: must be host:port, not {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def adapter_settings(
    registry: AdapterRegistry,
    name: str,
    cfg: AdapterConfig,
    source: str,
    replica: int | None = None,
) -> Any:
    """The kind's settings object from the adapter's keys (with ``replicas``: those of
    replica number ``replica``, its url and api_key in; None: every replica is
    checked, the first's returned); ConfigError naming the key."""
    where = f"{source}: adapters.{name}"
    if cfg.kind not in registry:
        raise ConfigError(f"{where}.kind: unknown kind {cfg.kind!r} (known: {', '.join(registry)})")
    settings_type = registry.settings_type(cfg.kind)
    known = sorted(attrs.fields_dict(settings_type))
    for key in cfg.settings:
        if key not in known:
            raise ConfigError(
                f"{where}.{key}: not a setting of kind {cfg.kind!r} (known: {', '.join(known)})"
            )
    if cfg.replicas is None:
        return _structure_settings(cfg.settings, settings_type, f"adapters.{name}", source)
    if "base_url" not in known:
        raise ConfigError(
            f"{where}.replicas: kind {cfg.kind!r} has no base_url: it takes no replicas"
        )
    found = []
    for i in range(len(cfg.replicas)) if replica is None else [replica]:
        one = cfg.replicas[i]
        own = {**cfg.settings, "base_url": one.url}
        if one.api_key is not None:
            own["api_key"] = one.api_key
        path = f"adapters.{name}.replicas[{i}]"
        found.append(_structure_settings(own, settings_type, path, source))
    return found[0]


def _structure_settings(settings: dict[str, Any], kind: type, path: str, source: str) -> Any:
    try:
        return CONVERTER.structure(settings, kind)
    except Exception as exc:  # cattrs raises class validation groups
        lines = error_lines(exc, prefix=path)
        raise ConfigError("\n".join(f"{source}: {m}" for m in lines)) from None


def _make_adapter(
    registry: AdapterRegistry,
    name: str,
    cfg: AdapterConfig,
    source: str,
    replica: int | None = None,
) -> Adapter:
    settings = adapter_settings(registry, name, cfg, source, replica)
    return registry.create(cfg.kind, name, settings, max_concurrency=cfg.max_concurrency)


def _replica_slot(
    registry: AdapterRegistry, name: str, cfg: AdapterConfig, index: int, source: str
) -> ReplicaSlot:
    """Replica number ``index``'s adapter (the adapter's settings, its own url and
    api_key) and its bounds: its own concurrency, else the adapter's ``auto`` learned
    per replica."""
    assert cfg.replicas is not None
    replica = cfg.replicas[index]
    adapter = _make_adapter(registry, name, cfg, source, index)
    auto = cfg.auto() if replica.concurrency in (None, "auto") else None
    if replica.concurrency == "auto" and auto is None:
        auto = AutoConcurrency()
    static = replica.concurrency if isinstance(replica.concurrency, int) else None
    return ReplicaSlot(
        adapter,
        redact_url(replica.url),
        concurrency=static,
        token_budget=replica.token_budget,
        weight=replica.weight,
        auto=auto if static is None else None,
    )


# --- structuring ---------------------------------------------------------------------------


def _strict_converter() -> cattrs.Converter:
    conv = strict_converter()

    def number_or_word(value: Any, _: type) -> int | str:
        # a concurrency: its validator says which numbers and words it takes
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"must be an integer or auto, not {value!r}")
        return value

    conv.register_structure_hook(int | str, number_or_word)
    conv.register_structure_hook(
        int | str | None, lambda v, t: None if v is None else number_or_word(v, t)
    )

    base_adapter = conv.get_structure_hook(AdapterConfig)

    def adapter(value: Any, _: type) -> AdapterConfig:
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a mapping, not {value!r}")
        known = {
            "kind",
            "concurrency",
            "max_concurrency",
            "concurrency_min",
            "concurrency_max",
            "token_budget",
            "replicas",
            "routing",
        }
        core = {k: v for k, v in value.items() if k in known}
        settings = {k: v for k, v in value.items() if k not in known}
        if "settings" in value:
            raise ValueError("put the adapter's own keys at its top level, not under settings")
        result: AdapterConfig = base_adapter({**core, "settings": settings}, AdapterConfig)
        return result

    conv.register_structure_hook(AdapterConfig, adapter)
    base_replica = conv.get_structure_hook(ReplicaConfig)

    def replica(value: Any, _: type) -> ReplicaConfig:
        if isinstance(value, str):  # a plain base URL
            value = {"url": value}
        result: ReplicaConfig = base_replica(value, ReplicaConfig)
        return result

    conv.register_structure_hook(ReplicaConfig, replica)
    return conv


#: The converter of node.yaml's data into the schema (strict: unknown keys are errors).
CONVERTER = _strict_converter()


def error_lines(exc: Exception, prefix: str = "") -> list[str]:
    """'path: problem' lines from a cattrs error (:func:`~iop_trio.structure.problems`),
    a secret's value hidden."""
    return [
        f"{path}: {_hide_secret(path, message)}" if path else message
        for path, message in problems(exc, prefix)
    ]


#: Keys whose values are secrets: a message about one never shows its value.
SECRET_KEYS = frozenset({"token", "api_key", "password", "secret", "headers"})


def _hide_secret(path: str, message: str) -> str:
    if path.rpartition(".")[2] in SECRET_KEYS or ".headers." in f".{path}.":
        return re.sub(r"(, )?not .*$", r"\1not the value given (hidden: it is a secret)", message)
    return message
