"""Build (or resume) the feature caches a training run reads: train and held-out splits."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm import tqdm

from eyas.target.loader import DTYPES
from eyas.training.config import TrainConfig
from eyas.training.data import Sample, conversations, render
from eyas.training.features import FeatureCache, FeatureCaches, OnlineFeatures, training_taps


def cache_dirs(cfg: TrainConfig) -> tuple[Path, Path]:
    root = Path(os.path.expanduser(cfg.data.cache_dir))

    def tag(regenerated: bool) -> str:
        return f"len{cfg.data.max_len}" + (f"-regen{cfg.data.regen_max_new_tokens}" if regenerated else "")

    return (
        root
        / (
            f"train-{cfg.data.cache_samples or cfg.data.train_samples}-{tag(cfg.data.regenerate)}"
            + (f"-skip{cfg.data.skip_samples}" if cfg.data.skip_samples else "")
            + (f"-t{cfg.data.regen_temperature:g}s{cfg.data.regen_sample}" if cfg.data.regen_temperature else "")
        ),
        root / f"heldout-{cfg.data.heldout_samples}-{tag(cfg.data.heldout_regenerated)}",
    )


def prepare_features(cfg: TrainConfig, eyas) -> tuple[FeatureCache | FeatureCaches | OnlineFeatures, FeatureCache]:
    """The train split's features (a cache on disk, or an online source with ``data.features:
    online``) and the held-out split's cache (always extracted once, in float32: every run is
    measured against the same labels)."""
    fingerprint = eyas.loaded.fingerprint.to_dict()
    taps = training_taps(eyas.model)
    caches = []
    for (split, count), folder in zip(
        (("train", cfg.data.cache_samples or cfg.data.train_samples), ("heldout", cfg.data.heldout_samples)),
        cache_dirs(cfg),
    ):
        if split == "train" and cfg.data.train_caches:
            train = FeatureCaches([FeatureCache(Path(os.path.expanduser(f))) for f in cfg.data.train_caches])
            have = 0
            for cache in train.caches:
                manifest = cache.check(fingerprint, taps)
                if not manifest.get("complete"):
                    raise ValueError(f"data.train_cache: {cache.folder} is incomplete")
                have += sum(shard["num_samples"] for shard in manifest["shards"])
            if have < cfg.data.skip_samples + cfg.data.train_samples:
                where = (
                    f"{train.caches[0].folder} holds" if len(train.caches) == 1 else f"{len(train.caches)} caches hold"
                )
                raise ValueError(
                    f"data.train_cache: {where} {have} samples"
                    f"; the run reads {cfg.data.skip_samples} + {cfg.data.train_samples}"
                )
            caches.append(train.caches[0] if len(train.caches) == 1 else train)
            continue
        if split == "train" and cfg.data.features == "online":
            if cfg.data.feature_dtype == "gguf":  # a second copy of the target, at the precision it is served
                from eyas.target.loader import load_target

                model, dtype = load_target(cfg.target, "gguf", device=cfg.device).model, DTYPES["float32"]
            else:
                model, dtype = eyas.model, DTYPES[cfg.data.feature_dtype]
            caches.append(OnlineFeatures(model, train_samples(cfg, eyas.tokenizer, folder), taps, dtype))
            continue
        cache = FeatureCache(folder)
        if cache.manifest_path.exists() and cache.manifest().get("complete"):
            cache.check(fingerprint, taps)
            caches.append(cache)
            continue
        regenerated = cfg.data.regenerate if split == "train" else cfg.data.heldout_regenerated
        if regenerated:
            samples = regenerated_samples(cfg, eyas.tokenizer, split, count, folder)
        else:
            samples = [
                s
                for sid, msgs in tqdm(
                    conversations(split, limit=count), total=count, desc=f"render {split}", leave=False
                )
                if (s := render(eyas.tokenizer, sid, msgs, cfg.data.max_len)) is not None
            ]
        info = {
            "split": split,
            "samples": count,
            "max_len": cfg.data.max_len,
            "regenerate": regenerated,
            "source": "sharegpt-v3",
        }
        cache.extract(eyas.model, fingerprint, samples, taps, info)
        caches.append(cache)
    return caches[0], caches[1]


def train_samples(cfg: TrainConfig, tokenizer, folder: Path) -> list[Sample]:
    """The train split as token ids and masks: the target's own answers (``regenerate``) and, with
    ``sharegpt_samples``, that many ShareGPT conversations whole (every assistant turn supervised).
    The rendered conversations are kept beside the caches (``<folder>.sharegpt-<n>.pt``)."""
    d = cfg.data
    if not d.regenerate:
        return sharegpt_samples(
            tokenizer,
            d.train_samples,
            d.max_len,
            folder.with_name(f"sharegpt-train-{d.train_samples}-len{d.max_len}.pt"),
        )
    out = regenerated_samples(cfg, tokenizer, "train", d.train_samples, folder)
    if d.sharegpt_samples:
        out += sharegpt_samples(
            tokenizer,
            d.sharegpt_samples,
            d.max_len,
            folder.with_name(f"sharegpt-train-{d.sharegpt_samples}-len{d.max_len}.pt"),
        )
    return out


def answer_token_counts(cfg: TrainConfig, tokenizer, vocab_size: int):
    """Supervised-token counts ([V] int64) of every answer of the target's own to the train split
    in ``data.answers_dir`` (``<target>-sharegpt-train*.answers.jsonl``: the greedy pass and every
    sampled one), rendered as training renders them: what ``rebuild_draft_vocab`` builds from."""
    if not cfg.data.answers_dir:
        raise ValueError("data.answers_dir: rebuild_draft_vocab counts the answers there; set it")
    files = train_answer_files(cfg.data.answers_dir, cfg.target, "data.answers_dir")
    return answers_token_counts(files, tokenizer, vocab_size, cfg.data.max_len)


def train_answer_files(answers_dir: str | Path, target: str, field: str) -> list[Path]:
    """The regeneration files of the target's answers to the train split in ``answers_dir`` (the
    greedy pass and every sampled one); ``field`` names the setting in the error when there are none."""
    files = sorted(Path(answers_dir).glob(f"{target}-sharegpt-train*.answers.jsonl"))
    if not files:
        raise ValueError(f"{field}: {answers_dir} holds no {target}-sharegpt-train answers")
    return files


def answers_token_counts(files: list[Path], tokenizer, vocab_size: int, max_len: int):
    """Supervised-token counts ([V] int64) of the answer records in ``files``, each rendered as
    training renders it (:func:`answer_sample`)."""
    import torch

    from eyas.training.data import token_counts
    from eyas.training.regen import read_regenerated

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in files:
        records = read_regenerated(path)
        samples = [
            s
            for rec in tqdm(records, desc=f"count {path.name}", leave=False)
            if (s := answer_sample(tokenizer, rec, max_len)) is not None
        ]
        counts += token_counts(samples, vocab_size)
    return counts


def sharegpt_samples(tokenizer, count: int, max_len: int, path: Path) -> list[Sample]:
    """The first ``count`` ShareGPT train conversations, rendered whole (``eyas.training.data.render``),
    read from ``path`` when an earlier run rendered them with the same tokenizer."""
    import torch

    key = {
        "count": count,
        "max_len": max_len,
        "tokenizer": tokenizer.name_or_path,
        "vocab": len(tokenizer),
        "template": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
    }
    if path.exists():
        stored = torch.load(path, weights_only=False)
        if stored.get("key") == key:
            return stored["samples"]
    samples = [
        s
        for sid, msgs in tqdm(conversations("train", limit=count), total=count, desc="render sharegpt", leave=False)
        if (s := render(tokenizer, sid, msgs, max_len)) is not None
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "samples": samples}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return samples


def regenerated_samples(cfg: TrainConfig, tokenizer, split: str, count: int, cache_folder: Path) -> list[Sample]:
    """Samples whose assistant turn is the target's own greedy answer to the conversation's first
    user turn (``eyas.training.regen``; resumable JSONL next to the feature cache). An answer cut at
    ``regen_max_new_tokens`` keeps its text supervised but not the end-of-turn token the template adds.
    The train split starts after its first ``data.skip_samples`` answers."""
    from eyas.target.loader import checkpoint_folder
    from eyas.training.regen import read_regenerated, record_id, regenerate_batched

    d = cfg.data
    skip = d.skip_samples if split == "train" else 0
    temperature, sample = (d.regen_temperature, d.regen_sample) if split == "train" else (0.0, 0)
    tag = record_id("", temperature, sample).replace("~", ".")  # "" greedy, ".t0.7s1" a sampled pass
    path = (
        Path(d.answers_dir) / f"{cfg.target}-sharegpt-{split}{tag}.answers.jsonl"
        if d.answers_dir
        else cache_folder.with_name(cache_folder.name + f"{tag}.answers.jsonl")
    )
    regenerate_batched(
        checkpoint_folder(cfg.target),
        conversations(split),
        path,
        limit=skip + count,
        batch_size=d.regen_batch,
        max_new_tokens=d.regen_max_new_tokens,
        max_prompt_tokens=d.regen_max_prompt_tokens,
        dtype=d.regen_dtype,
        desc=f"regenerate {split}",
        device=cfg.device,
        temperature=temperature,
        sample=sample,
    )
    return [
        s
        for rec in read_regenerated(path)[skip : skip + count]
        if (s := answer_sample(tokenizer, rec, d.max_len)) is not None
    ]


def answer_sample(tokenizer, rec: dict, max_len: int) -> Sample | None:
    """One regenerated answer record as a training sample (None when it does not render): an
    answer cut at the token limit keeps its text supervised but not the end-of-turn token the
    template adds."""
    s = render(tokenizer, rec["id"], rec["messages"], max_len)
    if s is not None and rec["truncated"]:
        s.loss_mask[int(s.loss_mask.nonzero()[-1])] = False
    return s
