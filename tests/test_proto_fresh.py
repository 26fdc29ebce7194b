"""The generated protobuf code must be what grpcio-tools makes from proto/ now."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_genproto():
    spec = importlib.util.spec_from_file_location("genproto", ROOT / "tools" / "genproto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date():
    stale = load_genproto().stale_files()
    assert stale == [], f"run `make proto`: stale generated files {stale}"


def test_the_check_notices_a_change(tmp_path, monkeypatch):
    genproto = load_genproto()
    fake_out = tmp_path / "gen"
    genproto.generate(fake_out)
    (fake_out / "iop" / "runtime_pb2.py").write_text("# edited by hand\n")
    monkeypatch.setattr(genproto, "OUT_DIR", fake_out)
    assert genproto.stale_files() == ["iop/runtime_pb2.py"]


def test_upb_backend_is_in_use():
    from google.protobuf.internal import api_implementation

    assert api_implementation.Type() == "upb"
