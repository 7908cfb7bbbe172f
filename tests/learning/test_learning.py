"""The drafter that learns from served traffic (eyas.learning) on a tiny random target: what a target
replica captures equals what offline extraction computes, nothing is kept from a request that opts
out, a drafter swapped in mid-stream changes no token, the guard's arithmetic, and a candidate trained
on noise never goes live while one trained on the served traffic does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from eyas.actors.drafter_worker import DrafterWorker
from eyas.actors.target_worker import TargetWorker
from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.drafting.manifest import load_drafter
from eyas.learning.capture import CaptureConfig, TrafficBuffer
from eyas.learning.learner import LearnConfig, OnlineLearner, chain_estimate, paired_verdict
from eyas.learning.loop import LearnerLoop
from eyas.protocol.sampling_params import SamplingParams
from eyas.scheduler.policy import Budgets, TreeWorkPolicy
from eyas.target.engine import TargetEngine
from eyas.target.loader import TargetFingerprint
from eyas.training.config import TrainConfig
from eyas.training.data import Sample
from eyas.training.features import FeatureBatch, OnlineFeatures, SampleList, training_taps
from eyas.training.trainer import DrafterTrainer
from tests.testing import FLAT, local_loop, ours_from_hf, tiny_hf

FINGERPRINT = {"config_digest": "cfg-l", "weight_digest": "w-l", "tokenizer_digest": "tok-l"}
VOCAB = 48


def walks(n: int, seed: int, length=(10, 16)) -> list[list[int]]:
    """Prompts that are arithmetic walks over the vocabulary (the drafter's training pattern)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        S = int(torch.randint(*length, (1,), generator=g))
        start, stride = int(torch.randint(1, VOCAB, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        out.append(((start + stride * torch.arange(S)) % VOCAB).clamp(min=1).tolist())
    return out


def bigram_target():
    """A tiny random Llama whose layers add nothing (o_proj and down_proj zero): its next token is a
    fixed function of the current one, a pattern a drafter can learn from a few hundred rows and that
    holds on prompts it never saw."""
    hf = tiny_hf("llama", vocab=VOCAB, hidden=32, layers=4, seed=11, init_std=0.5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    return ours_from_hf(hf).requires_grad_(False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The bigram target and an untrained EAGLE-3 drafter for it (the live version 0), exported as a
    drafter folder with a draft vocabulary of the whole vocabulary."""
    model = bigram_target()
    taps = training_taps(model)
    samples = []
    for i, ids in enumerate(walks(4, 0, (24, 40))):
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(ids) // 3 :] = True
        samples.append(
            Sample(f"w{i}", torch.tensor(ids), mask, torch.zeros(len(ids), dtype=torch.int64), torch.arange(len(ids)))
        )
    online = OnlineFeatures(model, samples, taps)
    data = SampleList(
        taps, tuple(FeatureBatch(s.sample_id, s.input_ids, s.loss_mask, s.features) for s in online.samples())
    )
    out = tmp_path_factory.mktemp("drafter")
    cfg = TrainConfig(method="eagle3", draft_vocab_size=VOCAB, ttt_steps=3, out=str(out))
    DrafterTrainer(cfg, model, FINGERPRINT, data, data).export({})
    return model, out


def drafter_worker(model, folder):
    drafter, manifest = load_drafter(folder, TargetFingerprint(**FINGERPRINT))

    def engine(path):
        d, m = load_drafter(path, TargetFingerprint(**FINGERPRINT))
        return DrafterEngine(d, model.embed, model.lm_head, taps=m.taps())

    worker = DrafterWorker({"eagle3": engine(folder)}, VOCAB, reload=lambda method, path: engine(path))
    return worker


def serve(model, folder, prompts, learn=None, n=12, swap_to=None, versions=None):
    """Greedy EAGLE-3 answers of ``prompts`` through the serving round loop over in-process workers
    with capture on; ``learn[i]`` False: request i opts out; ``swap_to``: a drafter folder swapped in
    after the first answer (as version 4); ``versions``: a list that gets each answer's drafter
    version. -> (token ids per prompt, the target worker, the drafter worker)."""
    drafter = drafter_worker(model, folder)
    target = TargetWorker(model, capture=CaptureConfig(drafter.engines["eagle3"].taps))
    info = drafter.info()
    loop = local_loop(target, drafter, info, TreeWorkPolicy(Budgets(max_batch=4)), FLAT)
    try:
        results = []
        for i, p in enumerate(prompts):
            f = loop.submit(
                f"r{i}", p, n, "eagle3", TreeSpec(), SamplingParams(), 0, learn=True if learn is None else learn[i]
            )
            result = f.result(timeout=120)
            results.append(result.token_ids)
            if versions is not None:
                versions.append(result.drafter_version)
            if i == 0 and swap_to is not None:
                drafter.swap("eagle3", str(swap_to), version=4)
    finally:
        loop.close()
    return results, target, drafter


def test_captured_samples_are_the_offline_features_and_opt_out_keeps_nothing(setup):
    model, folder = setup
    prompts = walks(3, 5)
    answers, target, _ = serve(model, folder, prompts, learn=[True, False, True])
    samples = target.take_captured()
    assert [s.sample_id for s in samples] == ["r0", "r2"]  # r1 opted out
    assert target.capture_stats()["samples"] == 0  # taken
    taps = training_taps(model)
    for s in samples:
        i = int(s.sample_id[1:])
        P = len(prompts[i])
        # the committed rows: the prompt and every answer token but the last (emitted, never an input)
        assert s.input_ids.tolist() == prompts[i] + answers[i][:-1]
        assert s.loss_mask.tolist() == [False] * (P - 1) + [True] * (len(s.input_ids) - P + 1)
        offline = OnlineFeatures(model, [], taps).features(s.input_ids, torch.arange(len(s.input_ids)))
        offline = offline.to(torch.float16).float()
        d = model.cfg.hidden_size
        got = s.features.float()
        # answer rows: every training tap (the served ones and the captured LM-head input)
        torch.testing.assert_close(got[P:], offline[P:], atol=2e-2, rtol=1e-2)
        # prompt rows: the served taps; the LM-head input is never read there (zeros)
        torch.testing.assert_close(got[:P, : 3 * d], offline[:P, : 3 * d], atol=2e-2, rtol=1e-2)
        assert not got[:P, 3 * d :].any()


def test_capture_off_keeps_nothing_and_the_buffer_evicts_oldest(setup):
    model, _ = setup
    assert TargetWorker(model).take_captured() == [] and TargetWorker(model).capture_stats() == {}
    buffer = TrafficBuffer(CaptureConfig(training_taps(model)[:3], max_bytes=3000, max_age_s=10))
    sample = FeatureBatch(
        "a", torch.arange(10), torch.ones(10, dtype=torch.bool), torch.zeros(10, 64, dtype=torch.float16)
    )
    for t in range(3):
        buffer.add(FeatureBatch(f"s{t}", sample.input_ids, sample.loss_mask, sample.features), now=float(t))
    assert buffer.stats()["samples"] == 2 and buffer.stats()["samples_evicted"] == 1  # 1,370 bytes each
    assert [s.sample_id for s in buffer.take(now=11.5)] == ["s2"]  # s1 aged out (10 s)
    with pytest.raises(ValueError, match="learn.capture_bytes"):
        CaptureConfig(training_taps(model)[:3], max_bytes=0)
    with pytest.raises(ValueError, match="learn.method"):
        CaptureConfig(())


def test_a_swap_mid_stream_changes_no_token(setup, tmp_path):
    """Answers with a different drafter swapped in after the first equal greedy target-only answers;
    the swap took (version 4, the learner's number, in the answers drafted after it), a version not
    above the live one and a drafter of another shape are refused."""
    model, folder = setup
    noisy, _ = load_drafter(folder, TargetFingerprint(**FINGERPRINT))
    with torch.no_grad():
        for p in noisy.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.5)
    from eyas.drafting.manifest import read_manifest, save_drafter

    save_drafter(tmp_path / "v1", noisy, read_manifest(folder))
    prompts = walks(3, 9)
    versions = []
    answers, _, drafter = serve(model, folder, prompts, swap_to=tmp_path / "v1", versions=versions)
    base = TargetEngine(model, ())
    from eyas.generate import generate

    assert answers == [generate(base, p, max_new_tokens=12).token_ids for p in prompts]
    assert drafter.info()["eagle3"]["version"] == 4 and versions == [0, 4, 4]
    with pytest.raises(ValueError, match="^version: "):
        drafter.engines["eagle3"].swap_drafter(noisy, version=4)
    other = ours_from_hf(tiny_hf("llama", vocab=VOCAB, hidden=32, layers=4, seed=3))
    from eyas.drafting.model import DrafterConfig, init_drafter

    wrong = init_drafter(DrafterConfig.for_target("eagle3", other.cfg, 16))
    with pytest.raises(ValueError, match="drafter: a swap"):
        drafter.engines["eagle3"].swap_drafter(wrong)


def test_the_guard_arithmetic():
    assert chain_estimate([1.0, 1.0]) == 3.0 and chain_estimate([0.5, 0.5]) == 1.75
    live = [1.5, 1.6, 1.4, 1.5, 1.55, 1.45, 1.5, 1.5]
    better = [x + 0.2 + 0.01 * (i % 3) for i, x in enumerate(live)]
    assert paired_verdict(live, better, 0.0, 8).promote
    assert not paired_verdict(live, better, 0.3, 8).promote  # the margin
    assert not paired_verdict(live[:4], better[:4], 0.0, 8).promote  # too few samples
    noisy = [x + (0.3 if i % 2 else -0.3) for i, x in enumerate(live)]
    assert not paired_verdict(live, noisy, 0.0, 8).promote  # a mean gain of 0 within noise


@pytest.fixture(scope="module")
def served(setup):
    """48 greedy EAGLE-3 answers of walk prompts, as the target worker captured them."""
    model, folder = setup
    _, target, _ = serve(model, folder, walks(48, 21, (10, 14)), n=16)
    return target.take_captured()


def test_the_learner_loop_trains_beside_serving_and_publishes_what_it_promotes(setup, served, tmp_path):
    """The background loop (the learner actor's body): samples handed in return at once; it trains,
    judges, publishes a promoted version as (version, folder); a restarted loop over the same folder
    resumes there."""
    model, folder = setup
    kwargs = dict(
        target="unused",
        drafter_dir=str(folder),
        out=str(tmp_path / "out"),
        config=LearnConfig(lr=1e-2, min_window=8, replay_fraction=0.0, epochs=8, warmup_steps=0),
        replay=0,
        steps_per_check=25,
        model=model,
        fingerprint=FINGERPRINT,
    )
    loop = LearnerLoop(**kwargs)
    try:
        loop.add(served)
        deadline = time.monotonic() + 120
        while loop.live()[0] < 1 and time.monotonic() < deadline and loop.status()["error"] is None:
            time.sleep(0.2)
        version, path = loop.live()
        status = loop.status()
        assert version >= 1 and (Path(path) / "manifest.json").exists(), status
        assert status["seen"] == 48 and status["error"] is None and status["verdicts"][-1]["promote"] in (True, False)
    finally:
        stopped = loop.stop(timeout_s=120)
    assert stopped  # the thread ended: nothing trains beside what comes next
    again = LearnerLoop(**kwargs)
    try:
        assert again.live()[0] >= version and again.status()["steps"] >= status["steps"]
    finally:
        again.stop()


def test_a_candidate_trained_on_noise_never_goes_live_one_trained_on_the_traffic_does(setup, served, tmp_path):
    """48 prompts served: about a quarter of them (by prompt) form the window. A candidate trained on
    the others' answers drafts the window's better than the untrained live drafter (it learned the
    target, not the samples) and goes live, written as a servable folder; trained on from there on
    noise (random tokens and features), its next candidate is worse than that live version and
    does not go live."""
    model, folder = setup
    assert len(served) == 48
    config = LearnConfig(lr=1e-2, batch_samples=4, heldout_every=4, min_window=8, replay_fraction=0.0, warmup_steps=0)
    good = OnlineLearner(model, FINGERPRINT, folder, tmp_path / "good", config)
    good.add(served)
    assert len(good.window) >= 8 and len(good.pool) + len(good.window) == 48

    def prompt(sample):
        return tuple(sample.input_ids[: int(sample.loss_mask.nonzero()[0]) + 1].tolist())

    assert not {prompt(s) for s in good.pool} & {prompt(s) for s in good.window}  # no window prompt trained on
    good.train(100)
    verdict = good.verdict()
    assert verdict.promote and verdict.low > 0.1, verdict
    path = good.promote(verdict)
    assert path == tmp_path / "good" / "v1" and good.stats.version == 1
    _, manifest = load_drafter(path, TargetFingerprint(**FINGERPRINT))
    assert manifest.recipe["online"]["tokens_learned"] == good.stats.tokens_learned > 0
    # then the same learner is fed noise (random tokens and features): its candidate drafts the window
    # worse than the live version 1 and never goes live
    g = torch.Generator().manual_seed(0)
    good.pool = [
        FeatureBatch(
            s.sample_id,
            torch.randint(1, VOCAB, s.input_ids.shape, generator=g),
            s.loss_mask,
            (torch.randn(s.features.shape, generator=g) * 3).to(torch.float16),
        )
        for s in good.pool
    ]
    good.train(100)
    verdict = good.verdict()
    assert not verdict.promote and verdict.gain < 0, verdict
    assert good.promote(verdict) is None and good.stats.version == 1 and not (tmp_path / "good" / "v2").exists()
    # a restarted learner resumes: the same candidate, live weights and counters
    good.save()
    again = OnlineLearner(model, FINGERPRINT, folder, tmp_path / "good", config)
    assert again.resume() and again.stats == good.stats
    for a, b in zip(again.trainer.drafter.state_dict().values(), good.trainer.drafter.state_dict().values()):
        assert torch.equal(a, b)


def test_a_candidate_better_on_the_traffic_that_forgot_its_replay_never_goes_live(setup, served, tmp_path):
    """The forgetting check: with a replay set, a candidate whose traffic gain passes the interval but
    whose replay-window estimate falls more than ``forget`` below the live one's is refused; within
    ``forget`` it goes live."""
    model, folder = setup
    replay = served[:8]  # any samples of the same feature address serve as the replay set here
    learner = OnlineLearner(
        model, FINGERPRINT, folder, tmp_path / "f", LearnConfig(min_window=8, replay_window=4, forget=0.05), replay
    )
    assert len(learner.replay_window) == 4 and len(learner.replay) == 4
    learner.window = served[8:20]
    traffic = {"live": [1.5 + 0.01 * i for i in range(12)], "cand": [1.8 + 0.01 * i for i in range(12)]}
    for drop, promoted in ((0.1, False), (0.03, True)):

        def estimates(state=None, samples=None, drop=drop):
            live = state is learner.live_state
            if samples is None or any(s is learner.window[0] for s in samples):  # the traffic window
                return traffic["live" if live else "cand"]
            return [2.0] * 4 if live else [2.0 - drop] * 4

        learner.chain_estimates = estimates
        verdict = learner.verdict()
        assert verdict.promote is promoted, verdict
        assert learner.stats.verdicts[-1]["forgot"] == pytest.approx(drop)
        assert ("forgot" in verdict.why) is not promoted


def test_a_verdict_judges_a_decay_branch_and_the_stable_run_goes_on(setup, served, tmp_path):
    """Each verdict judges the candidate after ``decay_steps`` steps of a rate falling to zero; after it
    the learner's own weights, optimizer state, step and rate are what they were (the stable run goes
    on), and a promotion writes and makes live the judged weights, not the stable ones."""
    import copy

    model, folder = setup
    config = LearnConfig(lr=1e-2, min_window=8, replay_fraction=0.0, decay_steps=5, warmup_steps=0)
    learner = OnlineLearner(model, FINGERPRINT, folder, tmp_path / "d", config)
    learner.add(served)
    learner.train(60)
    t = learner.trainer
    weights = {k: v.clone() for k, v in t.drafter.state_dict().items()}
    moments = copy.deepcopy(t.optimizer.state_dict()["state"])
    step, rate = t.step, t.optimizer.param_groups[0]["lr"]
    rates = []
    train_on = t.train_on
    t.train_on = lambda batch: (rates.append(t.optimizer.param_groups[0]["lr"]), train_on(batch))[1]
    verdict = learner.verdict()
    t.train_on = train_on
    assert rates == pytest.approx([1e-2 * (5 - i) / 5 for i in range(5)])  # 1, 4/5, ... 1/5 of the rate
    judged = learner._judged
    assert any(not torch.equal(judged[k], weights[k]) for k in weights)  # the branch trained
    assert all(torch.equal(v, weights[k]) for k, v in t.drafter.state_dict().items())
    after = t.optimizer.state_dict()["state"]
    assert all(torch.equal(after[i]["exp_avg"], moments[i]["exp_avg"]) for i in moments)
    assert t.step == step and t.branch is None and t.optimizer.param_groups[0]["lr"] == rate
    assert verdict.promote, verdict
    # the live side is computed once per live version: the cache gives what a fresh computation does
    assert learner.live_estimates(learner.window) == learner.chain_estimates(learner.live_state, learner.window)
    path = learner.promote(verdict)
    assert not learner._live_cache  # a new live version: judged afresh
    assert learner.live_estimates(learner.window) == learner.chain_estimates(judged, learner.window)
    assert all(torch.equal(learner.live_state[k], judged[k]) for k in judged)
    assert all(torch.equal(v, weights[k]) for k, v in t.drafter.state_dict().items())
    served_drafter, _ = load_drafter(path, TargetFingerprint(**FINGERPRINT))
    state = served_drafter.state_dict()
    stored = [k for k in judged if judged[k].is_floating_point()]  # written as fp16
    assert stored and all(torch.equal(state[k], judged[k].half().to(state[k].dtype)) for k in stored)


def test_learn_config_refuses_what_it_cannot_run():
    for bad in ({"decay_steps": -1}, {"heldout_every": 1}, {"replay_fraction": 1.0}):
        with pytest.raises(ValueError, match="learn."):
            LearnConfig(**bad)


def test_wheel_stubs_are_a_function_s_signature_and_docstring_without_its_body(tmp_path, monkeypatch):
    """The experiment's default traffic: each public, undecorated, documented top-level function of a
    package's sources becomes its signature and docstring in HumanEval's template, its body left out;
    private, decorated, undocumented and test-file functions give none; a stub found twice is given once."""
    from eyas.experiments.learn import PROMPT_TEMPLATE, wheel_stub_prompts

    pkg = tmp_path / "stubpkg"
    (pkg / "tests").mkdir(parents=True)
    doc = "Add two numbers and return their sum, which is the point of this function entirely."
    body = f'def add(a, b):\n    """{doc}"""\n    total = a + b\n    total = total + 0\n    return total\n'
    others = (
        f'def _hidden(a):\n    """{doc}"""\n    x = a\n    return x\n\n\n'
        f'@staticmethod\ndef decorated(a):\n    """{doc}"""\n    x = a\n    return x\n\n\n'
        "def bare(a):\n    x = a\n    y = x\n    z = y\n    return z\n"
    )
    (pkg / "__init__.py").write_text(body + "\n\n" + others)
    (pkg / "copy.py").write_text(body)  # the same stub again
    (pkg / "tests" / "test_it.py").write_text(body.replace("add", "add_in_tests"))
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = wheel_stub_prompts(("stubpkg", "no_such_package_here"))
    assert prompts == [PROMPT_TEMPLATE.format(code=f'def add(a, b):\n    """{doc}"""\n')]
