"""The learner's background loop: an :class:`~eyas.learning.learner.OnlineLearner` that trains whenever
served samples are waiting, judges its candidate every ``steps_per_check`` steps and publishes each
promoted version. A plain class (the tests call it directly); :func:`learner_actor` runs it as a Ray
actor at the lowest CPU priority, beside the replicas it learns for.

Callers never wait on training: :meth:`LearnerLoop.add` drops samples in an inbox and returns; the
loop thread moves them into the learner between training chunks. :meth:`LearnerLoop.live` is what
drafter replicas poll: ``(version, folder)`` of the newest promoted drafter (``(0, None)``: the one
they started with).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from eyas.learning.learner import LearnConfig, OnlineLearner
from eyas.training.features import FeatureBatch, OnlineFeatures, training_taps

log = logging.getLogger("eyas.learning")
REPLAY_MAX_LEN = 512


def replay_samples(target: str, model, count: int, seed: int = 0) -> list[FeatureBatch]:
    """``count`` of the shipped drafters' training samples (the target's own answers to ShareGPT first
    turns, ``data/regen``) with their fp32 features: the learner's replay against forgetting."""
    import random

    from eyas.runtime import REPO_DRAFTERS
    from eyas.target.loader import load_tokenizer
    from eyas.training.prepare import answer_sample
    from eyas.training.regen import read_regenerated

    if count <= 0:
        return []
    path = REPO_DRAFTERS.parent / "data" / "regen" / "smollm2-135m-sharegpt-train.answers.jsonl"
    if not path.exists():
        raise ValueError(f"learn.replay_samples: the replay set {path} is missing")
    records = read_regenerated(path)
    random.Random(seed).shuffle(records)
    tokenizer = load_tokenizer(target)
    samples = []
    for rec in records:
        s = answer_sample(tokenizer, rec, REPLAY_MAX_LEN)
        if s is not None and s.loss_mask.sum() > 1:
            samples.append(s)
        if len(samples) == count:
            break
    online = OnlineFeatures(model, samples, training_taps(model))
    return [FeatureBatch(s.sample_id, s.input_ids, s.loss_mask, s.features.to(torch.float16)) for s in online.samples()]


class LearnerLoop:
    """Owner of the learner and its thread. ``target``: the served target's source (loaded here at
    fp32 for the frozen embedding, norm and head the losses read); ``drafter_dir``: the live drafter;
    ``out``: where promoted versions go; ``replay``: replay samples to draw (from ``data/regen``)."""

    def __init__(
        self,
        target: str,
        drafter_dir: str,
        out: str,
        config: LearnConfig = LearnConfig(),
        replay: int = 64,
        steps_per_check: int = 40,
        threads: int = 1,
        nice: int = 0,
        model=None,
        fingerprint: dict | None = None,
    ):
        if nice:
            os.nice(nice)
        torch.set_num_threads(threads)
        if model is None:
            from dataclasses import asdict

            from eyas.target.loader import load_target

            loaded = load_target(target)
            model, fingerprint = loaded.model, asdict(loaded.fingerprint)
        model.requires_grad_(False)
        self.learner = OnlineLearner(
            model, fingerprint, drafter_dir, out, config, replay_samples(target, model, replay, config.seed)
        )
        if self.learner.resume():  # a restarted learner goes on from its last check
            v = self.learner.stats.version
            folder = self.learner.out / f"v{v}"
            log.info("learner resumed at step %d, live version %d", self.learner.stats.steps, v)
            if v and folder.exists():
                self._live_at_start = (v, str(folder.resolve()))
        self.steps_per_check = steps_per_check
        self._inbox: list[FeatureBatch] = []
        self._lock = threading.Lock()
        self._live: tuple[int, str | None] = getattr(self, "_live_at_start", (0, None))
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="eyas-learner", daemon=True)
        self._thread.start()

    def add(self, samples: list[FeatureBatch]) -> int:
        """Served samples for the learner -> how many wait in the inbox now."""
        with self._lock:
            self._inbox.extend(samples)
            return len(self._inbox)

    def live(self) -> tuple[int, str | None]:
        return self._live

    def status(self) -> dict:
        s = self.learner.stats
        return {
            "version": s.version,
            "steps": s.steps,
            "tokens_learned": s.tokens_learned,
            "seen": self.learner.seen + len(self._inbox),  # served samples handed to the learner
            "pool": len(self.learner.pool),
            "window": len(self.learner.window),
            "loss": s.losses[-1] if s.losses else None,
            "verdicts": list(s.verdicts),
            "error": self.error,
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _forget_old_versions(self, keep: int = 3) -> None:
        """Delete promoted versions but the newest ``keep`` (a replica may still be loading the one
        before the live one): the disk holds a bounded number of drafters."""
        import shutil

        live = self.learner.stats.version
        for v in range(max(live - keep - 8, 1), live - keep + 1):
            shutil.rmtree(self.learner.out / f"v{v}", ignore_errors=True)

    def _run(self) -> None:
        judged = None  # (steps, window samples) at the last verdict: judge again when either moved
        try:
            while not self._stop.is_set():
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                self.learner.add(inbox)
                if self.learner.wants_training():
                    self.learner.train(self.steps_per_check)
                key = (self.learner.stats.steps, len(self.learner.window))
                if key == judged or not self.learner.stats.steps:
                    self._stop.wait(0.2)
                    continue
                judged = key
                verdict = self.learner.verdict()
                folder = self.learner.promote(verdict)
                self.learner.save()
                log.info("learner: %d steps, %s", self.learner.stats.steps, verdict.why)
                if folder is not None:
                    self._live = (self.learner.stats.version, str(Path(folder).resolve()))
                    self._forget_old_versions()
        except Exception as err:  # noqa: BLE001 - said (WARNING, status()); serving goes on with the live drafter
            log.warning("learner stopped: %s: %s", type(err).__name__, err)
            self.error = f"{type(err).__name__}: {err}"


def learner_actor(**kwargs):
    """A :class:`LearnerLoop` as a Ray actor at nice 19 (the lowest CPU priority), one thread."""
    import ray

    return ray.remote(num_cpus=0)(LearnerLoop).remote(**{"nice": 19, "threads": 1, **kwargs})
