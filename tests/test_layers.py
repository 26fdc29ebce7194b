"""What each layer loads when imported, in a fresh interpreter.

`lint-imports` (in `make test`) checks the import statements against the
contracts in pyproject.toml; this checks what actually ends up in
``sys.modules``, package ``__init__`` files and re-exports included.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = (
    "trio",
    "trio_websocket",
    "httpx",
    "sqlite3",
    "google.protobuf",
    "hypercorn",
    "yaml",
    # what records spans is the CLI's to install: the package uses only the API
    "opentelemetry.sdk",
)


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
        ("iop_trio.tracing", set()),
        ("iop_trio.lifecycle", set()),
        ("iop_trio.protocol", {"google.protobuf"}),
        ("iop_trio.store", {"trio"}),  # an async interface; no sqlite3
        ("iop_trio.adapters", set()),
        ("iop_trio.runtime", {"trio"}),
        ("iop_trio.edge", set(HEAVY) - {"opentelemetry.sdk"}),
    ],
)
def test_a_layer_loads_only_what_it_needs(module, allowed):
    assert loaded_by(module) <= allowed


PACKAGE = Path(__file__).resolve().parent.parent / "iop_trio"
#: Issue 21's rooms: a module a newcomer can read, a function that fits on a screen.
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60


def package_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_gen" not in p.relative_to(PACKAGE).parts)


def test_no_module_of_the_package_is_over_800_lines():
    sizes = {
        str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in package_modules()
    }
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_of_the_package_is_over_60_lines():
    long = {}
    for path in package_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert long == {}
