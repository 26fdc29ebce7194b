"""The failure every command reports in one line, and how ``main`` says each kind.

:class:`CliError` is a command's own failure; :data:`FAILURES` is the table ``main``
reads to turn what a command raised into a message and an exit code (0 ok, 1 the run
or command failed, 2 bad usage or configuration, 130 Ctrl-C).
"""

from __future__ import annotations

from typing import TextIO

import attrs

from ..config import ConfigError
from ..store import StoreError


class CliError(Exception):
    """A failure to report in one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code

    def __repr__(self) -> str:
        return f"CliError({str(self)!r}, code={self.code})"


@attrs.frozen
class Failure:
    """How ``main`` reports an exception of ``kind``: ``prefix`` before its message on
    stderr (no line at all when ``says`` is false), and the exit status (``None``: the
    exception's own ``code``)."""

    kind: type[BaseException]
    prefix: str = ""
    code: int | None = None
    says: bool = True


#: The failures a command may end with, first match wins; anything else is a bug and
#: propagates (with its traceback).
FAILURES: tuple[Failure, ...] = (
    Failure(ConfigError, code=2),
    Failure(CliError),
    Failure(StoreError, prefix="store: ", code=1),
    Failure(KeyboardInterrupt, code=130, says=False),
)


def report(exc: BaseException, err: TextIO) -> int | None:
    """Say ``exc`` on ``err`` as :data:`FAILURES` does and return its exit status, or
    None (nothing written) when it is not an expected failure."""
    for failure in FAILURES:
        if isinstance(exc, failure.kind):
            if failure.says:
                err.write(f"iop-node: {failure.prefix}{exc}\n")
            if failure.code is not None:
                return failure.code
            assert isinstance(exc, CliError)
            return exc.code
    return None
