"""The gauges read from the gate, the manager and the node at each scrape
(``iop_gate_*``, ``iop_node_*``, ``iop_store_writable``, ``iop_target_available``,
``iop_edge_link_*``) and the learned concurrency's adjustments: nothing is kept between
scrapes. Everything here runs in the Trio thread (it reads the gate without locks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..model import TenantLimits
from ..runtime import Node
from ..runtime.gate import GateStatistics, LimiterStats
from .table import METRICS, help_of

#: The label of the tenants whose share is not set (see the module docstring).
OTHER_TENANT = "other"


def priority_class(priority: int) -> str:
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


def tenant_label(node: Node, tenant: str) -> str:
    return tenant if tenant == "" or node.gate.is_set(tenant) else OTHER_TENANT


class GateCollector:
    """Reads the gate (and the manager, if running) at each scrape."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self.link: Any = None  # a NodeLink, once the node has one (NodeMetrics.watch_link)

    def describe(self) -> Iterable[Metric]:
        return [*self._families().values(), *self._link_families(), *self._adjustments()]

    def _adjustments(self) -> list[CounterMetricFamily]:
        """The moves of each learned concurrency, by why, and the runs it took back from
        its engine (counted by its learner)."""
        family = CounterMetricFamily(
            "iop_gate_limit_adjustments",
            help_of("iop_gate_limit_adjustments_total"),
            labels=["pool", "reason"],
        )
        taken = CounterMetricFamily(
            "iop_gate_runs_taken_back",
            help_of("iop_gate_runs_taken_back_total"),
            labels=["pool"],
        )
        for pool, learner in self._node.learners.items():
            if learner.learned is not None:
                for reason, count in learner.learned.moves.items():
                    family.add_metric([pool, reason], count)
                taken.add_metric([pool], learner.taken_back)
        return [family, taken]

    def _link_families(self) -> list[Metric]:
        if self.link is None:
            return []
        link = self.link
        up = GaugeMetricFamily("iop_edge_link_up", help_of("iop_edge_link_up"))
        up.add_metric([], int(link.session is not None))
        sessions = CounterMetricFamily(
            "iop_edge_link_sessions", help_of("iop_edge_link_sessions_total")
        )
        sessions.add_metric([], link.sessions)
        attempts = CounterMetricFamily(
            "iop_edge_link_attempts", help_of("iop_edge_link_attempts_total")
        )
        attempts.add_metric([], link.attempts)
        return [up, sessions, attempts]

    def collect(self) -> Iterable[Metric]:
        node = self._node
        stats = node.gate.statistics()
        g = self._families()
        for target, count in stats.queued_by_target.items():
            g["iop_gate_queued_runs"].add_metric([target], count)
        for target, tokens in stats.targets.items():
            g["iop_gate_running_runs"].add_metric([target], tokens.borrowed)
        configured = node.gate.tenants()
        _add_tenants(g, node, stats, configured)
        _add_priorities(g, stats)
        _add_levels(g, stats, configured)
        for pool, learner in node.learners.items():
            learned = learner.learned
            if learned is None:
                continue
            g["iop_gate_learned_signal"].add_metric([pool, learned.signal], 1)

        g["iop_gate_queue_length"].add_metric([], stats.queued)
        g["iop_gate_queue_max"].add_metric([], stats.max_queued)
        g["iop_gate_queue_timeout_seconds"].add_metric([], stats.queue_timeout)
        _add_node(g, node)
        _add_replicas(g, node)
        return [*g.values(), *self._link_families(), *self._adjustments()]

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {
            m.name: GaugeMetricFamily(m.name, m.help, labels=list(m.labels))
            for m in METRICS
            if m.type == "gauge" and not m.name.startswith("iop_edge_link")
        }


Gauges = dict[str, GaugeMetricFamily]


def _add_tenants(
    g: Gauges, node: Node, stats: GateStatistics, configured: Mapping[str, TenantLimits]
) -> None:
    """Queued and running runs by tenant label (every configured tenant, the default one
    and ``other`` show, at 0 if need be), and the configured tenants' weights."""
    queued: dict[str, int] = {"": 0, OTHER_TENANT: 0, **dict.fromkeys(configured, 0)}
    running = dict(queued)
    for tenant, count in stats.queued_by_tenant.items():
        label = tenant_label(node, tenant)
        queued[label] = queued.get(label, 0) + count
    for tenant, tokens in stats.tenants.items():
        label = tenant_label(node, tenant)
        running[label] = running.get(label, 0) + tokens.borrowed
    for label, count in queued.items():
        g["iop_gate_tenant_queued_runs"].add_metric([label], count)
    for label, count in running.items():
        g["iop_gate_tenant_running_runs"].add_metric([label], count)
    for tenant, share in configured.items():
        g["iop_gate_tenant_weight"].add_metric([tenant], share.weight)


def _add_priorities(g: Gauges, stats: GateStatistics) -> None:
    """Queued and running runs by priority class (all three show, at 0 if need be)."""
    for name, by_priority in (
        ("iop_gate_priority_queued_runs", stats.queued_by_priority),
        ("iop_gate_priority_running_runs", stats.running_by_priority),
    ):
        classes = dict.fromkeys(("high", "normal", "low"), 0)
        for priority, count in by_priority.items():
            classes[priority_class(priority)] += count
        for label, count in classes.items():
            g[name].add_metric([label], count)


def _add_levels(g: Gauges, stats: GateStatistics, configured: Mapping[str, TenantLimits]) -> None:
    """Each level's permits (limit, in use), and its tokens (budget, reserved) where it
    has a budget or holds tokens; tenants only where configured."""
    levels: list[tuple[str, Mapping[str, LimiterStats]]] = [
        ("global", {"global": stats.global_}),
        ("adapter", stats.adapters),
        ("target", stats.targets),
        ("tenant", {n: t for n, t in stats.tenants.items() if n in configured}),
        ("replica", stats.replicas),
    ]
    for level, by_name in levels:
        for name, tokens in by_name.items():
            g["iop_gate_permits_limit"].add_metric([level, name], float(tokens.limit))
            g["iop_gate_permits_in_use"].add_metric([level, name], tokens.borrowed)
            if tokens.budget != math.inf or tokens.reserved:
                g["iop_gate_token_budget"].add_metric([level, name], float(tokens.budget))
                g["iop_gate_tokens_reserved"].add_metric([level, name], tokens.reserved)


def _add_replicas(g: Gauges, node: Node) -> None:
    """Whether each replica is up (1) or marked down (0)."""
    for adapter, replicas in node.replicas.items():
        for replica in replicas:
            up = (adapter, replica) not in node.replica_health.down
            g["iop_replica_up"].add_metric([adapter, replica], int(up))


def _add_node(g: Gauges, node: Node) -> None:
    """The node's own: admitting, live runs (0 and 0 when it is not running), its info,
    its store's writability and each target's availability."""
    try:
        manager = node.manager
    except RuntimeError:  # not running
        admitting, live = 0, 0
    else:
        admitting, live = int(manager.admitting), manager.live_count()
    g["iop_node_admitting"].add_metric([], admitting)
    g["iop_node_live_runs"].add_metric([], live)
    g["iop_node_info"].add_metric([node.node_id, node.version], 1)
    g["iop_store_writable"].add_metric([], int(node.store.health().writable))
    for target in node.targets:
        g["iop_target_available"].add_metric([target], int(target not in node.unavailable))
