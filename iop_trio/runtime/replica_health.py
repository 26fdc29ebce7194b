"""Which replicas are down, and what brings them back: the Trio shell of the replicas'
*down* mark (:mod:`.replicas`).

A replica that fails a run before its first token for one of the pipeline's
``FAILOVER_REASONS`` (it refused to connect, did not answer in time, answered 429 or
503) is marked down in the gate, with why, and logged once. It gets no run until it is
cleared: by a probe (:meth:`ReplicaHealth.probe`, each probe interval, asks every
replica for its list of models: one that answers is up again, one that cannot be
reached is marked down), or by a run
that streams from it (only while every replica of its adapter is down do runs go to
one marked so). An adapter whose replicas are all down makes its targets unavailable
(:meth:`ReplicaHealth.all_down`), as a lone engine that cannot be reached does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TypeVar

import trio

from ..adapters.base import Adapter, AdapterError
from .gate import Gate

log = logging.getLogger(__name__)

K = TypeVar("K")
#: What an engine said it serves (None: it does not say), or why it could not say.
Models = frozenset[str] | AdapterError | None


async def ask_models(key: K, adapter: Adapter, answers: dict[K, Models]) -> None:
    """Put what ``adapter``'s engine serves (or why it did not say) in ``answers[key]``."""
    try:
        answers[key] = await adapter.served_models()
    except AdapterError as exc:
        answers[key] = exc


class ReplicaHealth:
    """The replicas marked down (by adapter and replica name) and why; see the module
    docstring. ``engines``: each replicated adapter's replicas' adapters."""

    def __init__(self, gate: Gate, engines: Mapping[str, Mapping[str, Adapter]]) -> None:
        self.gate = gate
        self.engines = engines
        self.down: dict[tuple[str, str], str] = {}
        #: counts every change of a mark, so a watcher can tell a change happened
        self.changes = 0

    def __repr__(self) -> str:
        total = sum(len(r) for r in self.engines.values())
        return f"<ReplicaHealth {len(self.down)}/{total} down>"

    def answered(self, adapter: str, replica: str, why: str | None) -> None:
        """How ``replica`` answered a run: ``why`` it failed it before a first token
        (it is marked down), or None: it streamed it (a mark is cleared)."""
        key = (adapter, replica)
        if why is not None and key not in self.down:
            log.warning("adapter %s: replica %s is down: %s", adapter, replica, why)
            self.down[key] = why
            self.gate.mark_replica(adapter, replica, True)
            self.changes += 1
        elif why is None and key in self.down:
            self._clear(key, "a run streamed from it")

    def _clear(self, key: tuple[str, str], how: str) -> None:
        del self.down[key]
        self.gate.mark_replica(*key, False)
        self.changes += 1
        log.info("adapter %s: replica %s is up again (%s)", key[0], key[1], how)

    def all_down(self, adapter: str) -> str | None:
        """Why every replica of ``adapter`` is down, or None (one is up, or it has none)."""
        replicas = self.engines.get(adapter)
        if not replicas or any((adapter, r) not in self.down for r in replicas):
            return None
        return "every replica is down: " + "; ".join(
            f"{r}: {self.down[(adapter, r)]}" for r in replicas
        )

    async def probe(self) -> dict[str, Models]:
        """Ask every replica for its list of models, all at once (each bounded by its
        adapter): one that answers is cleared, one that cannot be reached is marked
        down. Returns each adapter's answer: the first replica's list that came, else
        the last error (what a lone engine's probe would say)."""
        answers: dict[tuple[str, str], Models] = {}
        async with trio.open_nursery() as nursery:
            for adapter, replicas in self.engines.items():
                for replica, engine in replicas.items():
                    nursery.start_soon(ask_models, (adapter, replica), engine, answers)
        combined: dict[str, Models] = {}
        for (adapter, replica), answer in answers.items():
            if isinstance(answer, AdapterError):
                self.answered(adapter, replica, f"its probe failed: {answer.message}")
                combined.setdefault(adapter, answer)
            else:
                if (adapter, replica) in self.down:
                    self._clear((adapter, replica), "a probe reached it")
                if isinstance(combined.get(adapter), AdapterError) or adapter not in combined:
                    combined[adapter] = answer
        return combined
