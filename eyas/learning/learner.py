"""The online learner: a copy of the live drafter trained on the traffic its target served, put live
only when it measurably drafts better.

Terms:

- **live**: the drafter version the drafter replicas serve now (version 0: the one they started with);
- **candidate**: the learner's copy, trained from the live weights on served samples
  (``eyas.learning.capture``) mixed with a **replay** of the drafter's original training data (its
  share of each batch is ``replay_fraction``), which keeps it from forgetting what it knew;
- the **window**: served samples the learner never trains on (those whose prompt hashes to 0 modulo
  ``heldout_every``: the same prompt, asked again, always lands on the same side, so the window never
  holds a copy of a trained sample), on which live and candidate are compared. No target forward: a
  sample carries the target's features and distributions already;
- a drafter's **chain estimate** on a sample: ``1 + sum_s prod_{j <= s} top1_j``, where ``top1_j`` is
  the share of the sample's answer rows whose rollout step ``j`` drafts the target's argmax (the
  expected accepted length of a chain drafted from each row, reading the steps as independent);
- the **guard**: the candidate goes live only when the mean of its paired per-sample difference
  (candidate - live) has a lower 95 % bound (Student's t) above ``margin``, over at least
  ``min_window`` samples, and (with a replay set) when it has not forgotten: on the **replay window**
  (samples of the drafter's own data it never trains on: by default ``replay_window`` of the shipped
  drafter's held-out answers, which no drafter trained on), its mean chain estimate is at most ``forget`` below the live
  one's. A worse candidate never goes live; a swap changes no token (the target verifies every
  one), only which tokens are proposed.

Pure enough to test without Ray: samples in, a verdict and a drafter folder out.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.drafting.manifest import read_manifest
from eyas.target.model import TargetModel
from eyas.training.config import DataConfig, TrainConfig
from eyas.training.features import FeatureBatch, SampleList, training_taps


@dataclass(frozen=True)
class LearnConfig:
    """The learner's knobs (defaults: what the experiment in ``docs/benchmarks.md`` ran)."""

    lr: float = 1e-4
    batch_samples: int = 4  # samples per optimizer step
    replay_fraction: float = 0.5  # of each batch, from the replay set (when there is one)
    heldout_every: int = 4  # about one prompt in 4 goes to the window, never trained on
    window: int = 64  # the window keeps the newest this many samples
    pool: int = 4096  # the pool keeps the newest this many samples to train on
    min_window: int = 8  # no verdict on fewer
    epochs: float = 4.0  # the learner rests once it has drawn this many times the pool's samples
    dtype: str = "float32"  # the drafter's autocast dtype while training (bfloat16: ~3x on a CPU with AVX-512 BF16)
    replay_window: int = 64  # samples of the drafter's own (held-out) data that measure forgetting
    forget: float = 0.02  # the most the candidate's mean chain estimate there may fall below the live one's
    margin: float = 0.0  # chain-estimate gain the candidate's lower bound must exceed
    warmup_steps: int = 40  # the rate rises linearly over the first this many steps (fresh Adam moments)
    decay_steps: int = 10  # each verdict judges the candidate after this many steps of a rate falling to 0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.replay_fraction < 1:
            raise ValueError(f"learn.replay_fraction: in [0, 1), got {self.replay_fraction}")
        if self.heldout_every < 2:
            raise ValueError(f"learn.heldout_every: at least 2, got {self.heldout_every}")
        if self.decay_steps < 0:
            raise ValueError(f"learn.decay_steps: at least 0, got {self.decay_steps}")
        if self.batch_samples < 1 or self.min_window < 2 or self.window < self.min_window:
            raise ValueError("learn: batch_samples >= 1, min_window >= 2 and window >= min_window")


@dataclass(frozen=True)
class Verdict:
    """Live against candidate on the window: per-sample chain estimates, their paired difference."""

    samples: int
    live: float  # mean chain estimate of the live drafter
    candidate: float
    gain: float  # mean of candidate - live
    low: float  # the gain's lower 95 % bound
    high: float
    promote: bool
    why: str


def weights_of(module: torch.nn.Module) -> dict:
    """A copy of ``module``'s state dict (a version to judge, keep or restore)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def chain_estimate(top1: list[float]) -> float:
    """``1 + sum_s prod_{j <= s} top1_j`` (see the module's terms)."""
    out, run = 1.0, 1.0
    for a in top1:
        run *= a
        out += run
    return out


def paired_verdict(live: list[float], candidate: list[float], margin: float, min_samples: int) -> Verdict:
    """The guard over paired per-sample estimates (pure: lists in, a verdict out)."""
    from scipy.stats import t as student_t

    n = len(live)
    assert n == len(candidate), "paired: one live and one candidate estimate per sample"
    if n == 0:
        return Verdict(0, 0.0, 0.0, 0.0, 0.0, 0.0, False, "no window sample yet")
    diffs = [c - a for a, c in zip(live, candidate)]
    mean = sum(diffs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1)) if n > 1 else float("inf")
    half = student_t.ppf(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else float("inf")
    low, high = mean - half, mean + half
    la, lc = sum(live) / n, sum(candidate) / n
    if n < min_samples:
        promote, why = False, f"{n} window samples, fewer than {min_samples}"
    elif low > margin:
        promote, why = True, f"gain {mean:+.3f}, its lower 95 % bound {low:+.3f} > margin {margin:+.3f}"
    else:
        promote, why = False, f"gain {mean:+.3f}, its lower 95 % bound {low:+.3f} is not above margin {margin:+.3f}"
    return Verdict(n, la, lc, mean, low, high, promote, why)


@dataclass
class LearnerStats:
    tokens_learned: int = 0  # supervised served tokens trained on (with repeats)
    samples_drawn: int = 0  # served samples drawn into batches (with repeats)
    steps: int = 0
    version: int = 0  # the live version (0: the drafter the replicas started with)
    verdicts: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


class OnlineLearner:
    """Owner of the candidate drafter, its optimizer, the served samples it trains on and the window.

    ``drafter_dir``: the live drafter's folder (an EAGLE-3, EAGLE-1 or HASS checkpoint of ``target``);
    ``out``: where promoted versions are written (``out/v1``, ``out/v2``, ...: servable folders);
    ``replay``: samples of the drafter's original training data (the same feature address);
    ``replay_window``: samples of the same kind never trained on, for the forgetting check (None: the
    first ``config.replay_window`` of ``replay``, up to half of it, are set aside)."""

    def __init__(
        self,
        target: TargetModel,
        fingerprint: dict,
        drafter_dir: str | Path,
        out: str | Path,
        config: LearnConfig = LearnConfig(),
        replay: list[FeatureBatch] = (),
        replay_window: list[FeatureBatch] | None = None,
    ):
        from eyas.training.trainer import DrafterTrainer

        manifest = read_manifest(Path(drafter_dir))
        method = manifest.recipe.get("trained_as", manifest.method) if manifest.recipe else manifest.method
        method = method if method in ("eagle1", "hass", "eagle3") else manifest.method
        loss = manifest.loss_weights or {}
        dc = manifest.drafter_config
        cfg = TrainConfig(
            method=method,
            out=str(out),
            layout=dc.get("layout", "reference"),
            fc_norm=bool(dc.get("fc_norm", False)),
            init_from=str(drafter_dir),
            data=DataConfig(),
            batch_samples=config.batch_samples,
            lr=config.lr,
            warmup_steps=config.warmup_steps,
            schedule="wsd",  # a constant rate (no decay point)
            draft_vocab_size=dc.get("draft_vocab_size") or 8192,
            ttt_steps=int(loss.get("ttt_steps", 4)),
            ttt_decay=float(loss.get("ttt_decay", 0.8)),
            seed=config.seed,
            dtype=config.dtype,
        )
        taps = training_taps(target)
        self.config = config
        self.out = Path(out)
        replay = list(replay)
        if replay_window is None:
            held = min(config.replay_window, len(replay) // 2)
            replay, replay_window = replay[held:], replay[:held]
        self.replay, self.replay_window = replay, list(replay_window)  # trained on / kept for the guard
        self.trainer = DrafterTrainer(cfg, target, fingerprint, SampleList(taps, ()), SampleList(taps, ()), out=out)
        self.live_state = weights_of(self.trainer.drafter)
        self._judged: dict | None = None  # the weights the last verdict judged (a decay branch's end)
        self._live_cache: dict[int, tuple[FeatureBatch, float]] = {}  # id(sample) -> (sample, live estimate)
        self.pool: list[FeatureBatch] = []  # served samples to train on
        self.window: list[FeatureBatch] = []  # served samples kept aside for the guard
        self.seen = 0
        self.stats = LearnerStats()
        self.rng = random.Random(config.seed)

    def in_window(self, sample: FeatureBatch) -> bool:
        """Whether ``sample`` goes to the window: by a hash of its prompt (the rows before its first
        supervised answer row), never by arrival."""
        prompt = sample.input_ids[: int(sample.loss_mask.nonzero()[0]) + 1]
        return zlib.crc32(prompt.to(torch.int64).numpy().tobytes()) % self.config.heldout_every == 0

    def add(self, samples: list[FeatureBatch]) -> None:
        """Served samples, in arrival order: those of window prompts to the window, the rest to the pool."""
        for sample in samples:
            self.seen += 1
            if self.in_window(sample):
                self.window = (self.window + [sample])[-self.config.window :]
            else:
                self.pool.append(sample)
        del self.pool[: max(len(self.pool) - self.config.pool, 0)]

    def train(self, steps: int, keep_going=lambda: True) -> dict:
        """Up to ``steps`` optimizer steps of the candidate on the pool (and the replay), stopping early
        when ``keep_going()`` turns false -> a summary."""
        if not self.pool:
            return {"steps": 0, "loss": None}
        t0, losses = time.perf_counter(), []
        for _ in range(steps):
            if not keep_going():
                break
            batch, n_served = self._batch()
            step = self.trainer.train_on(batch)
            if step is not None:
                losses.append(step.loss)
            served = batch[:n_served]
            self.stats.samples_drawn += len(served)
            self.stats.tokens_learned += sum(int(fb.loss_mask.sum()) - 1 for fb in served)
            self.stats.steps += 1
        mean = sum(losses) / len(losses) if losses else None
        if mean is not None:
            self.stats.losses.append(mean)
        return {"steps": steps, "loss": mean, "seconds": round(time.perf_counter() - t0, 2)}

    def wants_training(self) -> bool:
        """Whether the pool has been drawn fewer than ``epochs`` times over (new samples renew it)."""
        return bool(self.pool) and self.stats.samples_drawn < self.config.epochs * len(self.pool)

    def chain_estimates(self, state: dict | None = None, samples: list[FeatureBatch] | None = None) -> list[float]:
        """Per sample of ``samples`` (default: the window), the chain estimate of the candidate (or of
        the drafter weights ``state``)."""
        drafter = self.trainer.drafter
        kept = None
        if state is not None:
            kept = weights_of(drafter)
            drafter.load_state_dict(state)
        try:
            data = self.window if samples is None else samples
            return [chain_estimate(self.trainer.evaluate([sample])["top1"]) for sample in data]
        finally:
            if kept is not None:
                drafter.load_state_dict(kept)

    def live_estimates(self, samples: list[FeatureBatch]) -> list[float]:
        """The live drafter's chain estimates of ``samples``, each computed once per live version (a
        verdict re-judged only the candidate: the live side was ~40 % of a verdict's time). The cache
        holds its samples, so an id is never reused while cached, and keeps only the windows' samples."""
        cache = self._live_cache
        missing = [s for s in samples if id(s) not in cache]
        for sample, estimate in zip(missing, self.chain_estimates(self.live_state, missing) if missing else ()):
            cache[id(sample)] = (sample, estimate)
        out = [cache[id(s)][1] for s in samples]
        keep = {id(s) for s in (*self.window, *self.replay_window)}
        for key in [k for k in cache if k not in keep]:
            del cache[key]
        return out

    def _batch(self) -> tuple[list[FeatureBatch], int]:
        """A training batch: served samples from the pool, the replay's share from the replay set ->
        (batch, how many of it are served)."""
        c = self.config
        n_replay = round(c.batch_samples * c.replay_fraction) if self.replay else 0
        batch = [self.rng.choice(self.pool) for _ in range(c.batch_samples - n_replay)]
        return batch + [self.rng.choice(self.replay) for _ in range(n_replay)], c.batch_samples - n_replay

    def decayed(self) -> dict:
        """The candidate after a **decay branch**: ``decay_steps`` more steps whose rate falls linearly
        to zero (warmup-stable-decay's anneal, as the shipped drafters were trained), returned as a
        state dict; the learner itself goes on from where it was (weights, optimizer and schedule
        restored: the stable run continues, each verdict judges a fresh branch of it). Measured on
        served code (``bench/online_study.py``, ``docs/benchmarks.md``, "Online learning"): at 40 steps the
        annealed weights draft held-out code and MT-bench a little better than the constant-rate ones."""
        import copy

        t, n = self.trainer, self.config.decay_steps
        if n == 0 or not self.pool:
            return weights_of(t.drafter)
        weights = weights_of(t.drafter)
        optimizer, step = copy.deepcopy(t.optimizer.state_dict()), t.step
        t.branch = {"tokens": 0, "start": step, "length": n}
        t.set_rate(step)  # the branch's rate from its first step
        try:
            for _ in range(n):
                t.train_on(self._batch()[0])
            return weights_of(t.drafter)
        finally:
            t.drafter.load_state_dict(weights)
            t.optimizer.load_state_dict(optimizer)
            t.step, t.branch = step, None
            t.set_rate(step)

    def verdict(self) -> Verdict:
        """Live against the candidate (after its decay branch) on the window (the guard), and on the
        replay window for forgetting; recorded in :attr:`stats`. The judged weights are what
        :meth:`promote` writes."""
        import dataclasses

        self._judged = self.decayed()
        v = paired_verdict(
            self.live_estimates(self.window),
            self.chain_estimates(self._judged),
            self.config.margin,
            self.config.min_window,
        )
        record = {"forgot": None}
        if v.promote and self.replay_window:
            live = self.live_estimates(self.replay_window)
            cand = self.chain_estimates(self._judged, self.replay_window)
            forgot = (sum(live) - sum(cand)) / len(live)
            record["forgot"] = forgot
            if forgot > self.config.forget:
                v = dataclasses.replace(
                    v,
                    promote=False,
                    why=f"{v.why}; but it forgot: {forgot:+.3f} below live on the replay window (> {self.config.forget})",
                )
        self.stats.verdicts.append(
            {**v.__dict__, **record, "steps": self.stats.steps, "tokens": self.stats.tokens_learned}
        )
        return v

    STATE_FILE = "learner_state.pt"

    def save(self) -> Path:
        """The candidate, its optimizer, the live weights and the counters to ``out/learner_state.pt``
        (atomically): a restarted learner resumes from them (the served samples are not kept)."""
        from dataclasses import asdict

        self.out.mkdir(parents=True, exist_ok=True)
        state = {
            "candidate": self.trainer.drafter.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
            "live": self.live_state,
            "stats": asdict(self.stats),
            "seen": self.seen,
        }
        tmp = self.out / (self.STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / self.STATE_FILE)
        return self.out / self.STATE_FILE

    def resume(self) -> bool:
        """Load ``out/learner_state.pt`` when there is one -> whether it did."""
        path = self.out / self.STATE_FILE
        if not path.exists():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.trainer.drafter.load_state_dict(state["candidate"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.live_state, self._live_cache = state["live"], {}
        self.stats = LearnerStats(**state["stats"])
        self.seen = state["seen"]
        return True

    def promote(self, verdict: Verdict) -> Path | None:
        """Write the judged candidate (the weights :meth:`verdict` compared) as the next live version when
        ``verdict`` says so -> its folder (None: not)."""
        if not verdict.promote:
            return None
        judged = self._judged or weights_of(self.trainer.drafter)
        self.stats.version += 1
        folder = self.out / f"v{self.stats.version}"
        summary = {
            "online": {
                "version": self.stats.version,
                "tokens_learned": self.stats.tokens_learned,
                "steps": self.stats.steps,
                "window_gain": round(verdict.gain, 4),
                "window_low": round(verdict.low, 4),
            }
        }
        stable = weights_of(self.trainer.drafter)
        self.trainer.drafter.load_state_dict(judged)
        try:
            self.trainer.export(summary, out=folder)
        finally:
            self.trainer.drafter.load_state_dict(stable)  # the stable run goes on
        self.live_state, self._live_cache = judged, {}
        return folder
