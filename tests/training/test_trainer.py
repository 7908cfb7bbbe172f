"""The trainer on a tiny random target: losses fall, resume is exact, ownership and fingerprints hold."""

from __future__ import annotations

import pytest
import torch

from eyas.drafting.manifest import load_drafter
from eyas.target.loader import TargetFingerprint
from eyas.training.config import TrainConfig
from eyas.training.data import Sample
from eyas.training.features import FeatureBatch, FeatureCache, training_taps
from eyas.training.trainer import DrafterTrainer
from tests.testing import ours_from_hf, tiny_hf

FINGERPRINT = {"config_digest": "cfg-a", "weight_digest": "w-a", "tokenizer_digest": "tok-a"}


def synthetic_samples(n: int, vocab: int, seed: int) -> list[Sample]:
    """Token streams with a learnable pattern (an arithmetic walk) and an assistant-like loss mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        S = int(torch.randint(24, 40, (1,), generator=g))
        start, stride = int(torch.randint(0, vocab, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        ids = (start + stride * torch.arange(S)) % vocab
        mask = torch.zeros(S, dtype=torch.bool)
        mask[S // 3 :] = True
        out.append(Sample(f"s{i}", ids, mask, torch.zeros(S, dtype=torch.int64), torch.arange(S)))
    return out


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    model = ours_from_hf(tiny_hf("llama", vocab=48, hidden=32, layers=4, seed=11))
    root = tmp_path_factory.mktemp("features")
    caches = []
    for name, n, seed in (("train", 24, 0), ("heldout", 6, 1)):
        cache = FeatureCache(root / name)
        cache.extract(model, FINGERPRINT, synthetic_samples(n, 48, seed), training_taps(model), {"split": name})
        caches.append(cache)
    return model, caches[0], caches[1]


def make(cfg_kwargs, tiny_setup, out):
    cfg_kwargs = {"lr": 3e-3, **cfg_kwargs}
    model, train, heldout = tiny_setup
    cfg = TrainConfig(
        batch_samples=4,
        warmup_steps=2,
        eval_every=1000,
        checkpoint_every=1000,
        draft_vocab_size=32,
        hass_steps=2,
        ttt_steps=3,
        out=str(out),
        **cfg_kwargs,
    )
    return DrafterTrainer(cfg, model, FINGERPRINT, train, heldout)


@pytest.mark.parametrize("method,extra", [("eagle1", {}), ("hass", {}), ("eagle3", {}), ("eagle3", {"fc_norm": True})])
def test_loss_decreases(tiny_setup, tmp_path, method, extra):
    """The training loss (every rollout step, noise off) falls by a tenth or more within 240 steps
    (EAGLE-3 with per-tap norms before fc too: they are trained, they start at 1)."""
    trainer = make({"method": method, "epochs": 40, "lr": 1e-2, "noise": "none", **extra}, tiny_setup, tmp_path)
    if extra:
        assert trainer.drafter.tap_norms is not None
        start = [p.detach().clone() for p in trainer.drafter.tap_norms.parameters()]
    before = sum(trainer.evaluate(trainer.train_data)["loss"])
    trainer.fit()
    after = sum(trainer.evaluate(trainer.train_data)["loss"])
    assert after < 0.9 * before, (before, after)  # no update at all gives exactly 1.0
    if extra:
        assert not all(torch.equal(a, b) for a, b in zip(start, trainer.drafter.tap_norms.parameters()))


def test_resume_equals_unbroken_run(tiny_setup, tmp_path):
    """A run stopped after 3 steps and resumed ends with the same weights as an unbroken run."""
    full = make({"method": "hass", "epochs": 2}, tiny_setup, tmp_path / "full")
    full.fit()
    part = make({"method": "hass", "epochs": 2}, tiny_setup, tmp_path / "part")
    assert part.fit(stop_after=3) == {"stopped_at": 3}
    resumed = make({"method": "hass", "epochs": 2}, tiny_setup, tmp_path / "part")
    summary = resumed.fit()
    assert summary["resumed"] and resumed.step == full.step
    for (name, a), (_, b) in zip(full.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_gradient_ownership(tiny_setup, tmp_path):
    trainer = make({"method": "eagle1", "epochs": 1}, tiny_setup, tmp_path)
    trainer.train_step()
    assert all(p.grad is None and not p.requires_grad for p in trainer.target.parameters())
    assert any(p.grad is not None for p in trainer.drafter.parameters())


def test_no_supervised_rows_skips_the_step(tiny_setup, tmp_path):
    """With every loss mask off, a step changes nothing (weight decay included)."""
    model, train, heldout = tiny_setup
    trainer = make({"method": "eagle1", "epochs": 1, "weight_decay": 0.1}, tiny_setup, tmp_path)
    trainer.train_data = [
        FeatureBatch(fb.sample_id, fb.input_ids, torch.zeros_like(fb.loss_mask), fb.features)
        for fb in trainer.train_data
    ]
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    assert trainer.train_step() is None
    assert all(torch.equal(before[k], v) for k, v in trainer.drafter.state_dict().items())


def test_drafter_for_target_a_is_refused_for_target_b(tiny_setup, tmp_path):
    trainer = make({"method": "eagle3", "epochs": 1}, tiny_setup, tmp_path)
    trainer.fit()
    folder = trainer.export({"steps": trainer.step})
    drafter, manifest = load_drafter(folder, TargetFingerprint(**FINGERPRINT))
    assert manifest.method == "eagle3" and torch.equal(drafter.d2t, trainer.drafter.d2t)
    other = TargetFingerprint(**{**FINGERPRINT, "weight_digest": "w-b"})
    with pytest.raises(ValueError, match="target_fingerprint.weight_digest"):
        load_drafter(folder, other)


def test_feature_cache_refuses_another_target(tiny_setup):
    model, train, _ = tiny_setup
    with pytest.raises(ValueError, match="feature_cache.target_fingerprint.weight_digest"):
        train.check({**FINGERPRINT, "weight_digest": "w-b"}, training_taps(model))
    with pytest.raises(ValueError, match="feature_cache.feature_address"):
        train.check(FINGERPRINT, training_taps(model)[:1])


def test_warm_start_takes_the_weights_and_vocabulary_and_refuses_another_method(tiny_setup, tmp_path):
    """``init_from``: a stage-2 run starts from an exported drafter (weights, to fp16 rounding, and its
    draft vocabulary) with a fresh optimizer, and its summary carries the held-out accuracy it started
    from; a drafter of another method is refused, naming the field."""
    first = make({"method": "eagle3", "epochs": 1}, tiny_setup, tmp_path / "a")
    first.fit()
    folder = first.export({"steps": first.step})
    second = make({"method": "eagle3", "epochs": 1, "init_from": str(folder), "seed": 5}, tiny_setup, tmp_path / "b")
    assert torch.equal(second.drafter.d2t, first.drafter.d2t) and second.step == 0
    for name, p in first.drafter.state_dict().items():
        if p.is_floating_point():
            torch.testing.assert_close(second.drafter.state_dict()[name], p.half().float(), rtol=0, atol=0)
    before = second.evaluate()
    assert before["loss"][0] == pytest.approx(first.evaluate()["loss"][0], rel=1e-2)  # it starts where the first ended
    summary = second.fit()  # a warm start reports its held-out accuracy before the first step
    assert summary["heldout_at_start"] == before and "heldout_at_start" not in first.fit()
    with pytest.raises(ValueError, match="^config.init_from: .* is a eagle3 drafter, not eagle1"):
        make({"method": "eagle1", "epochs": 1, "init_from": str(folder)}, tiny_setup, tmp_path / "c")


def test_a_run_trains_on_a_prefix_of_a_larger_cache(tiny_setup, tmp_path):
    """data.cache_samples: a learning-curve point reads the first train_samples of one shared cache
    (the same samples, in order, as the cache's own), its draft vocabulary is counted over that
    prefix alone, and a cache smaller than the run is refused by field."""
    from eyas.drafting.vocab import build_draft_vocab
    from eyas.training.prepare import cache_dirs

    trainer = make(
        {"method": "eagle3", "epochs": 1, "data": {"train_samples": 8, "cache_samples": 24}}, tiny_setup, tmp_path
    )
    full = tiny_setup[1].samples()
    assert [fb.sample_id for fb in trainer.train_data] == [fb.sample_id for fb in full[:8]]
    assert cache_dirs(trainer.cfg)[0].name.startswith("train-24-")
    counted = torch.zeros(48, dtype=torch.int64)
    for fb in full[:8]:
        counted += torch.bincount(fb.input_ids[fb.loss_mask], minlength=48)
    assert torch.equal(trainer.drafter.d2t, build_draft_vocab(counted, 32)) and trainer.steps_per_epoch == 2
    with pytest.raises(ValueError, match="cache_samples"):
        TrainConfig(data={"train_samples": 8, "cache_samples": 4})


@pytest.mark.parametrize("method", ["eagle1", "hass", "eagle3"])
def test_a_packed_step_equals_its_samples_one_by_one(tiny_setup, tmp_path, method):
    """Packing (``pack_tokens``): four samples in one token grid give the sum of their own losses
    and the same gradient as running them one at a time (segment ids keep attention, supervision
    and each sample's mean to itself); the held-out stats agree too."""
    one = make({"method": method, "noise": "none", "pack_tokens": None}, tiny_setup, tmp_path / "one")
    packed = make({"method": method, "noise": "none", "pack_tokens": 4096}, tiny_setup, tmp_path / "packed")
    samples = one.train_data[:4]
    assert [len(p) for p in __import__("eyas.training.trainer", fromlist=["packs"]).packs(samples, 4096)] == [4]
    alone = [one.pack_loss([fb], noise=False)[0] for fb in samples]
    total, n = packed.pack_loss(samples, noise=False)
    assert n == sum(one.pack_loss([fb], noise=False)[1] for fb in samples)
    torch.testing.assert_close(total, sum(alone), rtol=1e-5, atol=1e-6)
    sum(alone).backward()
    total.backward()
    for (name, a), b in zip(one.drafter.named_parameters(), packed.drafter.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    e1, e2 = one.evaluate(), packed.evaluate()
    assert e1["top1"] == e2["top1"] and e1["top3"] == e2["top3"]
    torch.testing.assert_close(torch.tensor(e2["loss"]), torch.tensor(e1["loss"]), rtol=1e-5, atol=1e-6)


def test_packs_keep_the_order_and_the_token_bound():
    from eyas.training.trainer import packs

    fbs = [
        FeatureBatch(f"s{i}", torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.bool), torch.zeros(n, 4))
        for i, n in enumerate([30, 40, 50, 200, 10])
    ]
    assert [[fb.sample_id for fb in p] for p in packs(fbs, 100)] == [["s0", "s1"], ["s2"], ["s3"], ["s4"]]
    assert [len(p) for p in packs(fbs, None)] == [1] * 5


def test_bfloat16_autocast_trains_and_a_bad_device_names_the_field(tiny_setup, tmp_path):
    """`dtype: bfloat16` runs the drafter under autocast (float32 weights and losses) and the loss
    still falls; a device that does not parse is refused naming `device`."""
    trainer = make(
        {"method": "eagle1", "epochs": 40, "lr": 1e-2, "noise": "none", "dtype": "bfloat16"}, tiny_setup, tmp_path
    )
    before = sum(trainer.evaluate(trainer.train_data)["loss"])
    trainer.fit()
    after = sum(trainer.evaluate(trainer.train_data)["loss"])
    assert after < 0.9 * before, (before, after)
    assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())
    with pytest.raises(ValueError, match="device: 'tpu' is not"):
        TrainConfig(device="tpu")


def test_pack_tokens_auto_packs_on_a_gpu_only():
    assert TrainConfig().pack_limit() is None and TrainConfig(device="cuda").pack_limit() == 2048
    assert TrainConfig(pack_tokens=512).pack_limit() == 512 and TrainConfig(pack_tokens=None).pack_limit() is None
    with pytest.raises(ValueError, match="pack_tokens: must be at least 16"):
        TrainConfig(pack_tokens=8)


def test_wsd_branches_at_each_point_export_drafters_and_a_killed_run_resumes_to_the_same_weights(tiny_setup, tmp_path):
    """wsd: constant rate after warmup; at each decay point (supervised tokens seen) a branch trains on
    with the rate falling linearly to 0 and exports out/point-<tokens>; the main run resumes from the
    stable state (its weights at the point, not the decayed ones). A run killed inside the first
    branch and inside the main run, then resumed, writes the same drafters as an unbroken one."""
    from safetensors.torch import load_file

    kwargs = {"method": "eagle3", "epochs": 2, "schedule": "wsd", "decay_fraction": 0.5}
    probe = make(kwargs, tiny_setup, tmp_path / "probe")
    seen = probe.supervised_tokens_before(probe.total_steps)
    points = [seen[4], seen[8]]
    kwargs["decay_points"] = points
    unbroken = make(kwargs, tiny_setup, tmp_path / "a")
    assert unbroken.decay_point_steps() == [(points[0], 4), (points[1], 8)]
    rates = []
    real_step = unbroken.train_step

    def recording_step():
        rates.append((unbroken.step, unbroken.branch is not None, unbroken.optimizer.param_groups[0]["lr"]))
        return real_step()

    unbroken.train_step = recording_step
    result = unbroken.fit()
    assert set(result["points"]) == {str(p) for p in points}
    lr = unbroken.cfg.lr
    # warmup (2 steps), constant, then branch 1 (steps 4..5: 1, 1/2), main resumes at 4, branch 2 (8..11)
    assert rates[:2] == [(0, False, lr / 2), (1, False, lr)]
    assert [r for r in rates if r[1]] == [
        (4, True, lr),
        (5, True, lr / 2),
        (8, True, lr),
        (9, True, lr * 3 / 4),
        (10, True, lr / 2),
        (11, True, lr / 4),
    ]
    assert [r[0] for r in rates if not r[1]] == list(range(8))
    for p in points:
        assert (tmp_path / "a" / f"point-{p}" / "model.safetensors").exists()
    state = torch.load(tmp_path / "a" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 8 and state["branch"] is None

    broken = make(kwargs, tiny_setup, tmp_path / "b")
    assert broken.fit(stop_after=5) == {"stopped_at": 5}  # inside the first branch (step 5)
    resumed = make(kwargs, tiny_setup, tmp_path / "b")
    assert resumed.fit(stop_after=4) == {"stopped_at": 7}  # branch 1 done, main run 4 -> 7
    make(kwargs, tiny_setup, tmp_path / "b").fit()
    for p in points:
        a = load_file(tmp_path / "a" / f"point-{p}" / "model.safetensors")
        b = load_file(tmp_path / "b" / f"point-{p}" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_wsd_refuses_a_decay_point_past_the_data(tiny_setup, tmp_path):
    trainer = make({"method": "eagle3", "epochs": 1, "schedule": "wsd", "decay_points": [10**9]}, tiny_setup, tmp_path)
    with pytest.raises(ValueError, match="config.decay_points"):
        trainer.fit()
    with pytest.raises(ValueError, match="decay_points"):
        TrainConfig(decay_points=[100])  # a cosine schedule does not branch


def test_online_features_are_the_caches_and_train_alike(tiny_setup, tmp_path):
    """The online source (the target run when a sample is read) gives the cached features up to the
    cache's float16 rounding, and a step's loss on them equals the cached step's; a bfloat16 source
    runs a bfloat16 copy and leaves the served target as it was."""
    from eyas.training.features import OnlineFeatures

    model, train, heldout = tiny_setup
    samples = synthetic_samples(24, 48, 0)
    online = OnlineFeatures(model, samples, training_taps(model))
    assert online.model is model
    cached = train.samples()
    for fb, ob in zip(cached, online.samples()):
        assert torch.equal(fb.input_ids, ob.input_ids) and torch.equal(fb.loss_mask, ob.loss_mask)
        assert torch.allclose(ob.features.float(), fb.features.float(), rtol=2e-3, atol=2e-3)
    cfg = TrainConfig(method="eagle3", batch_samples=4, draft_vocab_size=32, ttt_steps=3, out=str(tmp_path))
    a = DrafterTrainer(cfg, model, FINGERPRINT, train, heldout)
    b = DrafterTrainer(cfg, model, FINGERPRINT, online, heldout)
    la, _ = a.pack_loss([a.train_data[0]], noise=False)
    lb, _ = b.pack_loss([b.train_data[0]], noise=False)
    assert torch.allclose(la, lb, rtol=1e-3)
    low = OnlineFeatures(model, samples, training_taps(model), torch.bfloat16)
    assert low.model is not model and low.model.embed.weight.dtype == torch.bfloat16
    assert model.embed.weight.dtype == torch.float32
    assert low.samples()[0].features.dtype == torch.bfloat16


def test_a_run_trains_on_a_train_cache_after_skip_samples(tiny_setup, tmp_path):
    """data.train_cache: the run reads that cache as it is, its samples after skip_samples; a cache
    too small (or incomplete) is refused by field, and so is a train_cache read online."""
    from eyas.training.prepare import prepare_features

    train = tiny_setup[1]
    trainer = make(
        {
            "method": "eagle3",
            "epochs": 1,
            "data": {"train_cache": str(train.folder), "skip_samples": 4, "train_samples": 8},
        },
        tiny_setup,
        tmp_path,
    )
    assert [fb.sample_id for fb in trainer.train_data] == [fb.sample_id for fb in train.samples()[4:12]]
    assert trainer.train_step() is not None

    class Loaded:  # what prepare_features reads of a runtime
        model = tiny_setup[0]
        fingerprint = TargetFingerprint(**FINGERPRINT)

    class Runtime:
        loaded, model, tokenizer = Loaded, tiny_setup[0], None

    too_many = TrainConfig(data={"train_cache": str(train.folder), "skip_samples": 20, "train_samples": 8})
    with pytest.raises(ValueError, match="^data.train_cache: .* holds 24 samples; the run reads 20 \\+ 8"):
        prepare_features(too_many, Runtime)
    with pytest.raises(ValueError, match="train_cache"):
        TrainConfig(data={"train_cache": "x", "features": "online"})
    with pytest.raises(ValueError, match="skip_samples"):
        TrainConfig(data={"skip_samples": 3})


def test_a_list_of_train_caches_is_read_as_one(tiny_setup, tmp_path):
    """data.train_cache as a list: the caches' samples in the order listed, skip_samples and
    train_samples counted across them; a list that is empty or names a cache twice, a cache of
    another target and an incomplete cache are each refused by field, and nothing is trained."""
    import json
    import shutil

    from eyas.training.features import FeatureCaches
    from eyas.training.prepare import prepare_features

    model, train, heldout = tiny_setup
    second = FeatureCache(tmp_path / "sampled")
    second.extract(model, FINGERPRINT, synthetic_samples(8, 48, 5), training_taps(model), {"split": "sampled"})

    class Loaded:  # what prepare_features reads of a runtime
        fingerprint = TargetFingerprint(**FINGERPRINT)

    Runtime = type("Runtime", (), {"loaded": Loaded, "model": model, "tokenizer": None})
    cfg = TrainConfig(
        method="eagle3",
        batch_samples=4,
        draft_vocab_size=32,
        ttt_steps=3,
        out=str(tmp_path / "run"),
        data={"train_cache": [str(train.folder), str(second.folder)], "skip_samples": 20, "train_samples": 8},
    )
    assert cfg.data.train_caches == [str(train.folder), str(second.folder)]
    joined = FeatureCaches([train, second])
    trainer = DrafterTrainer(cfg, model, FINGERPRINT, joined, heldout)
    expected = [fb.sample_id for fb in train.samples()[20:]] + [fb.sample_id for fb in second.samples()[:4]]
    assert [fb.sample_id for fb in trainer.train_data] == expected
    assert trainer.train_step() is not None

    too_many = cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_samples": 13})})
    with pytest.raises(ValueError, match="^data.train_cache: 2 caches hold 32 samples; the run reads 20 \\+ 13"):
        prepare_features(too_many, Runtime)
    for bad in ([], [str(train.folder), str(train.folder)]):
        with pytest.raises(ValueError, match="train_cache"):
            TrainConfig(data={"train_cache": bad})
    other = tmp_path / "other"
    shutil.copytree(second.folder, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["target_fingerprint"]["weight_digest"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    foreign = cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"train_cache": [str(train.folder), str(other)]})}
    )
    with pytest.raises(ValueError, match="^feature_cache.target_fingerprint.weight_digest"):
        prepare_features(foreign, Runtime)
    manifest = json.loads((second.folder / "manifest.json").read_text())
    unfinished = tmp_path / "unfinished"
    shutil.copytree(second.folder, unfinished)
    (unfinished / "manifest.json").write_text(json.dumps(manifest | {"complete": False}))
    partial = cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"train_cache": [str(train.folder), str(unfinished)]})}
    )
    with pytest.raises(ValueError, match="^data.train_cache: .*unfinished is incomplete"):
        prepare_features(partial, Runtime)


def test_init_state_continues_another_runs_stable_state_on_new_data(tiny_setup, tmp_path):
    """config.init_state: the drafter (weights and vocabulary) and the optimizer's moments of another
    run's trainer state, with this run's own step count and rate; a state inside a decay branch, a
    state of another method and a start from both a folder and a state are refused by field."""
    first = make({"method": "eagle3", "epochs": 1}, tiny_setup, tmp_path / "a")
    for _ in range(3):
        first.train_step()
    first.save_state()
    second = make(
        {"method": "eagle3", "epochs": 1, "init_state": str(tmp_path / "a" / "trainer_state.pt")},
        tiny_setup,
        tmp_path / "b",
    )
    assert second.step == 0  # its own warmup from this run's first step
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(second.cfg.lr / second.cfg.warmup_steps)
    for (name, p), q in zip(first.drafter.state_dict().items(), second.drafter.state_dict().values()):
        assert torch.equal(p, q), name
    moments = [s["exp_avg"] for s in first.optimizer.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, second.optimizer.state.values()))
    assert second.train_step() is not None
    first.branch = {"tokens": 1, "start": 3, "length": 1}
    first.save_state("in_branch.pt")
    with pytest.raises(ValueError, match="^config.init_state: .* inside a decay branch"):
        make({"method": "eagle3", "init_state": str(tmp_path / "a" / "in_branch.pt")}, tiny_setup, tmp_path / "c")
    with pytest.raises(ValueError, match="^config.init_state: .* is a eagle3 run's state, not hass"):
        make({"method": "hass", "init_state": str(tmp_path / "a" / "trainer_state.pt")}, tiny_setup, tmp_path / "d")
    with pytest.raises(ValueError, match="init_state"):
        TrainConfig(init_from="x", init_state="y")


def test_rebuild_draft_vocab_carries_the_shared_rows_of_a_warm_start(tiny_setup, tmp_path):
    """rebuild_draft_vocab: a warm start (init_state, then init_from) gets the draft vocabulary built
    from the counts it is given at draft_vocab_size; a token both vocabularies hold keeps its head row
    and (init_state) its optimizer moments, a new one starts with zero moments, and the run trains;
    a rebuild without a warm start, without counts or for EAGLE-1 is refused by field."""
    model, train, heldout = tiny_setup
    first = make({"method": "eagle3", "epochs": 1}, tiny_setup, tmp_path / "a")
    for _ in range(3):
        first.train_step()
    first.save_state()
    counts = torch.arange(48, dtype=torch.int64).flip(0)  # ids 0..39 are the 40 most frequent
    base = {"lr": 3e-3, "batch_samples": 4, "warmup_steps": 0, "eval_every": 1000, "checkpoint_every": 1000}
    base |= {"ttt_steps": 3, "method": "eagle3", "epochs": 1, "draft_vocab_size": 40, "rebuild_draft_vocab": True}
    base |= {"data": {"answers_dir": str(tmp_path)}}
    cfg = TrainConfig(**base, init_state=str(tmp_path / "a" / "trainer_state.pt"), out=str(tmp_path / "b"))
    second = DrafterTrainer(cfg, model, FINGERPRINT, train, heldout, vocab_counts=counts)
    assert second.drafter.d2t.tolist() == list(range(40)) and int(second.drafter.t2d.sum()) == 40
    old_d2t = first.drafter.d2t.tolist()
    head_slot = [n for n, p in second.drafter.named_parameters() if p.requires_grad].index("head.weight")
    old_m = first.optimizer.state_dict()["state"][head_slot]["exp_avg_sq"]
    new_m = second.optimizer.state_dict()["state"][head_slot]["exp_avg_sq"]
    shared = [t for t in range(40) if t in old_d2t]
    assert shared and len(shared) < 40
    for t in range(40):
        if t in old_d2t:
            assert torch.equal(second.drafter.head.weight[t], first.drafter.head.weight[old_d2t.index(t)])
            assert torch.equal(new_m[t], old_m[old_d2t.index(t)])
        else:
            assert not new_m[t].any()
    assert second.train_step() is not None
    folder = first.export({"steps": first.step})
    cfg = TrainConfig(**base, init_from=str(folder), out=str(tmp_path / "c"))
    third = DrafterTrainer(cfg, model, FINGERPRINT, train, heldout, vocab_counts=counts)
    assert third.drafter.cfg.draft_vocab_size == 40 and third.drafter.d2t.tolist() == list(range(40))
    t = shared[0]
    ref = first.drafter.head.weight[old_d2t.index(t)].half().float()
    assert torch.equal(third.drafter.head.weight[t], ref)
    with pytest.raises(ValueError, match="^vocab_counts: rebuild_draft_vocab needs"):
        DrafterTrainer(cfg, model, FINGERPRINT, train, heldout)
    with pytest.raises(ValueError, match="rebuild_draft_vocab: rebuilds a warm start"):
        TrainConfig(**base)
    with pytest.raises(ValueError, match="rebuild_draft_vocab: only EAGLE-3"):
        TrainConfig(**{**base, "method": "hass"}, init_from="x")
    with pytest.raises(ValueError, match=r"config.init_from: .* has drafter config"):  # another size, no rebuild
        DrafterTrainer(cfg.model_copy(update={"rebuild_draft_vocab": False}), model, FINGERPRINT, train, heldout)
