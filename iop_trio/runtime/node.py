"""The node: adapters, targets, the gate, the store and one nursery for every run.

::

    node = Node(node_id="n1", adapters=[AdapterSlot(EchoAdapter())],
                targets=[TargetSpec("echo", "m", concurrency=2)], store=MemoryStore())
    async with node.running():
        submitted = await node.manager.submit(RunSpec("echo/m", "hi"))

The node knows nothing of transports: sessions call :attr:`Node.manager` and
:meth:`Node.set_limits` and read :meth:`Node.describe`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TypeVar

import attrs
import trio
from opentelemetry.trace import TracerProvider

from .. import __version__
from ..adapters.base import Adapter, AdapterError, AdapterRequest
from ..model import (
    CHARS_PER_TOKEN,
    MAX_OUTPUT_TOKENS,
    AdapterInfo,
    AutoConcurrency,
    InvalidRequest,
    Limits,
    NodeInfo,
    RunEvent,
    RunRecord,
    TargetSpec,
    TenantLimits,
    check_limit,
    check_seconds,
    check_tenant_limits,
    field_check,
    option_rules_problem,
    positive_problem,
)
from ..store.base import RunStore
from ..tracing import get_tracer
from .gate import Gate, Permit
from .learning import CapacityLearner
from .manager import RunManager, notify
from .pipeline import ReplicaEngines
from .replica_health import ReplicaHealth, ask_models
from .replicas import ReplicaSpec
from .spans import RunTracer
from .tickets import HOLD_AFTER, Pool

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The prompt of a probe run (:meth:`Node.probe_engines`): any will do, for one token.
PROBE_PROMPT = "Hi"


@attrs.frozen
class RuntimeLimits:
    """Node-wide settings. ``queue_timeout`` 0 rejects at once when there is no capacity.

    ``max_prompt_bytes``, ``max_output_bytes`` and ``max_run_time`` bound each
    run of a target that sets none of its own (None: no bound); see
    :class:`~iop_trio.model.TargetSpec`. A store that cannot write for
    ``store_grace`` seconds stops the running runs (FAILED ``store_unavailable``), and
    a run not stored within ``store_grace`` seconds is refused (StoreUnavailable) and
    never stored.
    ``tenants`` sets the share of each tenant named (others: weight 1, no bounds).
    ``early_reject`` rejects a run at once when its estimated queue wait already
    exceeds its queue timeout (see :class:`~iop_trio.runtime.gate.Gate`).
    ``probe_interval``: every so many seconds the node asks each engine which
    models it serves (:meth:`Node.probe_engines`); None never asks.
    ``chars_per_token``: the estimate of a run's prompt tokens where its engine reports
    none (:func:`~iop_trio.model.estimate_prompt_tokens`).
    """

    concurrency: int = 8
    max_queued: int = 1000
    queue_timeout: float = 30.0
    final_write_timeout: float = 10.0
    max_prompt_bytes: int | None = 4 * 1024 * 1024
    max_output_bytes: int | None = 16 * 1024 * 1024
    max_run_time: float | None = 3600.0
    store_grace: float = 10.0
    tenants: Mapping[str, TenantLimits] = attrs.field(factory=dict)
    early_reject: bool = False
    probe_interval: float | None = None
    #: the most tokens all runs reserve at once (None: no budget); the most output a run
    #: reserves when nothing else says; how long a run lacking tokens may be passed
    token_budget: int | None = None
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    hold_after: float = HOLD_AFTER
    chars_per_token: float = attrs.field(
        default=CHARS_PER_TOKEN, validator=field_check(positive_problem)
    )


@attrs.frozen
class ReplicaSlot:
    """One engine of an adapter with replicas: its own adapter instance (the adapter's
    name and settings, its own URL), named by its URL less credentials, and its bounds."""

    adapter: Adapter
    name: str
    concurrency: int | None = None
    token_budget: int | None = None
    weight: float = 1.0
    auto: AutoConcurrency | None = None  # a learned concurrency instead of ``concurrency``


@attrs.frozen
class AdapterSlot:
    """An adapter instance and its configured limit (None = only its capability's, if any).
    With ``replicas``, ``adapter`` is the first's, and each run goes to one of them
    (picked by ``routing``: :mod:`.replicas`)."""

    adapter: Adapter
    concurrency: int | None = None
    token_budget: int | None = None
    auto: AutoConcurrency | None = None  # a learned concurrency instead of ``concurrency``
    replicas: tuple[ReplicaSlot, ...] = ()
    routing: str = "least_loaded"


def _either(own: T | None, default: T | None) -> T | None:
    return default if own is None else own


class Node:
    """One inference node, keeping its runs in ``store``.

    Configuration errors raise ValueError from the constructor. Its runs' spans
    (:mod:`.spans`) are made by ``tracer_provider`` (None: the global provider, which
    makes none until one is installed).
    """

    def __init__(
        self,
        *,
        node_id: str,
        adapters: Sequence[AdapterSlot | Adapter],
        targets: Sequence[TargetSpec],
        store: RunStore,
        limits: RuntimeLimits | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.node_id = node_id
        #: what makes its runs' spans: ``tracer_provider``'s tracer, else the global
        #: provider's (a no-op until one is installed: then runs have no spans)
        self.tracer = get_tracer(tracer_provider)
        self.version = __version__
        self.runtime = limits or RuntimeLimits()
        self.store = store
        #: the pools whose concurrency is learned (``concurrency: auto``), by pool name
        self.auto: dict[str, tuple[AutoConcurrency, Pool]] = {}
        #: what learns each of them while the node runs, by pool name
        self.learners: dict[str, CapacityLearner] = {}
        self.gate = Gate(
            concurrency=self.runtime.concurrency,
            max_queued=self.runtime.max_queued,
            queue_timeout=self.runtime.queue_timeout,
            early_reject=self.runtime.early_reject,
            token_budget=self.runtime.token_budget,
            hold_after=self.runtime.hold_after,
        )
        for name, share in self.runtime.tenants.items():
            self.gate.set_tenant(name, share)
        self._adapters: dict[str, Adapter] = {}
        #: each adapter with replicas: its replicas' adapters, by replica name
        self.replicas: dict[str, dict[str, Adapter]] = {}
        self._replica_pools: dict[str, tuple[str, str]] = {}  # pool name: adapter, replica
        for slot in adapters:
            self._add_adapter(slot if isinstance(slot, AdapterSlot) else AdapterSlot(slot))
        self.replica_health = ReplicaHealth(self.gate, self.replicas)
        self.targets: dict[str, TargetSpec] = {}
        for target in targets:
            self._add_target(target)
        self._manager: RunManager | None = None
        self.started = trio.Event()
        #: target name -> why its engine cannot serve it now (absent: available, or
        #: not probed yet); see :meth:`probe_engines`
        self.unavailable: dict[str, str] = {}
        # what the last probe of the lists of models found (target -> why), and the
        # targets whose engine did not answer a run in time (target -> why), with when
        # each target was last marked so or cleared (trio time); unavailable is both
        self._unlisted: dict[str, str] = {}
        self._hung: dict[str, str] = {}
        self._hung_changed: dict[str, float] = {}
        self._description = 0  # counts changes to what describe() says
        self._described = trio.Event()
        # called with (event, record) for every run event, by every RunManager this node starts
        self.event_listeners: list[Callable[[RunEvent, RunRecord], None]] = []

    def _add_adapter(self, slot: AdapterSlot) -> None:
        """Register ``slot``'s adapter and its pool in the gate; ValueError for a name
        taken. A learned pool starts at its bound and counts tokens too."""
        name = slot.adapter.name
        if name in self._adapters:
            raise ValueError(f"two adapters are named {name!r}")
        self.gate.add_adapter(
            name,
            slot.concurrency if slot.auto is None else slot.auto.maximum,
            max_concurrency=slot.adapter.capabilities.max_concurrency,
            token_budget=slot.token_budget,
        )
        self._adapters[name] = slot.adapter
        if slot.auto is not None:
            pool = self.gate.adapter_pool(name)
            pool.counts_tokens = True  # its capacity is learned in tokens too
            self.auto[pool.name] = (slot.auto, pool)
        if slot.replicas:
            self._add_replicas(name, slot)

    def _add_replicas(self, name: str, slot: AdapterSlot) -> None:
        """Register ``slot``'s replicas in the gate, each a pool below its adapter's, one
        learning its own concurrency where it is ``auto``."""
        specs = [
            ReplicaSpec(
                r.name,
                r.concurrency if r.auto is None else r.auto.maximum,
                r.token_budget,
                r.weight,
            )
            for r in slot.replicas
        ]
        replicas = self.gate.add_replicas(name, specs, slot.routing)
        self.replicas[name] = {r.name: r.adapter for r in slot.replicas}
        for config, replica in zip(slot.replicas, replicas.replicas, strict=True):
            self._replica_pools[replica.pool.name] = (name, replica.name)
            if config.auto is not None:
                replica.pool.counts_tokens = True
                self.auto[replica.pool.name] = (config.auto, replica.pool)

    def _add_target(self, target: TargetSpec) -> None:
        """Register ``target`` and its lane in the gate; ValueError for a name taken or an
        adapter not configured. A learned pool starts at its bound and counts tokens."""
        if target.name in self.targets:
            raise ValueError(f"target {target.name!r} is configured twice")
        if target.adapter not in self._adapters:
            raise ValueError(
                f"target {target.name!r} names adapter {target.adapter!r}, "
                f"which is not configured (have: {', '.join(sorted(self._adapters))})"
            )
        self.gate.add_target(
            target.name,
            adapter=target.adapter,
            limit=target.concurrency if target.auto is None else target.auto.maximum,
            max_queued=target.max_queued,
            queue_timeout=target.queue_timeout,
            token_budget=target.token_budget,
        )
        if target.auto is not None:
            pool = self.gate.target_pool(target.name)
            pool.counts_tokens = True  # its capacity is learned in tokens too
            self.auto[pool.name] = (target.auto, pool)
        self.targets[target.name] = self._bounded(target)

    def adapter_of_pool(self, name: str) -> Adapter:
        """The adapter of a pool named ``adapter:NAME``, ``target:NAME`` or (a replica's)
        ``replica:ADAPTER@URL``."""
        if name in self._replica_pools:
            adapter, replica = self._replica_pools[name]
            return self.replicas[adapter][replica]
        kind, _, which = name.partition(":")
        return self._adapters[which if kind == "adapter" else self.targets[which].adapter]

    def run_ended(self, permit: Permit, ttft: float, tpot: float | None) -> None:
        """A run succeeded: its latency feeds the learners of the pools it took from."""
        for learner in self.learners.values():
            learner.run_ended(permit, tpot)

    def first_token(self, permit: Permit, ttft: float) -> None:
        """A run had its first token: its TTFT feeds the learners of its pools."""
        for learner in self.learners.values():
            learner.first_token(permit, ttft)

    def _bounded(self, target: TargetSpec) -> TargetSpec:
        """``target`` with the node's run bounds where it sets none of its own, and its
        adapter's caller options if it names none; ValueError for an option it lets
        callers set that is pinned, or a cap that is not a number > 0."""
        r = self.runtime
        allow = target.allow_options
        if allow is None:
            allow = self._adapters[target.adapter].caller_options
        fault = option_rules_problem(allow, target.option_caps)
        if fault is not None:
            raise ValueError(f"target {target.name!r}: {fault[0]}: {fault[1]}")
        return attrs.evolve(
            target,
            max_prompt_bytes=_either(target.max_prompt_bytes, r.max_prompt_bytes),
            max_output_bytes=_either(target.max_output_bytes, r.max_output_bytes),
            max_run_time=_either(target.max_run_time, r.max_run_time),
            allow_options=allow,
            chars_per_token=_either(target.chars_per_token, r.chars_per_token),
            max_output_tokens=_either(target.max_output_tokens, r.max_output_tokens),
        )

    def __repr__(self) -> str:
        state = "running" if self._manager is not None else "idle"
        return f"<Node {self.node_id!r} {state} targets={len(self.targets)} {self.gate!r}>"

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        return self._adapters

    @property
    def is_running(self) -> bool:
        return self._manager is not None

    async def _tell_listeners(self, events: Sequence[RunEvent]) -> None:
        for event in events:
            record = await self.store.get(event.run_id)
            if record is not None:
                notify(self.event_listeners, event, record)

    @property
    def manager(self) -> RunManager:
        """The run manager; RuntimeError before :meth:`running` has started the node."""
        if self._manager is None:
            raise RuntimeError("the node is not running; use `async with node.running()`")
        return self._manager

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Node]:
        """Run the node for the body of the ``async with``.

        On entry, runs the store left QUEUED or RUNNING become INTERRUPTED. On
        exit the node stops admitting, cancels every live run (CANCELLED,
        reason ``node_shutdown``), waits for their final status to be recorded
        and closes the adapters. Use :meth:`RunManager.drain` first for a
        graceful stop. An exception from the body propagates as itself.
        """
        if self._manager is not None:
            raise RuntimeError("the node is running already")
        try:
            async with trio.open_nursery() as nursery:
                await self._interrupt_unfinished()
                manager = self._manager = self._start_manager(nursery)
                self.started.set()
                if self.runtime.probe_interval and any(a.probed for a in self._adapters.values()):
                    nursery.start_soon(self._probe_loop, self.runtime.probe_interval)
                try:
                    yield self
                finally:
                    manager.shut_down()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # run tasks never raise, so a lone exception is the body's own
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            self._manager = None  # it may run again; the gate and the store carry over
            with trio.CancelScope(shield=True):
                others = [a for r in self.replicas.values() for a in r.values()]
                for adapter in {id(a): a for a in [*self._adapters.values(), *others]}.values():
                    try:
                        await adapter.aclose()
                    except Exception:
                        log.exception("closing adapter %s failed", adapter.name)

    async def _interrupt_unfinished(self) -> None:
        """Mark the runs the store left QUEUED or RUNNING INTERRUPTED, and tell listeners."""
        interrupted = await self.store.interrupt_unfinished(
            time=time.time(),
            message="the node stopped while the run was live",
            chars_per_token=self.runtime.chars_per_token,
        )
        if interrupted:
            log.warning("marked %d unfinished runs INTERRUPTED", len(interrupted))
            await self._tell_listeners(interrupted)

    def _start_manager(self, nursery: trio.Nursery) -> RunManager:
        """The run manager of this run of the node, in ``nursery``, and a learner there for
        each pool whose concurrency is learned."""
        manager = RunManager(
            nursery=nursery,
            gate=self.gate,
            store=self.store,
            adapters=self._adapters,
            targets=self.targets,
            final_write_timeout=self.runtime.final_write_timeout,
            store_grace=self.runtime.store_grace,
            listeners=self.event_listeners,
            engine_answered=self._run_answered,
            run_ended=self.run_ended if self.auto else None,
            first_token=self.first_token if self.auto else None,
            chars_per_token=self.runtime.chars_per_token,
            tracer=RunTracer(self.tracer, self.node_id, self._adapters),
            replicas=ReplicaEngines(self.replicas, self._replica_answered)
            if self.replicas
            else None,
        )
        for name, (auto, pool) in self.auto.items():
            learner = CapacityLearner(name, auto, pool, self.adapter_of_pool(name), self.gate)
            learner.in_engine = manager.in_engine
            learner.engine_gaps = manager.engine_gaps
            learner.steps_back = manager.runs
            if name in self._replica_pools:  # its scrapes steer least_loaded routing too
                learner.scraped = partial(self.gate.set_replica_signals, *self._replica_pools[name])
            self.learners[name] = learner
            nursery.start_soon(learner.run)
        return manager

    def _replica_answered(self, adapter: str, replica: str, why: str | None) -> None:
        """A replica failed a run before its first token (``why``) or streamed one."""
        before = self.replica_health.changes
        self.replica_health.answered(adapter, replica, why)
        if self.replica_health.changes != before:
            self._note_unavailable()

    # --- limits --------------------------------------------------------------------------

    def limits(self) -> Limits:
        stats = self.gate.statistics()
        return Limits(
            concurrency=int(stats.global_.limit),
            max_queued=stats.max_queued,
            queue_timeout=stats.queue_timeout,
            adapters={name: self.gate.adapter_limit(name) for name in self._adapters},
            targets={name: int(s.limit) for name, s in stats.targets.items()},
            tenants=self.gate.tenants(),
        )

    def set_limits(
        self,
        *,
        concurrency: int | None = None,
        max_queued: int | None = None,
        queue_timeout: float | None = None,
        adapters: Mapping[str, int | None] | None = None,
        targets: Mapping[str, int] | None = None,
        tenants: Mapping[str, TenantLimits] | None = None,
    ) -> Limits:
        """Change limits at runtime (None / absent leaves a limit as it is); returns those in force.

        Everything is checked before anything changes: an unknown adapter or
        target, or a value that is not a limit, raises InvalidRequest and
        nothing is changed. Lowering a limit lets holders finish; raising it
        admits waiting runs at once. Each tenant in ``tenants`` gets that share
        (all of it: a bound left out is no bound); any name may be given.
        """
        adapters = dict(adapters or {})
        targets = dict(targets or {})
        tenants = dict(tenants or {})
        unknown = [f"adapter {n!r}" for n in adapters if n not in self._adapters]
        unknown += [f"target {n!r}" for n in targets if n not in self.targets]
        if unknown:
            raise InvalidRequest(f"unknown {', '.join(unknown)}")
        try:
            for what, value in (
                [("concurrency", concurrency), ("max_queued", max_queued)]
                + [(f"target {n!r}", v) for n, v in targets.items()]
                + [(f"adapter {n!r}", v) for n, v in adapters.items()]
            ):
                if value is not None:
                    check_limit(what, value)
            if queue_timeout is not None:
                check_seconds("queue_timeout", queue_timeout)
            for name, share in tenants.items():
                check_tenant_limits(name, share)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self.gate.set_queue(max_queued=max_queued, queue_timeout=queue_timeout)
        for name, limit in adapters.items():
            self.gate.set_adapter_limit(name, limit)
        for name, tlimit in targets.items():
            self.gate.set_target_limit(name, tlimit)
        for name, share in tenants.items():
            self.gate.set_tenant(name, share)
        if concurrency is not None:
            self.gate.set_global_limit(concurrency)
        return self.limits()

    # --- engine probes -------------------------------------------------------------------

    async def probe_engines(self) -> dict[str, str]:
        """Ask every engine which models it serves (all at once); return and keep
        :attr:`unavailable`: each target whose engine could not be reached, or does not
        serve its model, or did not answer a run in time, with why. An adapter that
        asks nothing (echo) serves all.

        A target whose engine did not answer a run in time (see :meth:`_run_answered`)
        is asked, meanwhile, for the smallest generation it allows
        (:meth:`Adapter.probe_generation`: one token, bounded by the adapter); only
        such targets are, so a healthy engine is asked for nothing but its list. One
        that answers is available again (if its list says so too); one that does not
        stays unavailable for the reason it was marked with.

        A change is logged once (a warning when a target goes, info when it comes
        back) and wakes :meth:`wait_described`, so an edge link can tell its edge.
        Each engine's answer is bounded by its adapter (``HEALTH_TIMEOUT``).
        """
        answers: dict[str, frozenset[str] | AdapterError | None] = {}
        answered: list[tuple[str, float]] = []  # marked targets whose probe run worked
        used = {t.adapter for t in self.targets.values()}
        async with trio.open_nursery() as nursery:
            for name, adapter in self._adapters.items():
                if name in used and name not in self.replicas:
                    nursery.start_soon(ask_models, name, adapter, answers)
            for name in self._hung:
                nursery.start_soon(self._try_probe_run, self.targets[name], answered)
            if self.replicas:  # each replica: its list, and its down mark
                answers.update(await self.replica_health.probe())
        self._unlisted = {
            name: why
            for name, target in self.targets.items()
            if (why := self._why_unlisted(target, answers[target.adapter])) is not None
        }
        for name, sent in answered:
            self._mark_hung(name, sent, None)
        self._note_unavailable()
        return dict(self.unavailable)

    async def _try_probe_run(self, target: TargetSpec, answered: list[tuple[str, float]]) -> None:
        """Ask ``target``'s engine for its smallest generation; note when it was sent in
        ``answered`` if it answered."""
        sent = trio.current_time()
        request = AdapterRequest(
            run_id=f"probe:{target.name}",
            model=target.model,
            prompt=PROBE_PROMPT,
            params=target.params_for({}),
        )
        try:
            await self._adapters[target.adapter].probe_generation(request)
        except AdapterError as exc:
            log.debug("target %s: its probe run failed: %s", target.name, exc.message)
        else:
            answered.append((target.name, sent))

    def _why_unlisted(
        self, target: TargetSpec, answer: frozenset[str] | AdapterError | None
    ) -> str | None:
        """Why ``target`` is unavailable by its engine's list of models, or None."""
        if isinstance(answer, AdapterError):
            return f"engine unreachable: {answer.message}"
        if answer is not None and not self._adapters[target.adapter].serves(target.model, answer):
            shown = ", ".join(sorted(answer)[:10]) or "none"
            return f"the engine does not serve model {target.model!r} ({shown})"
        return None

    def _run_answered(self, target: str, sent: float, error: AdapterError | None) -> None:
        """What a run (sent at ``sent``, trio time) found of its target's engine: one that
        got no answer in time (:attr:`AdapterError.unresponsive`: a connect or read
        timeout) marks the target unavailable, one that succeeded clears the mark.

        Only with probes (``probe_interval``) and for probed adapters: no run is routed
        to a marked target, so a probe must try it again (see :meth:`probe_engines`).
        Other failures change nothing (an engine that answers with an error is
        answering; a dead one fails its list probe, ``run_timeout`` is the run's own
        bound). A healthy target's run costs one lookup here."""
        if self.targets[target].adapter in self.replicas:
            return  # its replicas are marked, not it (ReplicaHealth)
        if error is None:
            if target not in self._hung:
                return
            why = None
        elif error.unresponsive and target not in self._hung:
            why = f"its engine did not answer a run in time: {error.message}"
        else:
            return
        probed = self._adapters[self.targets[target].adapter].probed
        if self.runtime.probe_interval and probed and self._mark_hung(target, sent, why):
            self._note_unavailable()

    def _mark_hung(self, target: str, sent: float, why: str | None) -> bool:
        """Mark ``target``'s engine as not answering runs (``why``), or clear the mark
        (None), for what a run sent at ``sent`` found; True if that changed it.

        A run sent before the target was last marked or cleared is ignored: it was in
        flight across the change and says nothing of the engine since (a long stream
        that ends well after another run got no answer; a run the engine took before
        it recovered, timing out after a probe found it well), so the mark cannot flap
        back and forth with runs that overlap."""
        if sent < self._hung_changed.get(target, -math.inf):
            return False
        if why is None and target in self._hung:
            del self._hung[target]
        elif why is not None and target not in self._hung:
            self._hung[target] = why
        else:
            return False
        self._hung_changed[target] = trio.current_time()
        return True

    def _note_unavailable(self) -> None:
        """Make :attr:`unavailable` what the probes and the runs found: a target whose
        list says it is not served, else one whose runs get no answer, with why."""
        down = self.replica_health.all_down
        unavailable = {
            name: why
            for name, target in self.targets.items()
            if (why := down(target.adapter) or self._unlisted.get(name) or self._hung.get(name))
        }
        if unavailable == self.unavailable:
            return
        for name in self.targets:
            before, now = self.unavailable.get(name), unavailable.get(name)
            if now is not None and now != before:
                log.warning("target %s is unavailable: %s", name, now)
            elif now is None and before is not None:
                log.info("target %s is available again", name)
        self.unavailable = unavailable
        self._description += 1
        self._described.set()
        self._described = trio.Event()

    async def wait_described(self, seen: int) -> int:
        """Wait until what :meth:`describe` says has changed since version ``seen``
        (:attr:`description`), and return the version now."""
        while self._description == seen:
            await self._described.wait()
        return self._description

    @property
    def description(self) -> int:
        """The version of what :meth:`describe` says (it grows with each change)."""
        return self._description

    async def _probe_loop(self, interval: float) -> None:
        while True:
            await self.probe_engines()
            await trio.sleep(interval)

    def describe(self) -> NodeInfo:
        """What the node tells an edge in its Hello."""
        return NodeInfo(
            node_id=self.node_id,
            version=self.version,
            targets=tuple(self.targets.values()),
            adapters=tuple(
                AdapterInfo(
                    name=name,
                    kind=adapter.kind,
                    concurrency=self.gate.adapter_limit(name),
                    capabilities=adapter.capabilities,
                )
                for name, adapter in self._adapters.items()
            ),
            limits=self.limits(),
            unavailable=dict(self.unavailable),
        )
