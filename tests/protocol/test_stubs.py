"""The committed gRPC stubs are what eyas.proto generates (eyas/protocol/stubs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.protocol import stubs


def test_committed_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = stubs.regenerate(tmp_path)
    assert set(fresh) == set(stubs.STUB_NAMES)
    for name, path in fresh.items():
        committed = stubs.PROTOCOL_DIR / name
        assert committed.exists(), f"{name}: not committed; run python -m eyas.protocol.stubs"
        assert stubs.normalize(committed.read_text()) == stubs.normalize(path.read_text()), (
            f"{name}: stale; run python -m eyas.protocol.stubs"
        )


def test_grpc_module_imports_messages_through_the_package():
    text = (stubs.PROTOCOL_DIR / "eyas_pb2_grpc.py").read_text()
    assert stubs.PACKAGE_IMPORT in text
    assert "\nimport eyas_pb2" not in text
    from eyas.protocol import eyas_pb2, eyas_pb2_grpc

    assert eyas_pb2.DESCRIPTOR.package == "eyas.v1"
    assert {"Eyas", "Verifier"} <= set(eyas_pb2.DESCRIPTOR.services_by_name)
    assert hasattr(eyas_pb2_grpc, "VerifierStub") and hasattr(eyas_pb2_grpc, "add_EyasServicer_to_server")


def test_bare_import_is_rewritten_and_version_lines_are_ignored():
    fixed = stubs._fix_imports("eyas_pb2_grpc.py", "import grpc\nimport eyas_pb2 as eyas__pb2\n")
    assert fixed == "import grpc\nfrom eyas.protocol import eyas_pb2 as eyas__pb2\n"
    a = (
        "# source: x\n# Protobuf Python Version: 7.35.1\nimport a\n"
        "_runtime_version.ValidateProtobufRuntimeVersion(\n    _runtime_version.Domain.PUBLIC,\n"
        "    7,\n    35,\n    1,\n    '',\n    'eyas/protocol/eyas.proto'\n)\nGRPC_GENERATED_VERSION = '1.85.1'\nX = 1\n"
    )
    b = a.replace("7.35.1", "8.0.0").replace("    35,", "    0,").replace("1.85.1", "2.0.0")
    assert stubs.normalize(a) == stubs.normalize(b) == "# source: x\nimport a\nX = 1\n"
    assert stubs.normalize(a) != stubs.normalize(a.replace("X = 1", "X = 2"))


def test_stale_stubs_reports_a_changed_file(tmp_path):
    pytest.importorskip("grpc_tools")
    for name in stubs.STUB_NAMES:
        Path(tmp_path, name).write_text((stubs.PROTOCOL_DIR / name).read_text())
    assert stubs.stale_stubs(tmp_path) == []
    grpc_stub = Path(tmp_path, "eyas_pb2_grpc.py")
    grpc_stub.write_text(grpc_stub.read_text() + "\n# edited\n")
    assert stubs.stale_stubs(tmp_path) == ["eyas_pb2_grpc.py"]
