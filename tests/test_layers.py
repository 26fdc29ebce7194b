"""What each layer loads when imported, in a fresh interpreter.

`lint-imports` (in `make test`) checks the import statements against the
contracts in pyproject.toml; this checks what actually ends up in
``sys.modules``, package ``__init__`` files and re-exports included.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("trio", "trio_websocket", "httpx", "sqlite3", "google.protobuf", "hypercorn", "yaml")


def loaded_by(module: str) -> set[str]:
    code = (
        "import json, sys\n"
        f"import {module}\n"
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out))


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        ("iop_trio.model", set()),
        ("iop_trio.lifecycle", set()),
        ("iop_trio.protocol", {"google.protobuf"}),
        ("iop_trio.store", {"trio"}),  # an async interface; no sqlite3
        ("iop_trio.adapters", set()),
        ("iop_trio.runtime", {"trio"}),
    ],
)
def test_a_layer_loads_only_what_it_needs(module, allowed):
    assert loaded_by(module) <= allowed
