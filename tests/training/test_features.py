"""The feature cache: resumable extraction, exact features, refusal of a stale cache."""

from __future__ import annotations

import pytest
import torch

from eyas.training.data import Sample
from eyas.training.features import FeatureCache, training_taps
from tests.testing import ours_from_hf, tiny_hf

FP = {"config_digest": "c", "weight_digest": "w", "tokenizer_digest": "t"}


def samples(n: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        S = 10 + i
        ids = torch.randint(0, 32, (S,), generator=g)
        out.append(Sample(f"s{i}", ids, torch.arange(S) > 3, torch.zeros(S, dtype=torch.int64), torch.arange(S)))
    return out


class Boom(RuntimeError):
    pass


def test_extraction_resumes_and_matches_a_plain_forward(tmp_path, monkeypatch):
    model = ours_from_hf(tiny_hf("llama", vocab=32, seed=4))
    taps = training_taps(model)
    data = samples(5)
    cache = FeatureCache(tmp_path)
    calls = {"n": 0}
    real_forward = type(model).forward

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # dies inside the second shard
            raise Boom()
        return real_forward(self, *a, **k)

    monkeypatch.setattr(type(model), "forward", flaky)
    with pytest.raises(Boom):
        cache.extract(model, FP, data, taps, {"split": "t"}, shard_size=2)
    assert [s["file"] for s in cache.manifest()["shards"]] == ["shard_00000.safetensors"]
    first_mtime = (tmp_path / "shard_00000.safetensors").stat().st_mtime_ns
    with pytest.raises(ValueError, match="incomplete"):
        cache.samples()
    monkeypatch.setattr(type(model), "forward", real_forward)
    cache.extract(model, FP, data, taps, {"split": "t"}, shard_size=2)
    assert (tmp_path / "shard_00000.safetensors").stat().st_mtime_ns == first_mtime  # not recomputed
    got = cache.samples()
    assert [g.sample_id for g in got] == [s.sample_id for s in data]
    for g, s in zip(got, data):
        n = len(s.input_ids)
        ref = model(
            s.input_ids[None],
            s.position_id[None],
            model.allocate_cache(1, n),
            0,
            torch.ones(n, n, dtype=torch.bool).tril()[None],
            taps,
            logits_rows="none",
        ).features[0]
        assert torch.equal(g.input_ids, s.input_ids) and torch.equal(g.loss_mask, s.loss_mask)
        assert torch.allclose(g.features.float(), ref, atol=2e-3, rtol=1e-3)


def test_other_data_config_is_refused(tmp_path):
    model = ours_from_hf(tiny_hf("llama", vocab=32, seed=4))
    cache = FeatureCache(tmp_path)
    cache.extract(model, FP, samples(2), training_taps(model), {"split": "t"})
    with pytest.raises(ValueError, match="feature_cache.data"):
        cache.extract(model, FP, samples(2), training_taps(model), {"split": "other"})
    with pytest.raises(ValueError, match="feature_cache.target_fingerprint.tokenizer_digest"):
        cache.extract(model, {**FP, "tokenizer_digest": "x"}, samples(2), training_taps(model), {"split": "t"})


def test_a_streamed_cache_reads_the_same_features_from_disk(tmp_path):
    """samples(stream=True): ids and masks in memory, each sample's features read from its shard on
    access -- bit-identical to the in-memory read, across shard boundaries."""
    from eyas.training.features import StoredFeatureBatch
    from tests.testing import ours_from_hf, tiny_hf
    from tests.training.test_trainer import FINGERPRINT, synthetic_samples

    model = ours_from_hf(tiny_hf("llama", vocab=48, hidden=32, layers=4, seed=11))
    cache = FeatureCache(tmp_path / "c")
    cache.extract(model, FINGERPRINT, synthetic_samples(10, 48, 0), training_taps(model), {"split": "x"}, shard_size=4)
    eager, streamed = cache.samples(), cache.samples(stream=True)
    assert len(eager) == len(streamed) == 10 and all(isinstance(s, StoredFeatureBatch) for s in streamed)
    for a, b in zip(eager, streamed):
        assert a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.features, b.features)
