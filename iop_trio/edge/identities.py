"""Who may use the reference edge: callers and nodes, each with a token of its own.

The edge keeps only the tokens' SHA-256 digests (``sha256:<hex>``, made with
:func:`token_digest`; ``iop-node hash-token`` prints one), so a copy of its file
gives nobody a token. Tokens are long random strings, so a plain digest is
enough: nobody can guess one back from it.

A file (YAML) names them::

    limits:                       # every caller's, unless it sets its own (optional)
      requests_per_second: 50     # its requests, all kinds (default 50)
      burst: 100                  # requests it may make at once (default: 2 x the rate)
      max_runs: 64                # its runs through this edge at once (default 64)
    callers:
      alice:
        token_sha256: sha256:9f86d08...
        tenant: team-a            # the tenant of her runs (default: her name)
        targets: [ollama/llama3]  # the targets she may use (default: all)
        max_priority: 5           # the highest priority she may ask for (default: 0)
        may_set_limits: false
        requests_per_second: 200  # her own limits, over the defaults above
        max_runs: 256
    nodes:
      gpu-1:
        token_sha256: sha256:60303ae2...

A caller's runs get ids of its own (``alice:<id>``): a caller sees, reads,
follows and cancels only those, and reusing another caller's id names a run of
its own. A node's token is good for that node id only.

A caller over its rate (a token bucket: ``requests_per_second`` refilled, at most
``burst`` saved) or with ``max_runs`` runs open through the edge is refused
``RATE_LIMITED`` (429 at the OpenAI door) with a hint of when to retry, before
anything is queued or relayed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from ..model import TENANT_NAME, positive_problem

#: A caller's or a node's name.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def token_digest(token: str) -> str:
    """How the edge keeps ``token``: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


#: The keys of a caller's limits in an identities file.
LIMIT_KEYS = frozenset({"requests_per_second", "burst", "max_runs"})


@attrs.frozen
class CallerLimits:
    """How much one caller may ask of the edge: ``requests_per_second`` (refilled) and
    ``burst`` (saved up; None: twice the rate, at least 1) of requests of any kind, and
    ``max_runs`` runs open through the edge at once."""

    requests_per_second: float = 50.0
    burst: float | None = None
    max_runs: int = 64

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst is not None else max(1.0, 2 * self.requests_per_second)


@attrs.frozen
class Caller:
    """Someone who sends runs through the edge, and what they may do."""

    name: str
    tenant: str
    targets: frozenset[str] | None = None  # None: every target
    max_priority: int = 0
    may_set_limits: bool = False
    limits: CallerLimits = CallerLimits()

    @property
    def run_prefix(self) -> str:
        """What every id of this caller's runs starts with."""
        return f"{self.name}:"

    def may_use(self, target: str) -> bool:
        return self.targets is None or target in self.targets


@attrs.frozen
class NodeIdentity:
    """A node, by the id its token is good for."""

    node_id: str


class IdentityError(ValueError):
    """A problem in an identities file; the message names the entry."""


@attrs.define(eq=False)
class Identities:
    """The callers and nodes an edge knows, by token digest."""

    callers: dict[str, Caller] = attrs.field(factory=dict)
    nodes: dict[str, NodeIdentity] = attrs.field(factory=dict)

    def __repr__(self) -> str:
        return f"<Identities callers={len(self.callers)} nodes={len(self.nodes)}>"

    def caller(self, token: str) -> Caller | None:
        found: Caller | None = _find(self.callers, token)
        return found

    def node(self, token: str) -> NodeIdentity | None:
        found: NodeIdentity | None = _find(self.nodes, token)
        return found

    @classmethod
    def from_data(cls, data: Any, *, source: str = "<identities>") -> Identities:
        """Identities from parsed YAML (see the module docstring); IdentityError naming
        ``source`` and the entry for anything wrong."""
        if not isinstance(data, Mapping) or not set(data) <= {"callers", "nodes", "limits"}:
            raise IdentityError(
                f"{source}: the top level has limits, callers and nodes, nothing else"
            )
        found = cls()
        defaults = data.get("limits") or {}
        if not isinstance(defaults, Mapping) or not set(defaults) <= LIMIT_KEYS:
            raise IdentityError(
                f"{source}: limits: a mapping of {', '.join(sorted(LIMIT_KEYS))}, nothing else"
            )
        base = _limits(f"{source}: limits", defaults, CallerLimits())
        for name, entry in (data.get("callers") or {}).items():
            where = f"{source}: callers.{name}"
            entry = _entry(
                where,
                name,
                entry,
                {"tenant", "targets", "max_priority", "may_set_limits", *LIMIT_KEYS},
            )
            tenant = entry.get("tenant", name)
            if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
                raise IdentityError(f"{where}.tenant: not a tenant name: {tenant!r}")
            targets = entry.get("targets")
            if targets is not None and not (
                isinstance(targets, list) and all(isinstance(t, str) for t in targets)
            ):
                raise IdentityError(f"{where}.targets: must be a list of target names")
            priority = entry.get("max_priority", 0)
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise IdentityError(f"{where}.max_priority: must be an integer")
            may_set = entry.get("may_set_limits", False)
            if not isinstance(may_set, bool):
                raise IdentityError(f"{where}.may_set_limits: must be true or false")
            caller = Caller(
                name,
                tenant,
                None if targets is None else frozenset(targets),
                priority,
                may_set,
                _limits(where, entry, base),
            )
            _add(found.callers, found.nodes, entry["token_sha256"], caller, where)
        for name, entry in (data.get("nodes") or {}).items():
            where = f"{source}: nodes.{name}"
            entry = _entry(where, name, entry, set())
            _add(found.nodes, found.callers, entry["token_sha256"], NodeIdentity(name), where)
        return found

    @classmethod
    def load(cls, path: str | Path) -> Identities:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise IdentityError(f"{path}: {exc}") from None
        return cls.from_data(data, source=str(path))


def _limits(where: str, entry: Mapping[str, Any], base: CallerLimits) -> CallerLimits:
    """``base`` with the limit keys ``entry`` sets; IdentityError naming a bad one."""
    changes: dict[str, Any] = {}
    for key in ("requests_per_second", "burst"):
        if key in entry:
            problem = positive_problem(entry[key])
            if problem is not None:
                raise IdentityError(f"{where}.{key}: {problem}")
            changes[key] = float(entry[key])
    if "max_runs" in entry:
        value = entry["max_runs"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise IdentityError(f"{where}.max_runs: must be an integer >= 1, not {value!r}")
        changes["max_runs"] = value
    return attrs.evolve(base, **changes)


def _find(table: Mapping[str, Any], token: str) -> Any:
    digest = token_digest(token)
    for known, who in table.items():  # every entry, so the time says nothing of the match
        if hmac.compare_digest(known, digest):
            return who
    return None


def _entry(where: str, name: object, entry: Any, keys: set[str]) -> dict[str, Any]:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise IdentityError(f"{where}: a name is 1-64 of A-Z a-z 0-9 _ . - ")
    if not isinstance(entry, Mapping):
        raise IdentityError(f"{where}: must be a mapping")
    unknown = set(entry) - keys - {"token_sha256"}
    if unknown:
        raise IdentityError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    digest = entry.get("token_sha256")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise IdentityError(
            f"{where}.token_sha256: must be sha256:<64 hex digits> (iop-node hash-token)"
        )
    return dict(entry)


def _add(
    table: dict[str, Any], other: Mapping[str, Any], digest: str, who: Any, where: str
) -> None:
    if digest in table or digest in other:
        raise IdentityError(f"{where}: the same token as another entry")
    table[digest] = who
