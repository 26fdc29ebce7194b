"""The rules of a caller's run options: the options no caller may set
(:data:`PINNED_OPTIONS`), what an ``option_caps`` entry means (:func:`option_range`)
and may be (:func:`option_rules_problem`), and how options merge over a profile's
params (:func:`overlay`). :meth:`iop_trio.model.TargetSpec.caller_options` applies them.

Sans I/O; this module imports only attrs, the standard library and :mod:`iop_trio.checks`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .checks import positive_problem

#: Run options no caller may ever set: they choose the engine, the model or what the
#: operator pins (a mapping option is refused whole; its keys may be allowed one by one).
PINNED_OPTIONS = frozenset(
    {
        "model",
        "base_url",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "keep_alive",
        "system",
        "format",
        "extra_body",
        "options",
        "api_key",
        "headers",
    }
)


def pinned_problem(name: str) -> str | None:
    """Why ``name`` cannot be in a target's ``allow_options``, or None."""
    if name in PINNED_OPTIONS or name.rpartition(".")[2] in PINNED_OPTIONS:
        return f"option {name!r} is pinned by the operator; no caller may set it"
    return None


#: The low end of a capped option's range when its target gives none (see
#: :func:`option_range`): a count of tokens or choices is at least 1 (engines read 0 or
#: less as "no limit": Ollama's ``num_predict`` -1 writes until the context is full,
#: -2 until it is filled), any other option 0.
OPTION_FLOORS: Mapping[str, float] = {
    "max_tokens": 1,
    "max_completion_tokens": 1,
    "num_predict": 1,
    "n": 1,
}


@attrs.frozen
class OptionRange:
    """The range of a capped option: a caller's value under ``low`` is refused, one over
    ``high`` lowered to it (None: no high end)."""

    low: float
    high: float | None


def option_range(name: str, cap: object) -> OptionRange:
    """The range an ``option_caps`` entry means: a number is the high end, with the low
    end of :data:`OPTION_FLOORS` (by the option's last name part; 0 if not there); a
    mapping gives ``min`` and/or ``max`` itself (``{min: -2, max: 2}``). The entry must
    be valid (:func:`option_rules_problem`)."""
    floor = OPTION_FLOORS.get(name.rpartition(".")[2], 0)
    if isinstance(cap, Mapping):
        high = cap.get("max")
        return OptionRange(float(cap.get("min", floor)), None if high is None else float(high))
    assert isinstance(cap, int | float)
    return OptionRange(float(floor), float(cap))


def _cap_problem(cap: object) -> str | None:
    if not isinstance(cap, Mapping):
        return positive_problem(cap)
    if not cap or not set(cap) <= {"min", "max"}:
        return f"must be a number > 0 or a mapping of min and/or max, not {cap!r}"
    for key, value in cap.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{key} must be a number, not {value!r}"
        if not math.isfinite(value):
            return f"{key} must be a finite number, not {value!r}"
    if "min" in cap and "max" in cap and cap["min"] > cap["max"]:
        return f"min {cap['min']!r} is over max {cap['max']!r}"
    return None


def option_rules_problem(
    allow: Iterable[str], caps: Mapping[str, object]
) -> tuple[str, str] | None:
    """What is wrong with a target's rules for caller options, as (the key at fault,
    the problem), or None: an ``allow_options`` entry that is pinned, or an
    ``option_caps.<name>`` that is neither a number > 0 nor a mapping of a finite
    ``min`` and/or ``max`` (min <= max). Config and the node both ask."""
    for name in sorted(allow):
        problem = pinned_problem(name)
        if problem is not None:
            return "allow_options", problem
    for name, cap in caps.items():
        problem = _cap_problem(cap)
        if problem is not None:
            return f"option_caps.{name}", problem
    return None


def overlay(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top; where both hold a mapping under one key, those merge too.

    So a run's ``options={"options": {"temperature": 0}}`` keeps the profile's
    ``options.num_ctx``.
    """
    merged = dict(base)
    for key, value in over.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = overlay(old, value)
        else:
            merged[key] = value
    return merged


def output_bound(params: Mapping[str, Any], names: Iterable[str]) -> int | None:
    """The most tokens ``params`` let a run write: the value of the first of ``names``
    (``outer.inner`` for a key inside a mapping) that is an int of at least 1; None if
    none is (the run asks for no bound)."""
    for name in names:
        outer, _, inner = name.partition(".")
        value = params.get(outer)
        if inner:
            value = value.get(inner) if isinstance(value, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None
