"""node.yaml: the node's configuration, validated, with IOP_* environment overrides.

:func:`load_config` reads a YAML file, applies environment overrides, and
structures the result into frozen attrs classes with cattrs. Every problem
raises :class:`ConfigError` whose message names the file and the key path,
e.g. ``node.yaml: runtime.concurrency: must be an integer >= 1, not 0``.

Environment overrides: ``IOP_<PATH>`` where ``__`` separates levels and the
value is read as a YAML scalar, so ``IOP_RUNTIME__CONCURRENCY=16``,
``IOP_EDGE__TOKEN=...``, ``IOP_ADAPTERS__VLLM__API_KEY=...``,
``IOP_NODE_ID=gpu-7``. A variable naming no known key (a typo, or a variable of
some other tool's that starts with ``IOP_``) is ignored, and said once:
:attr:`NodeConfig.warnings`; one naming a key with a bad value is an error.
Targets are a list and are not overridable from the environment.

A YAML mistake is one line naming the line and column where it is, in plain words
(``node.yaml, line 4, column 5: this line is indented more than the one above it``);
a key given twice in one mapping is refused rather than silently replaced.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import stat
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import cattrs
import yaml

from .adapters.base import Adapter
from .adapters.registry import AdapterRegistry, default_registry
from .model import (
    CHARS_PER_TOKEN,
    MAX_OUTPUT_TOKENS,
    TOKENIZERS,
    AutoConcurrency,
    TargetSpec,
    TenantLimits,
    field_check,
    limit_problem,
    option_rules_problem,
    positive_problem,
    seconds_problem,
    tenant_problem,
)
from .runtime import AdapterSlot, RuntimeLimits
from .runtime.tickets import HOLD_AFTER
from .structure import problems, strict_converter
from .transport.tls import client_context

ENV_PREFIX = "IOP_"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key."""


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


@attrs.frozen
class AdapterConfig:
    """One adapter instance. ``settings`` are the kind's own keys (base_url, api_key, ...)."""

    kind: str
    # an integer, or "auto": learned between concurrency_min and concurrency_max
    concurrency: int | str | None = attrs.field(default=None, validator=_concurrency(1))
    max_concurrency: int | None = attrs.field(default=None, validator=_int_at_least(1))
    concurrency_min: int | None = attrs.field(default=None, validator=_int_at_least(1))
    concurrency_max: int | None = attrs.field(default=None, validator=_int_at_least(1))
    token_budget: int | None = attrs.field(default=None, validator=_int_at_least(1))
    settings: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
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
            slots.append(
                AdapterSlot(
                    _make_adapter(registry, name, cfg, self.source),
                    cfg.static_concurrency(),
                    token_budget=cfg.token_budget,
                    auto=cfg.auto(),
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


def _adapter_settings(registry: AdapterRegistry, name: str, cfg: AdapterConfig, source: str) -> Any:
    """The kind's settings object from the adapter's keys; ConfigError naming the key."""
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
    try:
        return _CONVERTER.structure(cfg.settings, settings_type)
    except Exception as exc:  # cattrs raises class validation groups
        lines = _messages(exc, prefix=f"adapters.{name}")
        raise ConfigError("\n".join(f"{source}: {m}" for m in lines)) from None


def _make_adapter(registry: AdapterRegistry, name: str, cfg: AdapterConfig, source: str) -> Adapter:
    settings = _adapter_settings(registry, name, cfg, source)
    return registry.create(cfg.kind, name, settings, max_concurrency=cfg.max_concurrency)


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
        }
        core = {k: v for k, v in value.items() if k in known}
        settings = {k: v for k, v in value.items() if k not in known}
        if "settings" in value:
            raise ValueError("put the adapter's own keys at its top level, not under settings")
        result: AdapterConfig = base_adapter({**core, "settings": settings}, AdapterConfig)
        return result

    conv.register_structure_hook(AdapterConfig, adapter)
    return conv


_CONVERTER = _strict_converter()


def _messages(exc: Exception, prefix: str = "") -> list[str]:
    """'path: problem' lines from a cattrs error (:func:`~iop_trio.structure.problems`),
    a secret's value hidden."""
    return [
        f"{path}: {_hide_secret(path, message)}" if path else message
        for path, message in problems(exc, prefix)
    ]


#: The sections of node.yaml that are one attrs class each, for IOP_* overrides.
_SECTIONS: dict[str, type[Any]] = {
    "edge": EdgeConfig,
    "store": StoreConfig,
    "runtime": RuntimeConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
}

#: Keys whose values are secrets: a message about one never shows its value.
SECRET_KEYS = frozenset({"token", "api_key", "password", "secret", "headers"})


def _hide_secret(path: str, message: str) -> str:
    if path.rpartition(".")[2] in SECRET_KEYS or ".headers." in f".{path}.":
        return re.sub(r"(, )?not .*$", r"\1not the value given (hidden: it is a secret)", message)
    return message


def structure_config(data: Any, *, source: str = "<config>") -> NodeConfig:
    """A NodeConfig from plain data; ConfigError naming ``source`` and the key."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    try:
        config = _CONVERTER.structure({**data, "source": source}, NodeConfig)
    except Exception as exc:  # cattrs raises class/iterable validation groups
        raise ConfigError("\n".join(f"{source}: {m}" for m in _messages(exc))) from None
    _check_references(config)
    return config


def _check_references(config: NodeConfig) -> None:
    src = config.source
    if not config.node_id.strip():
        raise ConfigError(f"{src}: node_id: must not be empty")
    if not config.targets:
        raise ConfigError(f"{src}: targets: a node needs at least one target")
    names: set[str] = set()
    for i, target in enumerate(config.targets):
        if target.adapter not in config.adapters:
            raise ConfigError(
                f"{src}: targets[{i}].adapter: {target.adapter!r} is not one of the "
                f"adapters ({', '.join(sorted(config.adapters)) or 'none configured'})"
            )
        fault = option_rules_problem(target.allow_options or (), target.option_caps)
        if fault is not None:
            raise ConfigError(f"{src}: targets[{i}].{fault[0]}: {fault[1]}")
        name = target.spec().name
        if name in names:
            raise ConfigError(f"{src}: targets[{i}]: target {name!r} is configured twice")
        names.add(name)
    for tenant in config.tenants:
        problem = tenant_problem(tenant)
        if problem is not None:
            raise ConfigError(f"{src}: tenants: {problem}")
    registry = default_registry()
    for name, adapter in config.adapters.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ConfigError(f"{src}: adapters.{name}: names are letters, digits, _ . -")
        _adapter_settings(registry, name, adapter, src)


def apply_env(
    data: dict[str, Any],
    environ: Mapping[str, str],
    *,
    source: str,
    ignored: list[str] | None = None,
) -> dict[str, Any]:
    """``data`` with IOP_* overrides applied (see the module docstring); a variable
    that names no key is left out, with a line saying so appended to ``ignored``."""
    result: dict[str, Any] = _deep_copy(data)
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in _NOT_CONFIG:
            continue
        path = [p.lower() for p in var[len(ENV_PREFIX) :].split("__")]
        if not all(path) or not _known_path(path, result):
            if ignored is not None:
                ignored.append(
                    f"{var} names no configuration key ({'.'.join(path)}); ignored "
                    "(levels are separated by __, e.g. IOP_RUNTIME__CONCURRENCY)"
                )
            continue
        raw = environ[var]
        # a string key takes the text as it is (a token is not YAML); others parse as YAML
        value = raw if _takes_text(path, result) or raw == "" else parse_yaml(raw, var)
        node: dict[str, Any] = result
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{var}: {part} in {source} is not a mapping")
            node = child
        node[path[-1]] = value
    return result


# variables that belong to tools, not to the node's config
_NOT_CONFIG = frozenset({"IOP_SMOKE", "IOP_CONFIG", "IOP_EDGE", "IOP_TOKEN", "IOP_EDGE_TOKEN"})


def _field_type(cls: type[Any], key: str) -> Any:
    try:
        return typing.get_type_hints(cls).get(key)
    except Exception:  # an annotation that does not resolve: no type known
        return None


def _takes_text(path: list[str], data: Mapping[str, Any]) -> bool:
    """Whether the key at ``path`` is a string (or string-or-null) setting."""
    if path == ["node_id"]:
        return True
    if len(path) == 2 and path[0] in _SECTIONS:
        kind = _field_type(_SECTIONS[path[0]], path[1])
    elif len(path) == 3 and path[0] == "adapters":
        adapter = (data.get("adapters") or {}).get(path[1])
        name = adapter.get("kind") if isinstance(adapter, Mapping) else None
        registry = default_registry()
        if not isinstance(name, str) or name not in registry:
            return False
        kind = _field_type(registry.settings_type(name), path[2])
    else:
        return False
    if kind is str:
        return True
    args = typing.get_args(kind)
    return typing.get_origin(kind) in (types.UnionType, typing.Union) and set(args) == {
        str,
        type(None),
    }


def _known_path(path: list[str], data: Mapping[str, Any]) -> bool:
    head = path[0]
    if len(path) == 1:
        return head in {"node_id"}
    if head in _SECTIONS:
        return len(path) == 2 and path[1] in attrs.fields_dict(_SECTIONS[head])
    if head == "adapters":
        # adapters.<name>.<key>: the name must exist; the key is checked against its kind later
        return len(path) == 3 and path[1] in (data.get("adapters") or {})
    return False


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def load_config(
    path: str | os.PathLike[str], environ: Mapping[str, str] | None = None
) -> NodeConfig:
    """Read, override from the environment (``os.environ`` by default), validate."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{source}, line {line}: not UTF-8 text") from None
    data = parse_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    ignored: list[str] = []
    data = apply_env(
        data, os.environ if environ is None else environ, source=source, ignored=ignored
    )
    config = relative_to(structure_config(data, source=source), Path(path).resolve().parent)
    return attrs.evolve(config, warnings=tuple(ignored)) if ignored else config


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, but a key given twice in one mapping is an error: the
    second would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in lines:
                    problem = f"{key!r} @{lines[key]}"  # the line of the first, for the words
                    raise yaml.constructor.ConstructorError(
                        "duplicate key", None, problem, key_node.start_mark
                    )
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


#: YAML syntax errors in plain words: (a pattern searched in the parser's "context:
#: problem", the place to name, the words, with {0}... the pattern's groups). The place
#: is the parser's ``problem`` mark or its ``context`` mark (where the open quote,
#: bracket or key began), or is worked out from the text (:func:`_yaml_problem`):
#: ``colon``, a ':' after a value began (the line is indented too far, or the line
#: above has no ':', or a value holds ': '); ``block``, something else where the next
#: key should be (a line that does not line up, or text after a value).
_YAML_PROBLEMS: tuple[tuple[str, str, str], ...] = (
    (r"found character '\\t'", "problem", "a tab is not allowed for indenting; use spaces"),
    (r"character '(.)' that cannot start", "problem", "a value cannot start with '{0}'; quote it"),
    (r"quoted scalar: found unexpected end", "context", "an unclosed quote starts here"),
    (r"unknown escape character '(.*)'", "problem", "'\\{0}' is no escape; use '...' quotes"),
    (r"could not find expected ':'", "context", "a ':' is missing after the key"),
    (r"mapping values are not allowed", "colon", ""),
    (r"flow sequence: expected ','", "context", "this '[' is not closed, or an item has no ','"),
    (r"flow mapping: expected ','", "context", "this '{{' is not closed, or an item has no ','"),
    (r"<block end>, but found '-'", "problem", "a '- ' item where a key should be"),
    (r"expected <block end>", "block", ""),
    (r"undefined alias '(.*)'", "problem", "'*{0}' names no anchor; quote a value with '*'"),
    (r"^duplicate key: (.*) @(\d+)", "problem", "{0} is given twice (first on line {1})"),
    (r"found another document", "problem", "a second document ('---'); a config is one"),
    (r"for the tag '(.*)'", "problem", "unknown tag '{0}'; quote a value that starts with '!'"),
    (r"found '<stream end>'", "problem", "the text ends inside a '[' or '{{' that is not closed"),
    (r"sequence entries are not", "problem", "a '- ' item cannot follow a key on its line"),
    (r"node content, but found '(.*)'", "problem", "'{0}' where a value should be"),
)


def parse_yaml(text: str, source: str) -> Any:
    """``text`` parsed as YAML; a syntax error is one line naming the line and column
    where the mistake is, in plain words (:data:`_YAML_PROBLEMS`); a key given twice in
    one mapping is an error too."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        line, column, words = _yaml_problem(exc, text.splitlines())
        raise ConfigError(f"{source}, line {line + 1}, column {column + 1}: {words}") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{source}, line {line}: a character YAML does not allow") from None


def _content(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _yaml_problem(exc: yaml.MarkedYAMLError, lines: list[str]) -> tuple[int, int, str]:
    """(line, column, words) for ``exc``, the line and column from 0."""
    said = f"{exc.context or ''}: {exc.problem or ''}"
    place, words = "problem", f"not valid YAML: {exc.problem}"  # one we have no words for
    for pattern, where, says in _YAML_PROBLEMS:
        if found := re.search(pattern, said):
            place, words = where, says.format(*found.groups())
            break
    mark = (exc.context_mark if place == "context" else None) or exc.problem_mark
    assert mark is not None  # PyYAML marks every problem it raises, as _Loader does
    line, column = mark.line, mark.column

    def text(at: int) -> str:
        return lines[at] if 0 <= at < len(lines) else ""

    def indent(at: int) -> int:
        return len(text(at)) - len(text(at).lstrip())

    if place == "colon" and ": " in text(line)[:column]:
        words = "a value holds ': '; put the value in quotes"
    elif place == "block" and column != indent(line):
        words = "unexpected text after the value; put the whole value in quotes"
    elif place in ("colon", "block"):  # this line is not where a key may be: say why
        above = next((i for i in range(line - 1, -1, -1) if _content(text(i))), -1)
        column = indent(line)
        if above >= 0 and not re.search(r":(\s|$)|^\s*- ", text(above)):
            line, column, words = above, indent(above), "a ':' is missing after the key"
        elif above >= 0 and column > len(text(above)) - len(text(above).lstrip(" -")):
            words = "this line is indented more than the one above it"
        else:
            words = "this line does not line up with the lines above it; check the indentation"
    return line, column, words


#: The settings that name files: a relative one is relative to the config file's folder.
PATH_KEYS: Mapping[str, tuple[str, ...]] = {
    "store": ("path",),
    "edge": ("token_file", "ca_file", "cert_file", "key_file"),
    "metrics": ("token_file",),
}


def relative_to(config: NodeConfig, folder: Path) -> NodeConfig:
    """``config`` with every relative file path in it made relative to ``folder`` (the
    config file's), so a command run from another folder finds the same files."""
    changes: dict[str, Any] = {}
    for section, keys in PATH_KEYS.items():
        current = getattr(config, section)
        fixed = {
            key: str(folder / value)
            for key in keys
            if isinstance(value := getattr(current, key), str)
            and value
            and not os.path.isabs(value)
            and not (section == "store" and value == ":memory:")
        }
        if fixed:
            changes[section] = attrs.evolve(current, **fixed)
    return attrs.evolve(config, **changes) if changes else config
