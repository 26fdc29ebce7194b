"""The reference edge: used by tests, the demo and the CLI."""

from .edge import Edge, NodeGone, NodeHandle, NoNode

__all__ = ["Edge", "NoNode", "NodeGone", "NodeHandle"]
