"""Build (or resume) the feature caches a training run reads: train and held-out splits."""
from __future__ import annotations

import os
from pathlib import Path

from tqdm import tqdm

from eyas.training.config import TrainConfig
from eyas.training.data import Sample, conversations, render
from eyas.training.features import FeatureCache, training_taps


def cache_dirs(cfg: TrainConfig) -> tuple[Path, Path]:
    root = Path(os.path.expanduser(cfg.data.cache_dir))
    tag = f"len{cfg.data.max_len}" + (f"-regen{cfg.data.regen_max_new_tokens}" if cfg.data.regenerate else "")
    return root / f"train-{cfg.data.cache_samples or cfg.data.train_samples}-{tag}", root / f"heldout-{cfg.data.heldout_samples}-{tag}"


def prepare_features(cfg: TrainConfig, eyas) -> tuple[FeatureCache, FeatureCache]:
    fingerprint = eyas.loaded.fingerprint.to_dict()
    taps = training_taps(eyas.model)
    caches = []
    for (split, count), folder in zip((("train", cfg.data.cache_samples or cfg.data.train_samples), ("heldout", cfg.data.heldout_samples)),
                                      cache_dirs(cfg)):
        cache = FeatureCache(folder)
        if cache.manifest_path.exists() and cache.manifest().get("complete"):
            cache.check(fingerprint, taps)
            caches.append(cache)
            continue
        if cfg.data.regenerate:
            samples = regenerated_samples(cfg, eyas.tokenizer, split, count, folder)
        else:
            samples = [s for sid, msgs in tqdm(conversations(split, limit=count), total=count, desc=f"render {split}",
                                               leave=False)
                       if (s := render(eyas.tokenizer, sid, msgs, cfg.data.max_len)) is not None]
        info = {"split": split, "samples": count, "max_len": cfg.data.max_len, "regenerate": cfg.data.regenerate,
                "source": "sharegpt-v3"}
        cache.extract(eyas.model, fingerprint, samples, taps, info)
        caches.append(cache)
    return caches[0], caches[1]


def regenerated_samples(cfg: TrainConfig, tokenizer, split: str, count: int, cache_folder: Path) -> list[Sample]:
    """Samples whose assistant turn is the target's own greedy answer to the conversation's first
    user turn (``eyas.training.regen``; resumable JSONL next to the feature cache). An answer cut at
    ``regen_max_new_tokens`` keeps its text supervised but not the end-of-turn token the template adds."""
    from eyas.target.loader import checkpoint_folder
    from eyas.training.regen import read_regenerated, regenerate_batched

    d = cfg.data
    path = (Path(d.answers_dir) / f"{cfg.target}-sharegpt-{split}.answers.jsonl" if d.answers_dir
            else cache_folder.with_name(cache_folder.name + ".answers.jsonl"))
    regenerate_batched(checkpoint_folder(cfg.target), conversations(split), path, limit=count,
                       batch_size=d.regen_batch, max_new_tokens=d.regen_max_new_tokens,
                       max_prompt_tokens=d.regen_max_prompt_tokens, desc=f"regenerate {split}", device=cfg.device)
    samples = []
    for rec in read_regenerated(path)[:count]:
        s = render(tokenizer, rec["id"], rec["messages"], d.max_len)
        if s is None:
            continue
        if rec["truncated"]:
            last = int(s.loss_mask.nonzero()[-1])
            s.loss_mask[last] = False
        samples.append(s)
    return samples
