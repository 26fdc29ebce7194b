"""What a value must be to be a limit, a duration or a weight: the ``*_problem`` checks
that say what is wrong in words (None: nothing), the ``check_*`` ones that raise
ValueError naming the value, and :func:`field_check`, which makes an attrs validator of a
``*_problem``. Config, the model and the runtime ask the same ones, so they agree.

This module imports only the standard library; it is the bottom of the package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def limit_problem(value: object, minimum: int = 0) -> str | None:
    """What is wrong with ``value`` as a concurrency or queue limit, or None if nothing.

    A limit is an int (``True`` is not one) of at least ``minimum``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        return f"must be an integer >= {minimum}, not {value!r}"
    return None


def check_limit(what: str, value: object, minimum: int = 0) -> int:
    """``value`` if it is a limit (see :func:`limit_problem`), else ValueError naming ``what``."""
    problem = limit_problem(value, minimum)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    assert isinstance(value, int)
    return value


def seconds_problem(value: object, *, positive: bool = False) -> str | None:
    """What is wrong with ``value`` as a duration in seconds (>= 0, or > 0), or None."""
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (value > 0 or (value == 0 and not positive))  # NaN is neither
    ):
        return None
    if positive:
        return f"must be a number of seconds > 0, not {value!r}"
    return f"must be a number >= 0, not {value!r}"


def positive_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a finite number > 0 (a weight, a cap), or None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf:
        return None
    return f"must be a number > 0, not {value!r}"


def check_seconds(what: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float if it is a duration (see :func:`seconds_problem`), else ValueError."""
    problem = seconds_problem(value, positive=positive)
    if problem is not None:
        raise ValueError(f"{what} {problem}")
    assert isinstance(value, int | float)
    return float(value)


def field_check(problem: Callable[[Any], str | None]) -> Callable[[Any, Any, Any], None]:
    """An attrs validator from a ``*_problem`` function: None passes, else
    ``ValueError("<field>: <problem>")`` (the form config errors name keys by)."""

    def check(_: Any, attribute: Any, value: Any) -> None:
        found = None if value is None else problem(value)
        if found is not None:
            raise ValueError(f"{attribute.name}: {found}")

    return check
