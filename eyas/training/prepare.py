"""Build (or resume) the feature caches a training run reads: train and held-out splits."""
from __future__ import annotations

import os
from pathlib import Path

from tqdm import tqdm

from eyas.training.config import TrainConfig
from eyas.training.data import conversations, regenerate, render
from eyas.training.features import FeatureCache, training_taps


def cache_dirs(cfg: TrainConfig) -> tuple[Path, Path]:
    root = Path(os.path.expanduser(cfg.data.cache_dir))
    tag = f"len{cfg.data.max_len}" + ("-regen" if cfg.data.regenerate else "")
    return root / f"train-{cfg.data.train_samples}-{tag}", root / f"heldout-{cfg.data.heldout_samples}-{tag}"


def prepare_features(cfg: TrainConfig, eyas) -> tuple[FeatureCache, FeatureCache]:
    fingerprint = eyas.loaded.fingerprint.to_dict()
    taps = training_taps(eyas.model)
    caches = []
    for (split, count), folder in zip((("train", cfg.data.train_samples), ("heldout", cfg.data.heldout_samples)),
                                      cache_dirs(cfg)):
        cache = FeatureCache(folder)
        if cache.manifest_path.exists() and cache.manifest().get("complete"):
            cache.check(fingerprint, taps)
            caches.append(cache)
            continue
        samples = []
        for sid, msgs in tqdm(conversations(split, limit=count), total=count, desc=f"render {split}", leave=False):
            if cfg.data.regenerate:
                msgs = regenerate(eyas, msgs)
            s = render(eyas.tokenizer, sid, msgs, cfg.data.max_len)
            if s is not None:
                samples.append(s)
        info = {"split": split, "samples": count, "max_len": cfg.data.max_len, "regenerate": cfg.data.regenerate,
                "source": "sharegpt-v3"}
        cache.extract(eyas.model, fingerprint, samples, taps, info)
        caches.append(cache)
    return caches[0], caches[1]
