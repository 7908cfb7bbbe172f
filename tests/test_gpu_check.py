"""bench/gpu_check.py, the prepared device check, runs here on the CPU at tiny sizes, so that it is
known to work before it first meets a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_section_runs_on_the_cpu_at_tiny_sizes_and_fp32_is_exact(gpu_check, tmp_path, capsys, dtype):
    out = tmp_path / "gpu_check.json"
    assert (
        gpu_check.main(
            [
                "--device",
                "cpu",
                "--dtype",
                dtype,
                "--tiny",
                "--prompts",
                "3",
                "--max-new-tokens",
                "12",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert all(sections[k]["ok"] for k in ("load", "identity", "speed", "curve")), sections
    assert sections["training"]["ok"] and set(sections["training"]["tokens_s"]) == {"packed", "one_by_one"}
    assert all(v > 0 for v in sections["training"]["tokens_s"].values())
    assert sections["identity"]["prompts"] == 3
    if dtype == "float32":
        assert sections["identity"]["identical"] == 3
    assert set(sections["speed"]["tok_s"]) == {
        "eyas_target_only_b1",
        "eyas_eagle3_b1",
        "eyas_target_only_b16",
        "hf_generate_b1",
        "hf_generate_b16",
    }
    assert all(v > 0 for v in sections["speed"]["tok_s"].values())
    assert list(sections["curve"]["verify_ms"]) == ["1", "2", "4", "8", "16", "32", "64"]
    assert "summary (cpu, " in capsys.readouterr().out


def test_a_failing_section_is_reported_and_the_others_still_run(gpu_check, tmp_path, monkeypatch):
    """A section that raises (as a path not yet done on a new device would) is named with its error;
    the run goes on and exits 1."""
    out = tmp_path / "gpu_check.json"

    def broken(*_a, **_k):
        raise RuntimeError("Expected all tensors to be on the same device (test)")

    monkeypatch.setattr(gpu_check, "decode_batch", broken)
    assert (
        gpu_check.main(
            [
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--tiny",
                "--prompts",
                "2",
                "--max-new-tokens",
                "6",
                "--json",
                str(out),
            ]
        )
        == 1
    )
    sections = json.loads(out.read_text())["sections"]
    assert not sections["speed"]["ok"] and "same device (test)" in sections["speed"]["error"]
    assert sections["identity"]["ok"] and sections["curve"]["ok"]
