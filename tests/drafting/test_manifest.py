"""Drafter checkpoints: round trip, fingerprint refusal, bad files named by field."""
from __future__ import annotations

import json

import pytest
import torch

from eyas.drafting.manifest import load_drafter, manifest_for, read_manifest, save_drafter
from eyas.drafting.model import DrafterConfig, init_drafter
from eyas.target.loader import TargetFingerprint
from eyas.target.model import eagle3_feature_address

FP = TargetFingerprint("cfg", "weights", "tok")


@pytest.fixture
def saved(tiny_target, tmp_path):
    drafter = init_drafter(DrafterConfig.for_target("eagle3", tiny_target.cfg, draft_vocab_size=16), seed=2)
    drafter.set_draft_vocab(torch.arange(16, dtype=torch.int64) * 2)
    taps = eagle3_feature_address(tiny_target.cfg)
    save_drafter(tmp_path, drafter, manifest_for("eagle3", drafter, FP, taps))
    return drafter, taps, tmp_path


def test_round_trip_in_fp16(saved):
    drafter, taps, folder = saved
    loaded, manifest = load_drafter(folder, FP, taps)
    assert manifest.taps() == taps and torch.equal(loaded.d2t, drafter.d2t) and bool(loaded.t2d[30])
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        if a.is_floating_point():
            assert b.dtype == torch.float32 and torch.allclose(a, b, atol=1e-3), name


@pytest.mark.parametrize("field", ["config_digest", "weight_digest", "tokenizer_digest"])
def test_other_target_is_refused(saved, field):
    _, taps, folder = saved
    other = TargetFingerprint(**{**FP.to_dict(), field: "something-else"})
    with pytest.raises(ValueError, match=f"target_fingerprint.{field}"):
        load_drafter(folder, other)


def test_other_feature_address_is_refused(saved):
    _, taps, folder = saved
    with pytest.raises(ValueError, match="feature_address"):
        load_drafter(folder, FP, taps[:1])


def test_bad_manifest_field_is_named(saved):
    _, _, folder = saved
    raw = json.loads((folder / "manifest.json").read_text())
    raw["feature_address"][0]["layers_applied"] = -3
    (folder / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="manifest.feature_address.0.layers_applied"):
        read_manifest(folder)


def test_wrong_tensor_shape_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, folder = saved
    state = load_file(str(folder / "model.safetensors"))
    state["fuse.weight"] = state["fuse.weight"][:, :3].contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="checkpoint.fuse.weight"):
        load_drafter(folder, FP)


def test_bad_draft_vocab_map_is_refused(saved):
    from safetensors.torch import load_file, save_file

    _, _, folder = saved
    state = load_file(str(folder / "model.safetensors"))
    state["d2t"] = torch.zeros_like(state["d2t"])  # not distinct
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_drafter(folder, FP)
