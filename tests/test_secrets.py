"""Secrets stay secret: credentials in an engine's URL never reach a caller, a log or
the store. (Config: tests/test_config.py; the store's file modes:
tests/test_store_sqlite.py.)"""

from __future__ import annotations

from iop_trio.model import redact_url
from iop_trio.runtime import RunSpec, RunStatus

from .engines import OPENAI, make_node, refused_port, run_to_end


def test_redact_url():
    assert redact_url("http://admin:s3cret@engine:8000/v1") == "http://***@engine:8000/v1"
    assert redact_url("https://token@engine") == "https://***@engine"
    assert redact_url("http://engine:8000/a@b") == "http://engine:8000/a@b"  # a path, not a user
    assert redact_url("http://engine") == "http://engine"


async def test_credentials_in_an_engine_url_are_never_shown():
    with refused_port() as port:
        adapter = OPENAI.adapter(f"http://admin:s3cret@127.0.0.1:{port}")
        assert "s3cret" not in repr(adapter)
        node = make_node(adapter, model="qwen")
        async with node.running():
            record, events = await run_to_end(node, RunSpec("vllm/qwen", "p"))
        await adapter.aclose()
    assert record.status is RunStatus.FAILED
    assert f"http://***@127.0.0.1:{port}" in record.message
    assert all("s3cret" not in (e.message or "") for e in events)
    assert "s3cret" not in record.message
