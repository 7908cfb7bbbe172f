"""Drafter checkpoints: round trip, fingerprint refusal, bad files named by field."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.drafting.manifest import load_drafter, manifest_for, read_manifest, save_drafter
from eyas.drafting.model import EYAS_V1, DrafterConfig, drafter_feature_address, init_drafter
from eyas.target.loader import TargetFingerprint

FP = TargetFingerprint("cfg", "weights", "tok")


@pytest.fixture
def saved(tiny_target, tmp_path):
    drafter = init_drafter(DrafterConfig.for_target("eagle3", tiny_target.cfg, draft_vocab_size=16), seed=2)
    drafter.set_draft_vocab(torch.arange(16, dtype=torch.int64) * 2)
    taps = drafter_feature_address(drafter.cfg, tiny_target.cfg)
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
    state["reduce.weight"] = state["reduce.weight"][:, :3].contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="checkpoint.reduce.weight"):
        load_drafter(folder, FP)


def test_bad_draft_vocab_map_is_refused(saved):
    from safetensors.torch import load_file, save_file

    _, _, folder = saved
    state = load_file(str(folder / "model.safetensors"))
    state["d2t"] = torch.zeros_like(state["d2t"])  # not distinct
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        load_drafter(folder, FP)


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_manifest_without_layout_is_eyas_v1(tiny_target, tmp_path, method):
    """Checkpoints written before layouts existed (the first shipped drafters) load as eyas-v1,
    whose tensors (a fuse projection over normed inputs) the reference layout does not have."""
    cfg = DrafterConfig.for_target(
        method, tiny_target.cfg, draft_vocab_size=16 if method == "eagle3" else None, layout=EYAS_V1
    )
    drafter = init_drafter(cfg, seed=3)
    save_drafter(tmp_path, drafter, manifest_for(method, drafter, FP, drafter_feature_address(cfg, tiny_target.cfg)))
    raw = json.loads((tmp_path / "manifest.json").read_text())
    del raw["drafter_config"]["layout"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    loaded, _ = load_drafter(tmp_path, FP)
    assert loaded.cfg.layout == EYAS_V1 and "fuse.weight" in loaded.state_dict()
    if method == "eagle3":
        assert all(t.normed for t in drafter_feature_address(loaded.cfg, tiny_target.cfg))


def test_trim_keeps_the_frequent_tokens_rows_and_everything_else(saved, tmp_path):
    """The saved drafter's vocabulary is the even ids 0..30; trimmed to its 5 most frequent tokens
    (ids 2, 8, 10, 14, 30 by the counts), the kept tokens score exactly as before (their head rows
    are the trained ones), every other weight is unchanged, the manifest says so, and the folder
    loads and round-trips."""
    from eyas.drafting.manifest import trim_drafter_vocab

    drafter, taps, folder = saved
    old, _ = load_drafter(folder, FP, taps)
    counts = torch.zeros(drafter.cfg.target_vocab_size, dtype=torch.int64)
    counts[torch.tensor([2, 8, 10, 14, 30, 4, 3])] = torch.tensor([50, 40, 30, 20, 60, 10, 99])  # 3 is not in it
    out = tmp_path / "trimmed"
    trimmed, manifest, old_d2t = trim_drafter_vocab(folder, out, FP, counts, 5, "the 5 most frequent")
    assert torch.equal(old_d2t, old.d2t)
    loaded, read = load_drafter(out, FP, taps)
    assert read == manifest and read.recipe["draft_vocab_trimmed"] == "the 5 most frequent"
    assert loaded.cfg.draft_vocab_size == 5 and loaded.d2t.tolist() == [2, 8, 10, 14, 30]
    assert loaded.t2d.nonzero().flatten().tolist() == [2, 8, 10, 14, 30]
    hidden = torch.randn(3, drafter.cfg.hidden_size)
    before = old.logits(hidden, None)  # [3, 16] over the even ids 0..30
    after = loaded.logits(hidden, None)  # [3, 5]
    slots = torch.tensor([1, 4, 5, 7, 15])  # ids 2, 8, 10, 14, 30 among the even ids
    assert torch.equal(loaded.head.weight, old.head.weight[slots])  # the trained rows, bit for bit
    torch.testing.assert_close(after, before[:, slots], rtol=1e-6, atol=1e-6)  # (a narrower matmul's rounding)
    kept = {k: v for k, v in old.state_dict().items() if k not in ("head.weight", "d2t", "t2d")}
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in kept.items())
    with pytest.raises(ValueError, match="^size: must be an int in \\[1, Vd=16\\]"):
        trim_drafter_vocab(folder, tmp_path / "big", FP, counts, 17, "")
    with pytest.raises(ValueError, match="^out: must differ"):
        trim_drafter_vocab(folder, folder, FP, counts, 5, "")
    with pytest.raises(ValueError, match="^token_counts: expected"):
        trim_drafter_vocab(folder, tmp_path / "c", FP, counts[:10], 5, "")
    assert not (tmp_path / "big").exists() and not (tmp_path / "c").exists()


def test_trim_refuses_an_eagle1_drafter(tiny_target, tmp_path):
    from eyas.drafting.manifest import trim_drafter_vocab

    drafter = init_drafter(DrafterConfig.for_target("eagle1", tiny_target.cfg), seed=2)
    taps = drafter_feature_address(drafter.cfg, tiny_target.cfg)
    save_drafter(tmp_path, drafter, manifest_for("eagle1", drafter, FP, taps))
    counts = torch.ones(tiny_target.cfg.vocab_size, dtype=torch.int64)
    with pytest.raises(ValueError, match="^drafter: .* is an eagle1 drafter"):
        trim_drafter_vocab(tmp_path, tmp_path / "out", FP, counts, 4, "")
