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

import copy
import logging
import os
import threading
import time
from pathlib import Path

import torch

from eyas.learning.learner import LearnConfig, OnlineLearner
from eyas.training.features import FeatureBatch, OnlineFeatures, training_taps

log = logging.getLogger("eyas.learning")
REPLAY_MAX_LEN = 384  # replayed samples are cut here (a learner step costs about its tokens)

# the shipped drafters' training answers (the target's own answers to ShareGPT first turns), in the repository
REPLAY_ANSWERS = Path(__file__).resolve().parents[2] / "data" / "regen" / "smollm2-135m-sharegpt-train.answers.jsonl"
# their held-out answers (no drafter trained on them): the forgetting check's window
HELDOUT_ANSWERS = REPLAY_ANSWERS.with_name("smollm2-135m-sharegpt-heldout.answers.jsonl")


def replay_samples(
    target: str, model, count: int, seed: int = 0, path: Path = REPLAY_ANSWERS, keep: bool = False
) -> list:
    """``count`` of the shipped drafters' training samples (the target's own answers to ShareGPT first
    turns, ``data/regen``; ``path``: another such file), their features computed by ``model`` (in its
    dtype) when read: the learner's replay against forgetting (a few dozen are memorized, not
    replayed: use hundreds). ``keep``: computed once now and kept (fp16, about 4.6 KB a token): a set
    read at every verdict, such as the forgetting window."""
    import random

    from eyas.target.loader import load_tokenizer
    from eyas.training.prepare import answer_sample
    from eyas.training.regen import read_regenerated

    if count <= 0:
        return []
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
    # features made when a sample is read (one target forward each, in the learner): a replay set of
    # any size in constant memory
    online = OnlineFeatures(model, samples, training_taps(model), dtype=model.embed.weight.dtype).samples()
    if not keep:
        return online
    return [FeatureBatch(s.sample_id, s.input_ids, s.loss_mask, s.features.to(torch.float16)) for s in online]


def replay_sets(target: str, model, config: LearnConfig, count: int) -> tuple[list, list | None]:
    """The learner's replay (``count`` training answers, features made when read) and its forgetting
    window (``config.replay_window`` held-out answers, no drafter trained on them: a trained-on sample
    is memorized; features made once); no replay: ``([], None)``. The features come from a bf16 copy of
    ``model`` where the learner trains in bf16 (about 3x the fp32 rate on a CPU with AVX-512 BF16; the
    losses read the fp32 target's head)."""
    if not count:
        return [], None
    features = copy.deepcopy(model).to(torch.bfloat16) if config.dtype == "bfloat16" else model
    return (
        replay_samples(target, features, count, config.seed),
        replay_samples(target, features, config.replay_window, config.seed, HELDOUT_ANSWERS, keep=True),
    )


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
        replay: int = 1024,
        steps_per_check: int = 40,
        duty: float = 1.0,
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
            model, fingerprint, drafter_dir, out, config, *replay_sets(target, model, config, replay)
        )
        if self.learner.resume():  # a restarted learner goes on from its last check
            v = self.learner.stats.version
            folder = self.learner.out / f"v{v}"
            log.info("learner resumed at step %d, live version %d", self.learner.stats.steps, v)
            if v and folder.exists():
                self._live_at_start = (v, str(folder.resolve()))
        if not 0 < duty <= 1:
            raise ValueError(f"learn.duty: in (0, 1], got {duty}")
        self.steps_per_check = steps_per_check
        self.duty = duty  # the share of wall time it trains: after a chunk of t s it rests t * (1 / duty - 1)
        self._running = threading.Event()
        self._running.set()
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

    def pause(self, paused: bool = True) -> None:
        """Stop training (True) after the step in progress, or go on (False): an experiment's A/B of
        serving with and without the learner beside."""
        self._running.clear() if paused else self._running.set()

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
            "paused": not self._running.is_set(),
            "checks": len(self.learner.stats.verdicts),
        }

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Stop after the step or verdict in progress (a verdict takes a minute or two on one thread),
        waiting at most ``timeout_s`` -> whether the thread has ended."""
        self._stop.set()
        self._running.set()  # a paused loop wakes to stop
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _forget_old_versions(self, keep: int = 3) -> None:
        """Delete promoted versions but the newest ``keep`` (a replica may still be loading the one
        before the live one): the disk holds a bounded number of drafters."""
        import shutil

        live = self.learner.stats.version
        for v in range(max(live - keep - 8, 1), live - keep + 1):
            shutil.rmtree(self.learner.out / f"v{v}", ignore_errors=True)

    def _run(self) -> None:
        judged = None  # (steps, window samples) at the last verdict: judge again when either moved
        since = 0  # steps since the last verdict
        try:
            while not self._stop.is_set():
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                self.learner.add(inbox)
                self._running.wait()
                if since < self.steps_per_check and self.learner.wants_training():
                    t0, before = time.perf_counter(), self.learner.stats.steps
                    # a pause stops it after the step in progress; the steps count toward the next check
                    self.learner.train(self.steps_per_check - since, keep_going=self._running.is_set)
                    since += self.learner.stats.steps - before
                    if self.duty < 1:
                        self._stop.wait((time.perf_counter() - t0) * (1 / self.duty - 1))
                    if since < self.steps_per_check and self.learner.wants_training():
                        continue  # paused mid-chunk: train on when it runs again
                key = (self.learner.stats.steps, len(self.learner.window))
                if key == judged or not self.learner.stats.steps or not self._running.is_set():
                    self._stop.wait(0.2)
                    continue
                judged, since = key, 0
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
