"""Whether a node is ready for runs (``/readyz``), component by component: each
component's state in words and whether it is ok; the node is ready when all are.

Read from the node (and its edge link, if any) each time it is asked; nothing is kept.
"""

from __future__ import annotations

import math
from typing import Any

from ..runtime import Node
from ..runtime.capacity import LearnedCapacity

#: One component's state: ``{"ok": bool, "state": str}`` (the form ``/readyz`` shows).
Component = dict[str, Any]


def node_readiness(node: Node, link: Any) -> tuple[bool, dict[str, Component]]:
    """Whether ``node`` is ready for runs, and the state of each component that decides
    it: ``node`` (running and admitting), ``store`` (writable), ``target:<name>`` (its
    engine answered the last probe and serves its model; available until probed),
    ``replica:<adapter>@<url>`` (up, or down and why; always ok: its target says
    whether another is up), ``capacity:<pool>`` (what a learned concurrency has
    learned; always ok), ``edge``
    (``link`` is up; only when ``link`` is not None)."""
    components: dict[str, Component] = {
        "node": _node_state(node),
        "store": _store_state(node),
    }
    for target in node.targets:
        why = node.unavailable.get(target)
        components[f"target:{target}"] = {
            "ok": why is None,
            "state": "available" if why is None else f"unavailable: {why}",
        }
    for adapter, replicas in node.replicas.items():
        for replica in replicas:
            down = node.replica_health.down.get((adapter, replica))
            components[f"replica:{adapter}@{replica}"] = {
                "ok": True,  # its target is ready while another replica is up
                "state": "up" if down is None else f"down: {down}",
            }
    for pool, learner in node.learners.items():
        components[f"capacity:{pool}"] = {"ok": True, "state": _learned_state(learner.learned)}
    if link is not None:
        up = link.session is not None
        components["edge"] = {
            "ok": up,
            "state": "up" if up else f"down: {link.last_error or 'connecting'}",
        }
    return all(c["ok"] for c in components.values()), components


def _node_state(node: Node) -> Component:
    try:
        manager = node.manager
    except RuntimeError:
        return {"ok": False, "state": "stopped: the node is not running"}
    admitting = manager.admitting
    return {
        "ok": admitting,
        "state": "running" if admitting else "draining: the node admits no new runs",
    }


def _store_state(node: Node) -> Component:
    store = node.store.health()
    return {
        "ok": store.writable,
        "state": "writable" if store.writable else f"the run store {store}",
    }


def _learned_state(learned: LearnedCapacity | None) -> str:
    """A learned concurrency in words (``learned`` None: nothing learned yet)."""
    if learned is None:
        return "asking the engine"
    budget = "-" if learned.budget == math.inf else f"{learned.budget:.0f}"
    said = f"learned from {learned.signal}: {learned.limit} runs, {budget} tokens"
    if learned.last is not None:
        said += f" (last: {learned.last.reason})"
    return said
