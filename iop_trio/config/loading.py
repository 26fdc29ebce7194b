"""How node.yaml becomes a :class:`~.schema.NodeConfig`: read (:mod:`.yaml_source`),
IOP_* environment overrides applied (:func:`apply_env`), structured and checked across
sections (:func:`structure_config`), its relative paths made relative to the file's
folder (:func:`relative_to`); :func:`load_config` does all of it.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..adapters.registry import default_registry
from ..model import (
    option_rules_problem,
    tenant_problem,
)
from .errors import ConfigError
from .schema import (
    CONVERTER,
    EdgeConfig,
    LoggingConfig,
    MetricsConfig,
    NodeConfig,
    RuntimeConfig,
    StoreConfig,
    TracingConfig,
    adapter_settings,
    error_lines,
)
from .yaml_source import parse_yaml

#: Only variables with this prefix override node.yaml; the standard OTEL_* ones are
#: tracing's own fallbacks (iop_trio.telemetry), never config overrides.
ENV_PREFIX = "IOP_"

#: The sections of node.yaml that are one attrs class each, for IOP_* overrides.
_SECTIONS: dict[str, type[Any]] = {
    "edge": EdgeConfig,
    "store": StoreConfig,
    "runtime": RuntimeConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
    "tracing": TracingConfig,
}


def structure_config(data: Any, *, source: str = "<config>") -> NodeConfig:
    """A NodeConfig from plain data; ConfigError naming ``source`` and the key."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    try:
        config = CONVERTER.structure({**data, "source": source}, NodeConfig)
    except Exception as exc:  # cattrs raises class/iterable validation groups
        raise ConfigError("\n".join(f"{source}: {m}" for m in error_lines(exc))) from None
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
        adapter_settings(registry, name, adapter, src)


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
