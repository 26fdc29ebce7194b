"""The reference edge: used by tests, the demo and the CLI."""

from .edge import Edge, NodeHandle, NoNode

__all__ = ["Edge", "NoNode", "NodeHandle"]
