"""The run manager: starts every run in the node-wide nursery and sees it to one end.

Life of a run (one task each, started with ``nursery.start``):

1. The QUEUED record and its event are written to the store; only then is
   the submitter told the run exists (``start`` returns). A run the
   :class:`Gate` has room for takes its permit first and writes STARTED in
   the same write; the others enter the gate once written, in the order they
   came, and are REJECTED, admitted, or wait in it as data (no task) until
   granted, their deadline or a cancel.
2. Inside the run's own CancelScope: STARTED (unless written with QUEUED),
   the adapter's stream as DELTA events, and the adapter's end.
3. The terminal event (SUCCEEDED, FAILED, CANCELLED or REJECTED) is made and
   written under a shielded scope bounded by ``final_write_timeout``; that of a
   run that started carries its usage (see :meth:`RunManager._finish`).

A live run's phase moves along :data:`~.live.PHASE_MOVES` (see :mod:`.live`); the
chunks-to-deltas relay is :mod:`.pipeline`'s, what a run reserves :mod:`.reservation`'s.
Foreground and background runs take exactly this path; the only difference
is that :meth:`RunManager.abandon` cancels the foreground runs of an owner
(a lost session). A run task never raises into the nursery: any failure ends
the run FAILED(internal) and is logged.
"""

from __future__ import annotations

import collections
import logging
import math
import time
import uuid
from collections.abc import (
    Awaitable,
    Callable,
    Hashable,
    Iterator,
    Mapping,
    Sequence,
)
from functools import partial

import attrs
import trio

from ..adapters.base import Adapter, AdapterRequest
from ..lifecycle import TRANSITIONS, RunState
from ..model import (
    CHARS_PER_TOKEN,
    LATEST_RUNS,
    InvalidRequest,
    NodeUnavailable,
    RunEvent,
    RunQuery,
    RunRecord,
    RunSpec,
    RunStatus,
    TargetSpec,
    UnknownRun,
    UnknownTarget,
    Usage,
    estimate_prompt_tokens,
    settle_usage,
)
from ..store.base import RunStore, StoreError, StoreHealth, StoreUnavailable
from .gate import Admitted, Expired, Gate, GateDecision, GateRejected, Permit
from .live import Listener, LiveRun, LiveRuns, Outcome, RunPhase, RunWatcher
from .live import notify as notify  # runtime/node.py imports it from here
from .pipeline import EngineAnswered, FirstToken, ReplicaEngines, StreamRelay
from .reservation import Reservations
from .spans import NO_TRACER, RunTracer
from .specs import PRIORITIES as PRIORITIES
from .specs import check_prompt_size, check_run_id, check_spec

log = logging.getLogger(__name__)


@attrs.frozen
class Submitted:
    """The ack: the run as stored when the caller is told, and whether it already existed."""

    record: RunRecord
    existing: bool = False


@attrs.frozen
class CancelOutcome:
    run_id: str
    status: RunStatus
    cancelled: bool


@attrs.define(eq=False)
class _Entering:
    """A run being stored QUEUED that enters the gate once it is, in line with the others.

    Runs whose writes end in the same round of the scheduler wake in any order; the
    line makes them enter the gate in the order they came (the store's order), so that
    one does not take the room another that came before it waits for. A run is stored
    once its phase is past ENTERING."""

    live: LiveRun
    target: TargetSpec
    spec: RunSpec
    cost: int = 0  # the tokens it reserves (see RunManager.submit)


def _rejected(rejected: GateRejected) -> Outcome:
    return Outcome(
        RunStatus.REJECTED, rejected.reason.value, str(rejected), retry_after=rejected.retry_after
    )


def _new_run_id() -> str:
    return uuid.uuid4().hex


#: Told, as a run that succeeded gives back its permit, that permit, the run's time to
#: first token and per output token after it (None for fewer than two tokens).
RunEnded = Callable[[Permit, float, float | None], None]


class RunManager:
    """Owns the runs of one node; see the module docstring for a run's life."""

    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        gate: Gate,
        store: RunStore,
        adapters: Mapping[str, Adapter],
        targets: Mapping[str, TargetSpec],
        final_write_timeout: float = 10.0,
        store_grace: float = 10.0,
        new_run_id: Callable[[], str] = _new_run_id,
        wall_clock: Callable[[], float] = time.time,
        listeners: list[Listener] | None = None,
        engine_answered: EngineAnswered | None = None,
        chars_per_token: float = CHARS_PER_TOKEN,
        run_ended: RunEnded | None = None,
        first_token: FirstToken | None = None,
        tracer: RunTracer = NO_TRACER,
        replicas: ReplicaEngines | None = None,
    ) -> None:
        self._nursery = nursery
        self._tracer = tracer  # each run's spans (runtime/spans.py)
        self._gate = gate
        self._store = store
        self._adapters = adapters
        self._targets = targets
        self.final_write_timeout = final_write_timeout
        self.store_grace = store_grace
        self._store_outage: trio.CancelScope | None = None
        store.watch_health(self._store_health_changed)
        self._new_run_id = new_run_id
        self._now = wall_clock
        # hooks (metrics, logs): called synchronously with each event once it is
        # stored (or given up on) and the run's own live record, which they must
        # not change; one that raises is logged and skipped
        self.runs = LiveRuns(store, listeners if listeners is not None else [], wall_clock)
        self._relay = StreamRelay(self.runs, wall_clock, engine_answered, first_token, replicas)
        # runs being stored QUEUED that enter the gate after, in the order they came:
        # while there are any, no run takes a permit before its own QUEUED write
        self._entering: collections.deque[_Entering] = collections.deque()
        self._admitting = True
        # runs wait in the gate as data; their queue deadlines are kept by one task
        nursery.start_soon(gate.expire_waiting)
        # what the runs waiting in the gate as data go on with once it decides
        self._as_data: dict[LiveRun, tuple[TargetSpec, RunSpec]] = {}
        gate.decide = self._decided
        # a prompt's tokens where the engine reports none (model.estimate_prompt_tokens)
        self.chars_per_token = chars_per_token
        self._run_ended = run_ended
        self._reservations = Reservations(gate, adapters, chars_per_token)

    def __repr__(self) -> str:
        running = sum(1 for r in self.runs if r.state.status is RunStatus.RUNNING)
        return f"<RunManager live={len(self.runs)} running={running} admitting={self._admitting}>"

    @property
    def listeners(self) -> list[Listener]:
        """The hooks told of each published event (see :data:`~.live.Listener`); add
        to this list to be told."""
        return self.runs.listeners

    def in_engine(self) -> Iterator[tuple[Permit, float, bool]]:
        """The runs whose engine request went out and whose stream has not ended: their
        permits, when the engine was last heard from about each (its request sent, or
        its latest chunks; trio time), and whether its first token came."""
        for live in self.runs:
            heard = live.heard_at
            if heard is not None and live.permit is not None:
                yield live.permit, heard, live.first_at is not None

    def engine_gaps(self) -> Iterator[tuple[Permit, float]]:
        """The runs in the engine that have had their first token: their permits, and the
        seconds between the engine's two latest batches for each (0: one batch so far)."""
        for live in self.runs:
            if live.heard_at is not None and live.first_at is not None and live.permit is not None:
                yield live.permit, live.gap

    # --- submitting ----------------------------------------------------------------------

    async def submit(
        self,
        spec: RunSpec,
        *,
        owner: Hashable | None = None,
        create_timeout: float | None = None,
    ) -> Submitted:
        """Create a run and return once it is stored QUEUED (or already known).

        ``owner`` names who asked (a session); foreground runs are cancelled
        by :meth:`abandon` with it. A ``spec.run_id`` that names a known run
        returns that run with ``existing=True`` and starts nothing. Raises
        UnknownTarget, InvalidRequest (a bad run_id, a prompt over the target's
        ``max_prompt_bytes``) or NodeUnavailable without creating a run.

        Storing the run takes at most ``create_timeout`` seconds (None:
        ``store_grace``): past it (a full disk met by this very write, say) the write is
        withdrawn and StoreUnavailable raised, and the run is never stored, nor started;
        a write being committed at that moment ends with that attempt (short), and
        committed, the run exists and this returns. StoreUnavailable at once while the
        store cannot write.
        """
        target = self._targets.get(spec.target)
        if target is None:
            raise UnknownTarget(spec.target)
        if not self._admitting:
            raise NodeUnavailable("the node is draining and admits no new runs")
        health = self._store.health()
        if not health.writable:
            raise StoreUnavailable(f"the node's run store {health}; retry later")
        check_spec(spec)
        # what the caller may set, capped; the run is stored with the options it runs with
        spec = attrs.evolve(spec, options=target.caller_options(spec.options))
        check_prompt_size(spec, target)
        if spec.run_id is not None:
            check_run_id(spec.run_id)
            known = await self.get(spec.run_id)
            if known is not None:
                return Submitted(known, existing=True)
        run_id = spec.run_id or self._new_run_id()
        spec, cost, counted = await self._reservations.reserve(spec, target)
        bound = self.store_grace if create_timeout is None else create_timeout
        record: RunRecord = await self._nursery.start(
            partial(self._run, spec, target, run_id, owner, bound, cost=cost, counted=counted)
        )
        return Submitted(record)

    async def _run(
        self,
        spec: RunSpec,
        target: TargetSpec,
        run_id: str,
        owner: Hashable | None,
        bound: float,
        *,
        cost: int = 0,
        counted: tuple[int, bool] | None = None,
        task_status: trio.TaskStatus[RunRecord],
    ) -> None:
        state, first = RunState.create(
            run_id=run_id,
            target=spec.target,
            background=spec.background,
            time=self._now(),
            prompt=spec.prompt,
            messages=spec.messages,
            options=spec.options,
            tenant=spec.tenant,
            priority=spec.priority,
        )
        if run_id in self.runs:
            raise InvalidRequest(f"run {run_id} is being created already")
        live = self.runs.add(run_id, state, None if spec.background else owner)
        live.spans = self._tracer.begin(run_id, spec, target)
        if counted is not None:
            live.prompt_tokens, live.prompt_exact = counted
        queued = attrs.evolve(state.record)
        if not self._entering:
            # a run that may start at once stores STARTED with QUEUED: one write, not two
            permit = self._gate.enter_now(
                live, spec.target, priority=spec.priority, tenant=spec.tenant, cost=cost, spec=spec
            )
            if permit is not None:
                live.permit = permit
                # its engine is asked while its QUEUED and STARTED commit (see _create)
                engine = partial(self._carry_on, live, target, spec, permit, started=True)
                await self._create(live, queued, first, permit, bound, task_status, engine)
                return
        # the others enter the gate once stored QUEUED, in the order they came (see
        # _Entering); until they have, nobody takes a permit at once past them
        entry = _Entering(live, target, spec, cost)
        self._entering.append(entry)
        try:
            await self._create(live, queued, first, None, bound, task_status)
        except BaseException:
            self._entering.remove(entry)
            self._enter_stored(None)
            raise
        went = self._enter_stored(entry)
        if went is not None:  # admitted at once, refused, or cancelled while stored
            await went()
        # else this task ends: the run waits in the gate as data (a grant starts its next
        # task, by _decided; its deadline (_decided) or a cancel (_cancel) ends it), or a run
        # that came before it is stored but not yet woken, and lets it in (the store
        # writes in order, so within the scheduler's round)

    def _enter_stored(self, own: _Entering | None) -> Callable[[], Awaitable[None]] | None:
        """Enter the gate for each run at the head of the line that is stored QUEUED, in
        the order the runs came (the first one not stored yet holds the rest back), and
        start what comes next for each in a task of its own; for ``own``, if it went in,
        return that instead, for its own task to await. A run cancelled while it was
        being stored does not enter: it ends CANCELLED."""
        mine: Callable[[], Awaitable[None]] | None = None
        while self._entering and self._entering[0].live.phase is not RunPhase.ENTERING:
            entry = self._entering.popleft()
            went = self._went_in(entry)
            if entry is own:
                mine = went
            elif went is not None:
                self._nursery.start_soon(went)
        return mine

    def _went_in(self, entry: _Entering) -> Callable[[], Awaitable[None]] | None:
        """Enter ``entry``'s run into the gate: what its task does next, or None (it waits
        in the gate as data)."""
        live, target, spec = entry.live, entry.target, entry.spec
        if live.asked is not None:  # cancelled while being stored: it never waits nor starts
            return partial(self._finish, live, live.stopped())
        try:
            permit = self._gate.enter(
                live,
                spec.target,
                priority=spec.priority,
                tenant=spec.tenant,
                queue_timeout=spec.queue_timeout,
                cost=entry.cost,
                spec=spec,
            )
        except GateRejected as rejected:
            return partial(self._finish, live, _rejected(rejected))
        if permit is None:
            self._as_data[live] = (target, spec)
            if live.spans is not None:
                live.spans.wait_began(self._gate.full_level(live) or "queue")
            return None
        live.admit(permit)
        return partial(self._carry_on, live, target, spec, permit)

    async def _create(
        self,
        live: LiveRun,
        queued: RunRecord,
        first: RunEvent,
        permit: Permit | None,
        bound: float,
        task_status: trio.TaskStatus[RunRecord],
        engine: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Store the new run QUEUED (and STARTED if it holds ``permit``) within ``bound``
        seconds, publish what was stored, and tell the submitter (``queued``, its record
        as of QUEUED). If the write fails, is cancelled or is given up on past ``bound``
        (StoreUnavailable; the store withdraws a write it is not committing), the run is
        forgotten (ENDED, never stored) and its permit given back.

        ``engine`` (a run that holds ``permit``): what runs it, started in a task of its
        own as the write is handed to the store, so its engine request goes out while
        the write commits. Its events wait until STARTED is durable (``live.starting``),
        so QUEUED is still durable before the submitter hears of the run and STARTED
        before anyone sees a token; if the run is not stored, its engine stream is
        closed at once (its scope cancelled), it writes and publishes nothing, and that
        task gives its permit back."""
        then: tuple[RunEvent, ...] = ()
        durable = trio.Event()
        try:
            if permit is not None:
                then = (live.start_event(self._now()),)
            if engine is not None:
                live.starting = (then[0], durable)
                self._nursery.start_soon(engine)
            with trio.move_on_after(bound) as bounded:
                try:
                    await self._store.create(queued, first, then=then)
                except StoreUnavailable as exc:  # its attempt failed after the bound passed
                    if not bounded.cancel_called:
                        raise
                    raise self._not_stored(bound) from exc
            if bounded.cancelled_caught:
                raise self._not_stored(bound)
        except BaseException:
            if engine is not None:
                live.scope.cancel()  # its task ends, and gives its permit back
            elif permit is not None:
                permit.release()
            live.discard()
            durable.set()  # what its engine's task waits on: it finds the run ENDED
            self.runs.forget(queued.run_id)
            raise
        for event in (first, *then):
            live.publish(event)
        live.starting = None
        live.move(RunPhase.QUEUED if permit is None else RunPhase.RUNNING)
        durable.set()
        task_status.started(queued)

    def _not_stored(self, bound: float) -> StoreUnavailable:
        health = self._store.health()
        why = "it is behind" if health.writable else f"it {health}"
        return StoreUnavailable(
            f"the node's run store did not store the run within {bound:g}s ({why}); the run "
            "was not created: retry later"
        )

    def _decided(self, decision: GateDecision) -> None:
        """Carry out the gate's decision about a run that waited as data (Gate.decide):
        an admitted run's task goes on from here; an expired one ends REJECTED."""
        live = decision.borrower
        assert isinstance(live, LiveRun), decision
        target, spec = self._as_data.pop(live)
        match decision:
            case Admitted(permit=permit):
                live.admit(permit)
                self._nursery.start_soon(self._carry_on, live, target, spec, permit)
            case Expired(rejected=rejected):
                self._nursery.start_soon(self._finish, live, _rejected(rejected))

    def _withdraw(self, live: LiveRun) -> bool:
        """Take ``live`` out of the gate's queue if it waits there as data (True)."""
        if not self._gate.withdraw(live):
            return False
        del self._as_data[live]
        return True

    async def _carry_on(
        self,
        live: LiveRun,
        target: TargetSpec,
        spec: RunSpec,
        permit: Permit,
        *,
        started: bool = False,
    ) -> None:
        """Run an admitted run to its end, holding ``permit``; record its end. ``started``:
        its STARTED event is stored already (with QUEUED, see :meth:`_create`)."""
        live.trace_here()
        run_id = live.state.record.run_id
        outcome: Outcome | None = None
        try:
            with permit:
                if live.asked is None:  # a run cancelled as it was granted never starts
                    with live.scope:
                        outcome = await self._execute_admitted(live, target, spec, started)
                if outcome is None:  # cancelled, or stopped otherwise
                    outcome = live.stopped()
                # its tokens settle with what it used, the same count its end will carry
                # (none for a run that was never stored: see _create)
                usage = None if live.ended else self._settled(live, outcome.usage)
                permit.settle(
                    None
                    if usage is None
                    else (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
                )
                if (
                    outcome.status is RunStatus.SUCCEEDED
                    and outcome.ttft is not None
                    and self._run_ended is not None
                ):
                    self._run_ended(permit, outcome.ttft, outcome.tpot)
        except trio.Cancelled:
            # the node-wide nursery is being cancelled (shutdown)
            outcome = Outcome(RunStatus.CANCELLED, "node_shutdown", "the node stopped")
            raise
        except Exception as exc:
            log.exception("run %s: internal error", run_id)
            outcome = Outcome(RunStatus.FAILED, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            await self._finish(live, outcome or Outcome(RunStatus.FAILED, "internal"))

    async def _execute_admitted(
        self, live: LiveRun, target: TargetSpec, spec: RunSpec, started: bool
    ) -> Outcome:
        if not started:
            self.runs.start(live)
        request = AdapterRequest(
            run_id=live.state.record.run_id,
            model=target.model,
            prompt=spec.prompt,
            messages=spec.messages,
            params=target.params_for(spec.options),
        )
        limit = target.max_run_time
        with trio.move_on_after(math.inf if limit is None else limit):
            return await self._relay.relay_run(
                live, self._adapters[target.adapter], request, target
            )
        # leaving the adapter's stream on the deadline closed it
        return Outcome(
            RunStatus.FAILED,
            "run_timeout",
            f"the run did not finish within {limit:g}s (max_run_time of {target.name})",
        )

    def _settled(self, live: LiveRun, reported: Usage | None) -> Usage | None:
        """The usage the end of ``live`` carries: none if it never started; else each
        count its engine ``reported`` (exact), or the node's, marked estimated: the engine
        tokens of its delta events (one an engine chunk; what the engine sent that never
        became a delta, or generated and never sent, is not counted) and its prompt
        estimated from its size (``chars_per_token``), sent or not."""
        if live.state.status is not RunStatus.RUNNING:
            return None
        prompt = live.prompt_tokens
        if prompt is None:
            prompt = estimate_prompt_tokens(live.state.record, self.chars_per_token)
        return settle_usage(
            reported, prompt=prompt, completion=live.delta_tokens, prompt_exact=live.prompt_exact
        )

    async def _finish(self, live: LiveRun, outcome: Outcome) -> None:
        """Make the run's terminal event from ``outcome``, with its usage if it started
        (:meth:`_settled`), so the usage is stored with the end, in the same write, and
        is never settled twice; write it (bounded, shielded) and publish it."""
        live.trace_here()
        run_id = live.state.record.run_id
        if outcome.status not in TRANSITIONS[live.state.status]:
            # only a bug gets here (e.g. an internal error while QUEUED, which
            # the table does not allow to FAIL): end it CANCELLED, say why
            log.error("run %s: cannot end %s from %s", run_id, outcome, live.state.status)
            outcome = Outcome(RunStatus.CANCELLED, "internal", outcome.message)
        try:
            event = live.state.transition(
                outcome.status,
                time=self._now(),
                reason=outcome.reason,
                message=outcome.message,
                usage=self._settled(live, outcome.usage),
                retry_after=outcome.retry_after,
                replica=live.replica,  # "" unless it started (LiveRun.start_event)
            )
            with trio.move_on_after(self.final_write_timeout, shield=True) as scope:
                await self.runs.write(live, event)
            if scope.cancelled_caught:
                # the store has the event and writes it in order when it can; the run is
                # known here (get, cancel) until then, and its watchers have their end now
                live.end()
                health = self._store.health()
                if health.writable:
                    log.error(
                        "run %s: final status %s not confirmed by the store within %ss",
                        run_id,
                        outcome.status.value,
                        self.final_write_timeout,
                    )
                await self._store.sync()
        except StoreError as exc:
            log.warning("run %s: final status %s not stored: %s", run_id, outcome.status, exc)
        except Exception:
            log.exception("run %s: could not record final status %s", run_id, outcome.status)
        finally:
            if not live.ended:
                self.runs.release_held(live)  # its end was not written: its text goes alone
                live.end()
            self.runs.forget(run_id)

    # --- cancelling ----------------------------------------------------------------------

    def cancel_nowait(self, run_id: str, reason: str = "cancelled") -> bool:
        """Ask a live run to stop; True if it was live. Its end is recorded by its own task.

        A run cancelled before it holds a permit goes QUEUED -> CANCELLED and
        never starts; after, RUNNING -> CANCELLED and its adapter stream is
        closed. The first reason given wins.
        """
        live = self.runs.get(run_id)
        if live is None:
            return False
        self._cancel(live, reason)
        return True

    def _cancel(self, live: LiveRun, reason: str) -> bool:
        """Cancel ``live`` with ``reason``; False if a cancel or stop came first."""
        asked = Outcome(RunStatus.CANCELLED, reason)
        if not live.ask(asked):
            return False
        if self._withdraw(live):  # it waited as data: it never starts, and ends here
            self._nursery.start_soon(self._finish, live, asked)
        else:
            live.scope.cancel()
        return True

    def _cancel_many(self, lives: Sequence[LiveRun], reason: str) -> list[str]:
        """Cancel these runs with ``reason``; return the ids of those cancelled now.

        The ones waiting in the queue are taken out of it and ended together
        (one store write for all: :meth:`_end_in_bulk`); the others are
        cancelled one by one, as :meth:`cancel_nowait` does.
        """
        cancelled: list[str] = []
        waiting: list[LiveRun] = []
        asked = Outcome(RunStatus.CANCELLED, reason)
        for live in lives:
            if not live.ask(asked):
                continue
            cancelled.append(live.state.record.run_id)
            if self._withdraw(live):
                waiting.append(live)
            else:
                live.scope.cancel()
        if waiting:
            self._nursery.start_soon(self._end_in_bulk, waiting, reason)
        return cancelled

    async def _end_in_bulk(self, lives: list[LiveRun], reason: str) -> None:
        """End runs taken out of the queue CANCELLED(``reason``), their events written in
        one go, bounded and shielded like one run's end (see :meth:`_finish`)."""
        now = self._now()
        events = [
            live.state.transition(RunStatus.CANCELLED, time=now, reason=reason) for live in lives
        ]
        try:
            with trio.move_on_after(self.final_write_timeout, shield=True) as scope:
                await self._store.append_many(events)
            if scope.cancelled_caught:
                for live, event in zip(lives, events, strict=True):
                    live.publish(event)
                    live.end()
                if self._store.health().writable:
                    log.error(
                        "the end of %d cancelled runs not confirmed by the store within %ss",
                        len(lives),
                        self.final_write_timeout,
                    )
                await self._store.sync()
        except StoreError as exc:
            log.warning("the end of %d cancelled runs not all stored: %s", len(lives), exc)
        finally:
            for live, event in zip(lives, events, strict=True):
                if not live.ended:
                    live.publish(event)
                    live.end()
                self.runs.forget(live.state.record.run_id)

    async def cancel(self, run_id: str, reason: str = "cancelled") -> CancelOutcome:
        """Cancel a run and wait until its final status is recorded.

        ``cancelled`` is False when the run had already ended (its status is
        returned as it is). Raises UnknownRun for an id the node never had.
        """
        live = self.runs.get(run_id)
        if live is not None and live.asked is None:
            self.cancel_nowait(run_id, reason)
            await live.wait_ended()
            record = live.state.record
            return CancelOutcome(run_id, record.status, record.status is RunStatus.CANCELLED)
        if live is not None:
            await live.wait_ended()
            return CancelOutcome(run_id, live.state.record.status, False)
        stored = await self._store.get(run_id)
        if stored is None:
            raise UnknownRun(run_id)
        return CancelOutcome(run_id, stored.status, False)

    def stop_running(self, reason: str, message: str) -> list[str]:
        """End every RUNNING run FAILED with ``reason`` (its engine stream closed); return
        their ids. QUEUED runs go on waiting."""
        ids = []
        for live in self.runs:
            if live.state.status is RunStatus.RUNNING and live.ask(
                Outcome(RunStatus.FAILED, reason, message)
            ):
                live.scope.cancel()
                ids.append(live.state.record.run_id)
        return ids

    def _store_health_changed(self, health: StoreHealth) -> None:
        """A store that cannot write for ``store_grace`` seconds stops the running runs:
        their engines are freed, and their end is stored once the store writes again."""
        if health.writable:
            if self._store_outage is not None:
                self._store_outage.cancel()
                self._store_outage = None
        elif self._store_outage is None:
            self._store_outage = trio.CancelScope()
            self._nursery.start_soon(self._stop_runs_after_grace, self._store_outage, health)

    async def _stop_runs_after_grace(self, scope: trio.CancelScope, health: StoreHealth) -> None:
        with scope:
            await trio.sleep(self.store_grace)
            stopped = self.stop_running(
                "store_unavailable",
                f"the run store {health} for {self.store_grace:g}s; the run was stopped",
            )
            if stopped:
                log.warning(
                    "the run store %s for %gs: stopped %d running runs",
                    health,
                    self.store_grace,
                    len(stopped),
                )

    def abandon(self, owner: Hashable, reason: str = "session_lost") -> list[str]:
        """Cancel the foreground runs of ``owner``; return their ids. Background runs go on."""
        lives = [live for live in self.runs if live.owner == owner]
        self._cancel_many(lives, reason)
        return [live.state.record.run_id for live in lives]

    def cancel_all(self, reason: str) -> list[str]:
        """Cancel every live run; return the ids of those this call cancelled."""
        return self._cancel_many(list(self.runs), reason)

    # --- admission and draining ----------------------------------------------------------

    @property
    def admitting(self) -> bool:
        return self._admitting

    def stop_admitting(self) -> None:
        """From now on :meth:`submit` raises NodeUnavailable. Runs already in go on."""
        self._admitting = False

    def shut_down(self) -> None:
        """Stop admitting, and end the runs that wait in the queue CANCELLED
        (``node_shutdown``) in one store write; the caller then cancels the nursery,
        which ends the running ones (their final writes are shielded)."""
        self.stop_admitting()
        self._cancel_many(
            [live for live in self.runs if self._gate.is_waiting(live)],
            "node_shutdown",
        )

    async def wait_idle(self) -> None:
        """Return when no run is live (at once if none is)."""
        await self.runs.wait_idle()

    async def drain(self, grace: float, reason: str = "node_draining") -> int:
        """Stop admitting and end every live run within about ``grace`` seconds.

        Runs still QUEUED are cancelled at once (they would not start in time,
        and their caller can resubmit elsewhere); RUNNING runs get ``grace``
        seconds to finish, then are cancelled. Cancelled runs end CANCELLED
        with ``reason``. Returns how many runs were cancelled; every final
        status is recorded before it returns, unless the store cannot write:
        then it returns within ``final_write_timeout`` seconds of the cancel, and
        the rest is the store's to write (or to mark INTERRUPTED at the next start).
        """
        self.stop_admitting()
        queued = [live for live in self.runs if live.state.status is RunStatus.QUEUED]
        cancelled = self._cancel_many(queued, reason)
        with trio.move_on_after(grace):
            await self.wait_idle()
        cancelled += self.cancel_all(reason)
        while self.runs:
            with trio.move_on_after(self.final_write_timeout):
                await self.wait_idle()
            if self.runs and not self._store.health().writable:
                log.warning(
                    "drained without storing the end of %d runs: the run store %s",
                    len(self.runs),
                    self._store.health(),
                )
                break
        return len(cancelled)

    # --- reading -------------------------------------------------------------------------

    def live_records(self) -> list[RunRecord]:
        """Copies of the records of every live run (QUEUED or RUNNING, or finishing)."""
        return [attrs.evolve(live.state.record) for live in self.runs]

    def live_count(self, status: RunStatus | None = None) -> int:
        if status is None:
            return len(self.runs)
        return sum(1 for live in self.runs if live.state.status is status)

    async def get(self, run_id: str) -> RunRecord | None:
        live = self.runs.get(run_id)
        if live is not None:
            await trio.lowlevel.checkpoint()
            return attrs.evolve(live.state.record)
        return await self._store.get(run_id)

    async def list_runs(self, query: RunQuery = LATEST_RUNS) -> list[RunRecord]:
        """See :meth:`RunStore.list_runs`."""
        return await self._store.list_runs(query)

    async def events(
        self, run_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[RunEvent]:
        """The run's published events with ``seq > after_seq`` (at most ``limit``)."""
        return await self.runs.events(run_id, after_seq=after_seq, limit=limit)

    def watch(self, run_id: str, *, after_seq: int = 0) -> RunWatcher:
        """Events of ``run_id`` after ``after_seq``, following a live run to its end."""
        return self.runs.watch(run_id, after_seq=after_seq)
