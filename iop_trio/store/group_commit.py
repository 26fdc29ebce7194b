"""Group commit: one writer thread makes a store's writes, many to a transaction.

It knows nothing of runs, tables or SQL: a :class:`GroupCommit` takes :class:`Job`\\ s,
each carrying a *plan* (what to write, as data), and hands batches of them to a
:class:`WriteBackend`, which makes a batch in one transaction and sets each job's
result or error. The engine does the rest, the same for any backend:

* **Batching.** Every write is put on a thread-safe FIFO synchronously, before the
  calling task's first checkpoint; the caller then parks in
  :func:`trio.lowlevel.wait_task_rescheduled`. The writer takes *everything* pending
  (up to ``max_batch`` jobs), has the backend make it, and wakes the waiters with one
  :meth:`trio.lowlevel.TrioToken.run_sync_soon` call per Trio run. The batch grows by
  itself while the previous commit is on its way, with no timer.
* **Linger.** Jobs nobody waits for (``submit_nowait`` without a callback) wait, alone,
  up to ``linger`` seconds for company; a job somebody waits for, a full batch or
  closing ends the wait at once.
* **Retry.** A batch that fails for a *passing* reason (the backend says which:
  :meth:`WriteBackend.passing`) is retried with backoff (:data:`RETRY_INITIAL`
  doubling to :data:`RETRY_MAX`) after :meth:`WriteBackend.reset`, until it commits:
  nothing taken is lost or reordered. Once :meth:`GroupCommit.aclose` is called such a
  batch gets ``close_timeout`` more seconds, then fails with :class:`StoreUnavailable`.
* **Health.** While writes fail, the ``"write"`` source of the :class:`HealthBoard`
  says why (logged once each way); when none is left to retry (their callers gave
  up), :meth:`WriteBackend.probe` learns when writes go through again.
* **Withdrawal.** A withdrawable job cancelled while the writer is not attempting it
  (still queued, or between two attempts) is withdrawn: never written, and
  :class:`trio.Cancelled` is raised at once. Cancelled during an attempt it ends with
  that attempt: committed, it returns; else it raises StoreUnavailable.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import trio

from .base import HealthListener, StoreError, StoreHealth, StoreUnavailable

P = TypeVar("P")

#: Seconds the writer lets writes nobody waits for gather before it commits them
#: (by default), unless a write somebody waits for comes first.
LINGER = 0.2
#: Backoff between attempts at a batch whose writes fail (seconds, doubling).
RETRY_INITIAL = 0.05
RETRY_MAX = 1.0
#: After aclose(), how long writes that cannot be made are still retried (by default).
CLOSE_TIMEOUT = 5.0
#: Bytes a probe writes (see GroupCommit's probe): what the writes given up on needed,
#: within these bounds.
PROBE_MIN = 4096
PROBE_MAX = 1024 * 1024
#: The health board's source the engine itself sets: writes that fail.
WRITE = "write"


def store_error(exc: BaseException, context: str) -> StoreError:
    """``exc`` if it is a StoreError, else a StoreError saying ``context`` and it."""
    if isinstance(exc, StoreError):
        return exc
    error = StoreError(f"{context}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class HealthBoard:
    """What each source finds wrong with a store's writes now, and the health they make.

    ``sources`` name them in the order the health says them (the first with a problem
    wins). Any thread may set a problem; listeners are told, in the order the changes
    were made, in their Trio run's thread, whenever the store becomes writable or not.
    """

    def __init__(self, sources: Sequence[str]) -> None:
        self.sources = tuple(sources)
        self._lock = threading.Lock()
        self._problems: dict[str, tuple[float, str]] = {}  # source -> (since, problem)
        self._health = StoreHealth()
        self._listeners: list[tuple[trio.lowlevel.TrioToken, HealthListener]] = []

    def __repr__(self) -> str:
        return f"<HealthBoard {self._health} problems={sorted(self._problems)}>"

    @property
    def health(self) -> StoreHealth:
        """Whether writes go through now (and if not, why and since when)."""
        return self._health

    def problem(self, source: str) -> str | None:
        """What ``source`` finds wrong now; None if nothing."""
        found = self._problems.get(source)
        return None if found is None else found[1]

    def watch(self, listener: HealthListener) -> None:
        """Call ``listener(health)`` in this Trio run's thread at each flip."""
        self._listeners.append((trio.lowlevel.current_trio_token(), listener))

    def set(self, source: str, problem: str | None) -> bool:
        """Record what ``source`` finds wrong now, or None, and tell the listeners if that
        makes the store writable or not. Returns whether ``source`` began or ceased to
        find a problem (a new text for the same one is kept, and returns False)."""
        with self._lock:
            had = self._problems.get(source)
            if problem is None:
                self._problems.pop(source, None)
            else:
                self._problems[source] = (had[0] if had else time.time(), problem)
            health = next(
                (
                    StoreHealth(False, *self._problems[name])
                    for name in self.sources
                    if name in self._problems
                ),
                StoreHealth(),
            )
            flipped = health.writable != self._health.writable
            self._health = health
            if flipped:  # told in the order the changes were made
                for token, listener in list(self._listeners):
                    with contextlib.suppress(trio.RunFinishedError):
                        token.run_sync_soon(listener, health)
        return (had is None) != (problem is None)


class Job(Generic[P]):
    """One write call: its plan (made by the backend) and how to wake its task.

    Made in the Trio thread of the call. ``withdrawable``: cancelling the call may
    withdraw it (all-or-nothing writes); ``size`` is about how many bytes it writes
    (the room a probe asks for). The backend sets ``result`` or ``error``.
    """

    __slots__ = (
        "done",
        "error",
        "given_up",
        "label",
        "plan",
        "result",
        "settled",
        "size",
        "taken",
        "task",
        "token",
        "waited",
        "withdrawable",
        "withdrawn",
    )

    def __init__(self, plan: P, label: str, *, withdrawable: bool, size: int = 0) -> None:
        self.plan = plan
        self.label = label
        self.withdrawable = withdrawable
        self.size = size
        self.token = trio.lowlevel.current_trio_token()
        # read and written only in the Trio thread
        self.task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        # whether a task waits for this job's commit (the writer lingers only if none does)
        self.waited = True
        # called (in the Trio thread) once it is committed
        self.done: Callable[[], None] | None = None
        # guarded by the engine's lock: taken into a batch; left out of the batch's next
        # attempt (a withdrawable job cancelled while not being committed); its caller gave
        # up while an attempt was on (it ends with that attempt); the writer is done with it
        self.taken = False
        self.withdrawn = False
        self.given_up = False
        self.settled = False
        # written by the writer thread before the wake-up
        self.result: object = None
        self.error: StoreError | None = None

    def __repr__(self) -> str:
        state = "settled" if self.settled else "taken" if self.taken else "pending"
        return f"<Job {self.label} {state} error={self.error!r}>"


class WriteBackend(Protocol[P]):
    """What the engine needs of the storage it writes. Called in the writer thread only."""

    def open(self) -> None:
        """Open the storage; an exception makes every write fail with it, for good."""

    def commit(self, jobs: Sequence[Job[P]], attempt: int) -> tuple[bool, int]:
        """Make ``jobs`` in one transaction (the ``attempt``-th retry of them), setting each
        job's result or error; return whether it committed and the events written. Raise
        (rolled back) if the batch as a whole failed."""

    def passing(self, exc: BaseException) -> str | None:
        """What went wrong if ``exc`` is a failure that passes (retry); None if not."""

    def refusal(self, plan: P) -> StoreError | None:
        """Why ``plan`` is refused before an attempt is even made; None: attempt it."""

    def reset(self) -> None:
        """After a passing failure: let go of what failed, to start afresh next time."""

    def probe(self, size: int) -> None:
        """Write about ``size`` bytes and undo them, to learn whether writes go through."""

    def tend(self, *, now: bool) -> bool:
        """When due (or ``now``), check the storage; return whether it looked."""

    def tending_due(self) -> bool:
        """Whether :meth:`tend` would look now."""

    def between_batches(self, *, idle: bool) -> None:
        """Between two batches, their callers woken: do upkeep that no caller should wait
        for (a checkpoint); ``idle``: nothing is pending. Never raises."""

    def time_to_check(self) -> float | None:
        """Seconds until :meth:`tend` is due; None: never."""

    def close(self) -> None:
        """The writer stops: close the storage."""


class GroupCommit(Generic[P]):
    """The writer thread of a store, and the Trio side of its writes (module docstring).

    ``name`` names the store in messages and logs (``logger``); ``before_batch`` (a test
    seam) is called in the writer thread with the labels of each batch it has taken,
    before its first attempt, so a test can hold the writer there.
    """

    def __init__(
        self,
        backend: WriteBackend[P],
        board: HealthBoard,
        *,
        name: str,
        thread_name: str,
        logger: logging.Logger,
        max_batch: int,
        linger: float = LINGER,
        close_timeout: float = CLOSE_TIMEOUT,
        before_batch: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.name = name
        self.max_batch = max_batch
        self.linger = linger
        self.close_timeout = close_timeout
        self._backend = backend
        self._board = board
        self._thread_name = thread_name
        self._log = logger
        self._before_batch = before_batch
        # the job queue and the writer's life, guarded by _lock
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._pending: collections.deque[Job[P]] = collections.deque()
        self._lingering = False  # the writer waits for company for writes nobody waits for
        self._thread: threading.Thread | None = None
        self._closing = False
        self._close_deadline: float | None = None  # monotonic; set by aclose()
        # guarded by _lock: the writer is in an attempt at a batch (see submit)
        self._attempting = False
        # set by the writer once the storage is open (or failed to open)
        self._opened = threading.Event()
        self.open_error: StoreError | None = None
        # the writer thread's own: the room the last batch given up on needed (see _probe)
        self._probe_size = PROBE_MIN
        # counters, written by the writer thread only
        self.commits = 0
        self.jobs = 0
        self.events = 0

    def __repr__(self) -> str:
        return f"<GroupCommit {self.name!r} {self.state()} pending={self.pending()}>"

    def state(self) -> str:
        """closed, unopened, opening, broken (the open failed) or open."""
        with self._lock:
            closing = self._closing
            started = self._thread is not None
        if closing:
            return "closed"
        if not started:
            return "unopened"
        if not self._opened.is_set():
            return "opening"
        return "broken" if self.open_error is not None else "open"

    def pending(self) -> int:
        """Jobs waiting for the writer to take them."""
        with self._lock:
            return len(self._pending)

    @property
    def started(self) -> bool:
        """Whether the writer thread was started (it never is once closing)."""
        with self._lock:
            return self._thread is not None

    @property
    def closing(self) -> bool:
        """Whether :meth:`aclose` was called."""
        with self._lock:
            return self._closing

    @property
    def opened(self) -> bool:
        """Whether the writer has opened the storage (or failed to)."""
        return self._opened.is_set()

    def wait_opened(self) -> None:
        """Block this (worker) thread until :attr:`opened`."""
        self._opened.wait()

    def nudge(self) -> None:
        """Wake the writer, to tend the storage now if it is due."""
        with self._lock:
            self._wakeup.notify()

    def start(self) -> None:
        """Start the writer thread, if not yet and not closing."""
        with self._lock:
            if self._thread is None and not self._closing:
                self._thread = threading.Thread(
                    target=self._writer_main, name=self._thread_name, daemon=True
                )
                self._thread.start()

    # --- the Trio side -------------------------------------------------------------------

    async def submit(self, job: Job[P]) -> object:
        """Queue ``job`` now (no checkpoint before), then wait for its batch to commit;
        its result, or raise its error (see the module docstring's Withdrawal)."""
        self.start()
        with self._lock:
            if self._closing:
                raise StoreError(f"the store {self.name!r} is closed")
            self._pending.append(job)
            self._wakeup.notify()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            if job.withdrawable:
                with self._lock:
                    if not job.taken:
                        self._pending.remove(job)
                    elif job.settled or self._attempting:
                        job.given_up = True
                        return trio.lowlevel.Abort.FAILED  # the writer will wake us
                    job.withdrawn = True
            job.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if job.error is not None:
            raise job.error
        return job.result

    def submit_nowait(self, job: Job[P], *, on_durable: Callable[[], None] | None) -> None:
        """Queue ``job``, which nobody waits for, and return; ``on_durable`` is called in
        the Trio thread once it is committed. Without it the job may linger. StoreError if
        closing; the job's error is logged."""
        job.task = None  # nobody waits for it
        job.done = on_durable
        job.waited = on_durable is not None  # somebody will want it: commit it at once
        self.start()
        with self._lock:
            if self._closing:
                raise StoreError(f"the store {self.name!r} is closed")
            self._pending.append(job)
            if job.waited or not self._lingering:
                # a lingering writer wakes at its deadline anyway: waking it for each
                # delta cost a thread switch a token
                self._wakeup.notify()

    async def aclose(self, then: Callable[[], None]) -> None:
        """Commit every job already taken, stop the writer, then call ``then`` (in a
        worker thread, or here if the writer never started). Safe to call more than
        once; if cancelled, the closing goes on in the background."""
        with self._lock:
            if not self._closing:
                self._close_deadline = time.monotonic() + self.close_timeout
            self._closing = True
            self._wakeup.notify_all()
            thread = self._thread
        if thread is None:
            then()
            await trio.lowlevel.checkpoint()
            return

        def finish() -> None:
            thread.join()
            then()

        await trio.to_thread.run_sync(finish, abandon_on_cancel=True)

    def _wake(self, jobs: list[Job[P]]) -> None:
        # runs in the Trio thread (run_sync_soon)
        for job in jobs:
            if job.done is not None:
                try:
                    job.done()
                except Exception:
                    self._log.exception("the callback of %s failed", job.label)
            task, job.task = job.task, None
            if task is not None:
                trio.lowlevel.reschedule(task)
            elif job.error is not None:
                self._log.error("%s that nobody waited for failed: %s", job.label, job.error)

    # --- the writer thread ---------------------------------------------------------------

    def _writer_main(self) -> None:
        try:
            self._backend.open()
        except Exception as exc:
            self.open_error = store_error(exc, f"cannot open run store {self.name!r}")
        finally:
            self._opened.set()
        try:
            while True:
                batch = self._take_batch()
                if batch is None:
                    return  # closing, and everything taken is done
                if batch:
                    self._call_before_batch(batch)
                    self._run_batch(batch)
        finally:
            self._backend.close()

    def _take_batch(self) -> list[Job[P]] | None:
        """Do the upkeep between batches, tend the storage when due, then wait for jobs
        and take a batch of them: [] if the storage is due a check first, None once
        closing with nothing pending."""
        self._backend.between_batches(idle=not self._pending)
        if (
            self._backend.tend(now=False)
            and self._board.problem(WRITE) is not None
            and not self._pending
        ):
            self._probe()  # writes fail, and none is left to find when they do not
        with self._lock:
            while not self._pending and not self._closing and not self._backend.tending_due():
                self._wakeup.wait(self._backend.time_to_check())
            if not self._pending:
                return None if self._closing else []
            self._linger()
            batch: list[Job[P]] = []
            while self._pending and len(batch) < self.max_batch:
                job = self._pending.popleft()
                job.taken = True
                batch.append(job)
            self._attempting = True  # the first attempt at it begins now
            return batch

    def _call_before_batch(self, batch: list[Job[P]]) -> None:
        hook = self._before_batch
        if hook is not None:
            try:
                hook([job.label for job in batch])
            except Exception:
                self._log.exception("run store: the before-batch hook failed")

    def _linger(self) -> None:
        """With the lock held and something pending: while nobody waits for any pending
        write, wait up to ``linger`` seconds for more (a write somebody waits for, a
        full batch or closing ends the wait at once)."""
        if self.linger <= 0:
            return
        deadline = time.monotonic() + self.linger
        self._lingering = True
        try:
            while (
                not self._closing
                and len(self._pending) < self.max_batch
                and not any(job.waited for job in self._pending)
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wakeup.wait(left)
        finally:
            self._lingering = False

    def _run_batch(self, batch: list[Job[P]]) -> None:
        """Commit ``batch`` (retrying a passing failure), then wake its callers.

        Between two attempts its withdrawable jobs may be withdrawn (see :meth:`submit`):
        the next attempt leaves them out, and a batch left with none is done. Its callers
        given up during an attempt that failed are woken with StoreUnavailable."""
        attempt = 0
        room = sum(job.size for job in batch)  # what a probe asks for if all is withdrawn
        while True:
            with self._lock:
                batch = [job for job in batch if not job.withdrawn]
                self._attempting = bool(batch)
            if batch:
                batch = self._refuse(batch)
            if not batch:
                self._probe_size = room
                break
            for job in batch:
                job.error = None  # an earlier attempt's refusal is made again, or not
            try:
                if self.open_error is not None:
                    raise self.open_error
                committed, events = self._backend.commit(batch, attempt)
            except Exception as exc:
                passing = self._backend.passing(exc)
                if passing is not None:
                    self._writes_fail(passing)
                    batch = self._give_up(batch, passing)
                    if not batch:
                        continue  # to the end above: nothing is left to write
                    if self._wait_to_retry(passing, attempt):
                        attempt += 1
                        continue
                    error: StoreError = StoreUnavailable(
                        f"the run store could not write before it closed: {passing}"
                    )
                else:
                    error = store_error(exc, "the run store could not commit")
                for job in batch:
                    job.result = None
                    job.error = type(error)(str(error))
                    job.error.__cause__ = error.__cause__ or exc
            else:
                self.commits += committed
                self.events += events
                self._writes_go_through()
            break
        self._settle(batch, last=True)

    def _refuse(self, batch: list[Job[P]]) -> list[Job[P]]:
        """End the jobs the backend refuses before an attempt; return the others."""
        refused = []
        for job in batch:
            error = self._backend.refusal(job.plan)
            if error is not None:
                job.error = error
                refused.append(job)
        if not refused:
            return batch
        self._settle(refused)
        return [job for job in batch if job.error is None]

    def _give_up(self, batch: list[Job[P]], problem: str) -> list[Job[P]]:
        """After a failed attempt: end the jobs whose callers gave up during it (with
        StoreUnavailable: nothing of them was written); return the others. From now until
        the next attempt the batch's withdrawable jobs may be withdrawn."""
        with self._lock:
            self._attempting = False
            given_up = [job for job in batch if job.given_up]
        if not given_up:
            return batch
        for job in given_up:
            job.result = None
            job.error = StoreUnavailable(f"the run store cannot write: {problem}")
        self._settle(given_up)
        return [job for job in batch if not job.given_up]

    def _settle(self, jobs: list[Job[P]], *, last: bool = False) -> None:
        """The writer is done with ``jobs`` (their result or error is set): wake them.
        ``last``: they are what is left of the batch, which is done too."""
        with self._lock:  # at once: a job is never seen neither settled nor attempted
            if last:
                self._attempting = False
            for job in jobs:
                job.settled = True
        self.jobs += len(jobs)
        self._wake_soon(jobs)

    def _wake_soon(self, batch: list[Job[P]]) -> None:
        """Have each job's Trio run wake its callers (one call per run), or log the error
        of a job nobody waits for."""
        by_token: dict[trio.lowlevel.TrioToken, list[Job[P]]] = {}
        for job in batch:
            by_token.setdefault(job.token, []).append(job)
        for token, jobs in by_token.items():
            if not any(
                job.task is not None or job.error is not None or job.done is not None
                for job in jobs
            ):
                continue  # nobody to wake, nothing to log: spare the Trio thread a wake-up
            with contextlib.suppress(trio.RunFinishedError):  # nobody left to tell
                token.run_sync_soon(self._wake, jobs)

    def _probe(self) -> None:
        """While writes fail and none is left to try (their callers gave up on them): have
        the backend write what they needed and undo it, to learn whether the store writes
        again; its health says so either way."""
        size = min(PROBE_MAX, max(PROBE_MIN, self._probe_size))
        if self.open_error is not None:
            return
        try:
            self._backend.probe(size)
        except Exception as exc:
            passing = self._backend.passing(exc)
            if passing is None:
                self._log.warning("run store %s: a probe of its writes failed: %s", self.name, exc)
                return
            self._writes_fail(passing)
            self._backend.reset()  # a fresh start next time, as for a batch
            return
        self._writes_go_through()

    def _wait_to_retry(self, problem: str, attempt: int) -> bool:
        """After a passing failure: say so, tend the storage, reset the backend, wait the
        backoff. False once closing and its ``close_timeout`` is over."""
        self._writes_fail(problem)
        self._backend.tend(now=True)
        self._backend.reset()
        delay = min(RETRY_MAX, RETRY_INITIAL * 2 ** min(attempt, 16))
        deadline = self._close_deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            delay = min(delay, left)
        time.sleep(delay)
        return True

    def _writes_fail(self, problem: str) -> None:
        if self._board.set(WRITE, problem):
            self._log.warning(
                "run store %s cannot write (%s); writes wait and are retried, new runs "
                "are refused until it can",
                self.name,
                problem,
            )

    def _writes_go_through(self) -> None:
        # after each commit: only the writer sets WRITE, so the look is safe
        if self._board.problem(WRITE) is not None and self._board.set(WRITE, None):
            self._log.warning("run store %s writes again", self.name)


__all__ = [
    "CLOSE_TIMEOUT",
    "LINGER",
    "GroupCommit",
    "HealthBoard",
    "Job",
    "WriteBackend",
    "store_error",
]
