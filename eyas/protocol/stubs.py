"""Generate the committed gRPC stubs (`eyas_pb2.py`, `eyas_pb2_grpc.py`) from `eyas.proto`.

    python -m eyas.protocol.stubs            # rewrite eyas/protocol/eyas_pb2*.py in place

The stubs are committed so that importing `eyas.protocol` needs grpcio and protobuf only, never
grpcio-tools. `tests/protocol/test_stubs.py` regenerates them into a temporary folder and fails
when the committed ones are stale.

protoc runs with the folder that holds the `eyas` package as its include root and the proto as
`eyas/protocol/eyas.proto`, so the generated grpc module imports its messages as
`from eyas.protocol import eyas_pb2` and the descriptor is registered under that path, never
as a bare top-level `eyas_pb2`. `regenerate` rewrites a bare `import eyas_pb2` should a
generator still write one, and checks the import it leaves (docs/architecture.md, "The wire contract").
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_NAME = "eyas.proto"
PROTOCOL_DIR = Path(__file__).resolve().parent  # .../eyas/protocol
INCLUDE_ROOT = PROTOCOL_DIR.parent.parent  # the folder that holds the eyas package
PROTO_RELPATH = Path("eyas", "protocol", PROTO_NAME)  # as protoc sees it from INCLUDE_ROOT
STUB_NAMES = ("eyas_pb2.py", "eyas_pb2_grpc.py")
PACKAGE_IMPORT = "from eyas.protocol import eyas_pb2 as "

_BARE_IMPORT = re.compile(r"^import eyas_pb2 as (\w+)$", re.MULTILINE)
# Lines that name the generator's version, not the contract; `normalize` drops them.
_VERSION_LINES = (
    re.compile(r"^# Protobuf Python Version: .*\n", re.MULTILINE),
    re.compile(r"^GRPC_GENERATED_VERSION = .*\n", re.MULTILINE),
    re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:[ \t].*\n)*?\)\n", re.MULTILINE),
)


def _fix_imports(name: str, text: str) -> str:
    """Make the grpc module import its messages through the package (deterministic rewrite)."""
    if name != "eyas_pb2_grpc.py":
        return text
    text = _BARE_IMPORT.sub(r"from eyas.protocol import eyas_pb2 as \1", text)
    if PACKAGE_IMPORT not in text:
        raise RuntimeError(f"{name}: the generated grpc module does not import {PACKAGE_IMPORT!r}")
    return text


def regenerate(out_dir: str | Path | None = None) -> dict[str, Path]:
    """Run `python -m grpc_tools.protoc` on eyas.proto; write the stubs into `out_dir`.

    `out_dir` defaults to eyas/protocol/ (the committed stubs). Returns {stub name: path}.
    Needs grpcio-tools, a development dependency only.
    """
    out_dir = PROTOCOL_DIR if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={INCLUDE_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_RELPATH),
        ]
        done = subprocess.run(cmd, cwd=INCLUDE_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed ({done.returncode}): {done.stderr.strip()}")
        written: dict[str, Path] = {}
        for name in STUB_NAMES:
            generated = Path(tmp, PROTO_RELPATH.parent, name)
            text = _fix_imports(name, generated.read_text())
            target = out_dir / name
            target.write_text(text)
            written[name] = target
    return written


def normalize(text: str) -> str:
    """Stub text without the lines that only name the generator's version."""
    for pattern in _VERSION_LINES:
        text = pattern.sub("", text)
    return text


def stale_stubs(committed_dir: str | Path = PROTOCOL_DIR) -> list[str]:
    """Names of the stubs in `committed_dir` that differ from a fresh generation (empty: fresh)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = regenerate(tmp)
        stale = []
        for name, path in fresh.items():
            committed = Path(committed_dir, name)
            if not committed.exists() or normalize(committed.read_text()) != normalize(path.read_text()):
                stale.append(name)
    return stale


if __name__ == "__main__":
    for stub in regenerate().values():
        print(stub)
