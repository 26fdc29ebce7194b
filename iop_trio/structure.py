"""Plain data (parsed YAML or JSON) structured into attrs classes, strictly, with each
problem named by where it is.

:func:`strict_converter` makes a cattrs converter that takes no value of another type
for a scalar (``2.5`` or ``true`` is not an integer, ``1`` is not a string) and no
unknown key; :func:`problems` turns what it raises into ``(path, problem)`` pairs, the
path in the data's own terms (``targets[0].adapter``, ``messages[2].content``). The
node's config (:mod:`iop_trio.config`) and the edge's OpenAI-compatible door both
structure with them, so a problem reads the same wherever it comes from.
"""

from __future__ import annotations

import re
from typing import Any

import cattrs


def strict_converter(*, forbid_extra_keys: bool = True) -> cattrs.Converter:
    """A converter whose ``int``, ``float`` (any int or float, made a float), ``str`` and
    ``bool`` take only values of that type, ``Any`` takes anything, and whose classes
    refuse unknown keys (unless ``forbid_extra_keys`` is false)."""
    conv = cattrs.Converter(forbid_extra_keys=forbid_extra_keys)

    def exact_int(value: Any, _: type) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, not {value!r}")
        return value

    def number(value: Any, _: type) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"must be a number, not {value!r}")
        return float(value)

    def text(value: Any, _: type) -> str:
        if not isinstance(value, str):
            raise ValueError(f"must be a string, not {value!r}")
        return value

    def boolean(value: Any, _: type) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {value!r}")
        return value

    conv.register_structure_hook(int, exact_int)
    conv.register_structure_hook(float, number)
    conv.register_structure_hook(str, text)
    conv.register_structure_hook(bool, boolean)
    conv.register_structure_hook(Any, lambda value, _: value)
    return conv


def _format(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return (
            f"required key {exc.args[0]!r} is missing" if exc.args else "a required key is missing"
        )
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown key(s) {', '.join(sorted(exc.extra_fields))}"
    literal = re.fullmatch(r"(.*) not in literal typing\.Literal\[(.*)\]", str(exc))
    if literal:
        return f"must be one of {literal.group(2)}, not {literal.group(1)!r}"
    if isinstance(exc, ValueError | TypeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def problems(exc: Exception, prefix: str = "") -> list[tuple[str, str]]:
    """``(path, problem)`` for each problem in a cattrs error (the path without the
    leading ``$.``, under ``prefix`` if given; "" for the data as a whole). A validator
    that names its own field (``"field: problem"``) has it added to the path."""
    found = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_format):
        message, _, path = line.rpartition(" @ ")
        path = re.sub(r"\['([^']*)'\]", r".\1", path).removeprefix("$").removeprefix(".")
        if ": " in message and not message.startswith(("required", "unknown")):
            field, _, rest = message.partition(": ")
            if re.fullmatch(r"[a-z_][a-z0-9_]*(, [a-z_][a-z0-9_]*)*", field):
                path = f"{path}.{field}" if path else field
                message = rest
        found.append((".".join(p for p in (prefix, path) if p), message))
    return found
