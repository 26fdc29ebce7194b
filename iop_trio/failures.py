"""The store's failures, kept below every layer that raises or answers them.

The store raises :class:`StoreUnavailable`, and the protocol's one error table
(:mod:`iop_trio.protocol.errors`) answers it, but neither layer may import the
other; so the classes live here, in the bottom layer, importing nothing. The
store re-exports them (``iop_trio.store.StoreUnavailable`` is the public name).

The model's own failures (``InvalidRequest``, ``UnknownTarget``, ``UnknownRun``,
``NodeUnavailable``) are in :mod:`iop_trio.model`; those of an exchange and of the
edge (``RemoteError``, ``SessionClosed``, ``NoNode``, ...) are in
:mod:`iop_trio.protocol.errors`, next to the table.
"""

from __future__ import annotations


class StoreError(Exception):
    """The store could not do what was asked (I/O, corruption, a refused event)."""


class StoreUnavailable(StoreError):
    """The store cannot write now (disk full, I/O error): nothing was changed; retry later."""
