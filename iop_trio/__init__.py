"""iop-trio: an IOP inference node on Trio."""

__version__ = "0.1.0"
