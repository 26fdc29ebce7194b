"""node.yaml: the node's configuration, validated, with IOP_* environment overrides.

:func:`load_config` reads a YAML file, applies environment overrides, and
structures the result into frozen attrs classes with cattrs. Every problem
raises :class:`ConfigError` whose message names the file and the key path,
e.g. ``node.yaml: runtime.concurrency: must be an integer >= 1, not 0``.

Environment overrides: ``IOP_<PATH>`` where ``__`` separates levels and the
value is read as a YAML scalar, so ``IOP_RUNTIME__CONCURRENCY=16``,
``IOP_EDGE__TOKEN=...``, ``IOP_ADAPTERS__VLLM__API_KEY=...``,
``IOP_NODE_ID=gpu-7``, ``IOP_TRACING__EXPORTER=console``. Only ``IOP_*`` variables
are read here: the standard ``OTEL_*`` ones are tracing's fallbacks
(:mod:`iop_trio.telemetry`), never config overrides. A variable naming no known key
(a typo, or a variable of some other tool's that starts with ``IOP_``) is ignored, and
said once:
:attr:`NodeConfig.warnings`; one naming a key with a bad value is an error.
Targets are a list and are not overridable from the environment.

A YAML mistake is one line naming the line and column where it is, in plain words
(``node.yaml, line 4, column 5: this line is indented more than the one above it``);
a key given twice in one mapping is refused rather than silently replaced.

The package: :mod:`.schema` (the sections, their checks, the converter, what they
build), :mod:`.loading` (environment overrides, structuring, cross-section checks,
paths), :mod:`.yaml_source` (strict YAML, its errors in words) and :mod:`.errors`.
"""

from .errors import ConfigError
from .loading import ENV_PREFIX, PATH_KEYS, apply_env, load_config, relative_to, structure_config
from .schema import (
    SECRET_KEYS,
    TRACE_EXPORTERS,
    TRACE_SAMPLERS,
    AdapterConfig,
    EdgeConfig,
    LoggingConfig,
    MetricsConfig,
    NodeConfig,
    RuntimeConfig,
    StoreConfig,
    TargetConfig,
    TenantConfig,
    TracingConfig,
    endpoint_problem,
    is_loopback,
    ratio_problem,
    read_secret_file,
    split_listen,
)
from .yaml_source import parse_yaml

__all__ = [
    "ENV_PREFIX",
    "PATH_KEYS",
    "SECRET_KEYS",
    "TRACE_EXPORTERS",
    "TRACE_SAMPLERS",
    "AdapterConfig",
    "ConfigError",
    "EdgeConfig",
    "LoggingConfig",
    "MetricsConfig",
    "NodeConfig",
    "RuntimeConfig",
    "StoreConfig",
    "TargetConfig",
    "TenantConfig",
    "TracingConfig",
    "apply_env",
    "endpoint_problem",
    "is_loopback",
    "load_config",
    "parse_yaml",
    "ratio_problem",
    "read_secret_file",
    "relative_to",
    "split_listen",
    "structure_config",
]
