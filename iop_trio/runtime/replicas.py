"""An adapter's replicas, sans I/O: the engines one adapter spreads its runs over, and
which of them a run goes to.

**A replica is a pool** below its adapter (:class:`~.tickets.Pool`): its own limit (a
static ``concurrency`` or a learned one) and its own token budget. A granted run holds
a place in its tenant's, target's, adapter's and node's pools and in one replica's; the
adapter's pool still bounds the sum over its replicas. Which replica is decided at the
grant, here, from what the scheduler knows: the runs and tokens each holds, each
engine's own queue and cache use as last scraped, and whether it is *down*.

A replica **fits** a run when it is not down, has room for one more run and its tokens
fit its budget (:meth:`Replica.fits`). A run waits while no replica of its adapter fits
it, as it waits for any other pool. Holders (the scheduler's rule that small runs do
not starve a large one) keep room in the adapter's pool, not in a replica's: a replica's
learned budget never shuts a run out on its own, as no learned budget does.

**Picking**, among the replicas that fit (:data:`PICKERS`, by ``routing``):

- ``least_loaded`` (the default): the least *load*, the runs the node has in flight
  there plus the requests its engine says wait, per unit of ``weight``; then the
  engine's cache use (unknown counts as empty); then the next in turn, so equal
  replicas share. A replica 3x slower holds its runs 3x longer, so it takes a third
  as many (as least-connections balancing does).
- ``prefix``: consistent hashing of the run's *affinity* (a hash of its prompt's
  leading characters, :func:`affinity_of`) on a ring of :data:`RING_POINTS` points per
  unit of weight, so runs sharing a system prompt go to the replica whose engine has
  its prefix cached, and a replica that leaves or comes back moves only its share.
  Load is bounded (Mirrokni, Thorup and Zadimoghaddam's *consistent hashing with
  bounded loads*): walking the ring from the affinity's point, a replica whose runs
  would pass :data:`BOUNDED_LOAD` times the mean (over the replicas up, by weight) is
  passed to the next, so one hot prefix cannot drown a replica. If every replica that
  fits is past that bound, the first on the ring that fits takes it. A run with no
  affinity is picked least loaded.
- ``round_robin``: the first that fits from the one after the last picked.

**Down.** A replica marked down (it refused to connect, timed out, or answered 429 or
503: the shell decides) gets no run until it is cleared; a run already granted there
keeps its place until it ends. A run whose replica failed before its first token may
be moved once to another up that fits now (the scheduler's ``reroute``). While *every*
replica of an adapter is down, runs are granted as if none were: waiting for a probe
would only turn them away at their queue timeout, so they go to an engine, fail as a
lone engine's runs do, and end ``engine_unavailable`` with a retry hint (the node also
says its targets are unavailable, so an edge sends them elsewhere).

Only the model's value types and :mod:`.tickets` are imported: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from ..model import RejectReason
from .tickets import INF, Pool, Refusal, Ticket

#: How an adapter picks among its replicas: the keys of :data:`PICKERS`.
ROUTINGS = ("least_loaded", "prefix", "round_robin")
#: Prefix routing: the most runs a replica takes, as a factor of the mean per weight.
BOUNDED_LOAD = 1.25
#: Prefix routing: points on the ring per unit of a replica's weight.
RING_POINTS = 64
#: The leading characters of a prompt that make its affinity (about 512 tokens: a
#: system prompt and the first messages, what an engine's prefix cache keeps).
PREFIX_CHARS = 2048


def _hash(text: str) -> int:
    """A stable 64-bit hash (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def affinity_of(prompt: str | None, messages: Iterable[tuple[str, str]] = ()) -> int | None:
    """A run's affinity: the hash of the first :data:`PREFIX_CHARS` characters of its
    chat messages (role and content, in order), else of its prompt; None for an empty
    one (nothing to keep together)."""
    parts: list[str] = []
    size = 0
    for role, content in messages:
        parts.append(f"{role}\x1f{content}\x1e")
        size += len(parts[-1])
        if size >= PREFIX_CHARS:
            break
    text = "".join(parts) if parts else (prompt or "")
    if not text:
        return None
    return _hash(text[:PREFIX_CHARS])


@attrs.define(eq=False)
class Replica:
    """One engine of an adapter: its pool, its share (``weight``), whether it is down,
    and its engine's own figures as last scraped (None: not known)."""

    name: str  # its URL without credentials: how metrics and records name it
    pool: Pool
    index: int
    weight: float = 1.0
    down: bool = False
    waiting: float | None = None  # requests its engine says wait
    kv_use: float | None = None  # the share of its engine's KV cache in use

    def __repr__(self) -> str:
        state = " down" if self.down else ""
        return f"<Replica {self.name}{state} weight={self.weight:g} {self.pool!r}>"

    def fits(self, cost: int, *, down_too: bool = False) -> bool:
        """Whether a run reserving ``cost`` tokens may be granted here now (``down_too``:
        were it up)."""
        up = down_too or not self.down
        return up and self.pool.has_room and self.pool.fits_tokens(cost)

    @property
    def load(self) -> float:
        """Runs in flight here and requests its engine says wait, per unit of weight."""
        return (self.pool.running + (self.waiting or 0.0)) / self.weight


Picker = Callable[["ReplicaSet", Sequence[Replica], int | None], Replica]


def _least_loaded(replicas: ReplicaSet, fitting: Sequence[Replica], _: int | None) -> Replica:
    turn = replicas.turn
    count = len(replicas.replicas)
    return min(
        fitting,
        key=lambda r: (r.load, r.kv_use or 0.0, (r.index - turn) % count),
    )


def _prefix(replicas: ReplicaSet, fitting: Sequence[Replica], affinity: int | None) -> Replica:
    if affinity is None:
        return _least_loaded(replicas, fitting, None)
    allowed = {r.index for r in fitting}
    up = [r for r in replicas.replicas if not r.down] or list(replicas.replicas)
    weights = sum(r.weight for r in up)
    running = sum(r.pool.running for r in up)
    per_weight = BOUNDED_LOAD * (running + 1) / weights
    first: Replica | None = None
    for replica in replicas.ring_from(affinity):
        if replica.index not in allowed:
            continue
        if replica.pool.running + 1 <= math.ceil(per_weight * replica.weight):
            return replica
        first = first or replica
    assert first is not None  # fitting is not empty, and the ring holds every replica
    return first


def _round_robin(replicas: ReplicaSet, fitting: Sequence[Replica], _: int | None) -> Replica:
    count = len(replicas.replicas)
    return min(fitting, key=lambda r: (r.index - replicas.turn) % count)


#: The rule of each ``routing``: which of the replicas that fit a run takes it.
PICKERS: Mapping[str, Picker] = {
    "least_loaded": _least_loaded,
    "prefix": _prefix,
    "round_robin": _round_robin,
}


@attrs.frozen
class ReplicaSpec:
    """What configuration says of one replica (None: no bound of its own)."""

    name: str
    limit: int | None = None
    token_budget: int | None = None
    weight: float = 1.0


class ReplicaSet:
    """An adapter's replicas and its routing (module docstring). Not thread-safe."""

    def __init__(self, adapter: str, specs: Sequence[ReplicaSpec], routing: str) -> None:
        if routing not in PICKERS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        if not specs:
            raise ValueError(f"adapter {adapter!r} has no replicas")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter {adapter!r} names a replica twice")
        self.adapter = adapter
        self.routing = routing
        self.replicas = tuple(
            Replica(
                s.name,
                Pool(
                    f"replica:{adapter}@{s.name}",
                    INF if s.limit is None else s.limit,
                    INF if s.token_budget is None else s.token_budget,
                ),
                i,
                _weight(s),
            )
            for i, s in enumerate(specs)
        )
        self.by_name = {r.name: r for r in self.replicas}
        self.by_pool = {id(r.pool): r for r in self.replicas}
        self.turn = 0  # the index the next tie (or round robin) starts from
        points = [
            (_hash(f"{r.name}#{n}"), r.index)
            for r in self.replicas
            for n in range(max(1, round(RING_POINTS * r.weight)))
        ]
        points.sort()
        self._ring = points
        self._keys = [p for p, _ in points]

    def __repr__(self) -> str:
        up = sum(1 for r in self.replicas if not r.down)
        return (
            f"<ReplicaSet {self.adapter} {self.routing} {up}/{len(self.replicas)} up "
            f"runs={sum(r.pool.running for r in self.replicas)}>"
        )

    @property
    def has_room(self) -> bool:
        """Whether some replica up (or any, while all are down) can take one more run
        (its tokens aside)."""
        down_too = self.all_down
        return any((down_too or not r.down) and r.pool.has_room for r in self.replicas)

    @property
    def all_down(self) -> bool:
        return all(r.down for r in self.replicas)

    @property
    def static_budget(self) -> float:
        """The most tokens a run may reserve and still fit some replica on its own."""
        return max(r.pool.static_budget for r in self.replicas)

    def ring_from(self, affinity: int) -> Iterable[Replica]:
        """Each replica once, in ring order from ``affinity``'s point."""
        start = bisect.bisect_left(self._keys, affinity)
        seen: set[int] = set()
        count = len(self._ring)
        for step in range(count):
            index = self._ring[(start + step) % count][1]
            if index not in seen:
                seen.add(index)
                yield self.replicas[index]
                if len(seen) == len(self.replicas):
                    return

    def choose(
        self, cost: int, affinity: int | None = None, *, besides: Replica | None = None
    ) -> Replica | None:
        """The replica the routing picks for a run of ``cost`` and ``affinity`` among
        those that fit it now (``besides`` excluded), or None if none does. While every
        replica is down, a run is picked as if none were (it is what tries them, and
        fails as one engine's would: see the module docstring); a run moved from one
        (``besides``) goes only to a replica up. Changes nothing: :meth:`took` says a
        grant went there."""
        down_too = besides is None and self.all_down
        fitting = [r for r in self.replicas if r is not besides and r.fits(cost, down_too=down_too)]
        if not fitting:
            return None
        return PICKERS[self.routing](self, fitting, affinity)

    def took(self, replica: Replica) -> None:
        """A run was granted ``replica`` (the scheduler counts it in its pool): the next
        tie, or round robin, starts after it."""
        self.turn = (replica.index + 1) % len(self.replicas)

    def too_large(self, cost: int) -> Refusal | None:
        """The refusal of a run reserving ``cost`` tokens that no replica's configured
        budget could ever take, or None."""
        if cost <= self.static_budget:
            return None
        return Refusal(
            RejectReason.TOO_LARGE,
            f"the run reserves {cost} tokens, more than the token_budget of every replica "
            f"of adapter {self.adapter!r}: it could never start",
            None,
        )

    def reroute(self, ticket: Ticket) -> Replica | None:
        """Move granted ``ticket`` from its replica (which failed it before its first
        token) to another that fits it now, its place and tokens with it; None if none
        does (it stays counted where it was)."""
        if not ticket.granted or ticket.replica is None:
            raise RuntimeError(f"{ticket!r} holds no replica to move from")
        other = self.choose(ticket.cost, ticket.affinity, besides=self.of_pool(ticket.replica))
        if other is not None:
            ticket.replica.give_back(ticket.cost)
            other.pool.take(ticket.cost)
            ticket.replica = other.pool
            ticket.at_grant = (*ticket.at_grant[:4], (other.pool.running, other.pool.reserved))
            self.took(other)
        return other

    def of_pool(self, pool: Pool) -> Replica:
        """The replica whose pool ``pool`` is."""
        return self.by_pool[id(pool)]

    def mark(self, name: str, down: bool) -> bool:
        """Mark ``name`` down or clear it; whether that changed anything. KeyError for a
        name that is not a replica here."""
        replica = self.by_name[name]
        changed = replica.down != down
        replica.down = down
        return changed

    def set_signals(self, name: str, waiting: float | None, kv_use: float | None) -> None:
        """``name``'s engine's figures, as last scraped (None: not known)."""
        replica = self.by_name[name]
        replica.waiting, replica.kv_use = waiting, kv_use


def _weight(spec: ReplicaSpec) -> float:
    if not (spec.weight > 0 and math.isfinite(spec.weight)):
        raise ValueError(f"replica {spec.name!r} weight must be a positive number")
    return float(spec.weight)
