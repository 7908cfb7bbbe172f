"""The feature cache: frozen-target features of the training data, on disk (design 0x04C).

The frozen target runs once, in inference mode, over every rendered sample and records the
feature taps of the address the cache was made for. Shards are safetensors files; the cache's
``manifest.json`` records the target fingerprint and the feature address. A cache made by another
target or for another address is refused with an error naming the field -- stale features are
stale labels, never reusable activations. Extraction is resumable shard by shard.

The default address is the union the trainers need: EAGLE-3's low/mid/high taps and EAGLE-1's
LM-head input (the final normed feature, which also yields the target's soft distribution).
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eyas.target.config import FeatureTap, eagle1_feature_address, eagle3_feature_address
from eyas.target.model import TargetModel
from eyas.training.data import Sample

CACHE_FORMAT = "eyas-features/1"
FEATURE_DTYPE = torch.float16


def training_taps(model: TargetModel) -> tuple[FeatureTap, ...]:
    """Raw low/mid/high residual streams plus the LM-head input; the trainer applies the final
    norm to the first three when the served address is normed (it is a fixed function)."""
    return eagle3_feature_address(model.cfg, normed=False) + eagle1_feature_address(model.cfg)


def _taps_json(taps) -> list[dict]:
    return [{"layers_applied": t.layers_applied, "normed": t.normed} for t in taps]


@dataclass(frozen=True)
class FeatureBatch:
    sample_id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    features: torch.Tensor  # [S, n_taps * d] float16


@dataclass(frozen=True)
class SampleList:
    """Samples already in memory over the feature address ``taps`` (the online learner's served
    traffic, ``eyas.learning``): a trainer source like :class:`OnlineFeatures`, without a forward."""

    taps: tuple
    items: tuple[FeatureBatch, ...]

    def samples(self) -> list[FeatureBatch]:
        return list(self.items)


class FeatureCache:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    @property
    def manifest_path(self) -> Path:
        return self.folder / "manifest.json"

    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            raise FileNotFoundError(f"feature_cache: {self.folder} has no manifest.json (run extraction first)")
        return json.loads(self.manifest_path.read_text())

    def check(self, fingerprint: dict, taps: tuple[FeatureTap, ...]) -> dict:
        """Refuse a cache made by another target fingerprint or feature address (design 0x04C)."""
        m = self.manifest()
        for key, value in fingerprint.items():
            if m["target_fingerprint"].get(key) != value:
                raise ValueError(
                    f"feature_cache.target_fingerprint.{key}: the cache at {self.folder} was made by "
                    f"another target ({str(m['target_fingerprint'].get(key))[:12]}… != {value[:12]}…)"
                )
        if m["feature_address"] != _taps_json(taps):
            raise ValueError(f"feature_cache.feature_address: {m['feature_address']} != {_taps_json(taps)}")
        return m

    # --- writing ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def extract(
        self,
        model: TargetModel,
        fingerprint: dict,
        samples: list[Sample],
        taps: tuple[FeatureTap, ...],
        data_info: dict,
        shard_size: int = 64,
    ) -> dict:
        """Run the frozen target over ``samples``; resume where an earlier run stopped."""
        assert not any(p.requires_grad for p in model.parameters()), "the target must be frozen"
        dev = model.embed.weight.device
        longest = max((len(s.input_ids) for s in samples), default=0)
        if longest > model.cfg.max_context:  # past a sliding window the full-causal forward is not the target's
            raise ValueError(
                f"data.max_len: a sample holds {longest} tokens, beyond the target's context "
                f"({model.cfg.max_context}); lower data.max_len"
            )
        manifest = self.begin(fingerprint, taps, data_info)
        done = {s["file"] for s in manifest["shards"]}
        chunks = [samples[i : i + shard_size] for i in range(0, len(samples), shard_size)]
        total = sum(len(s.input_ids) for s in samples)
        bar = tqdm(total=total, unit="tok", desc="features", dynamic_ncols=True)
        t0, new_tokens = time.perf_counter(), 0
        for index, chunk in enumerate(chunks):
            name = f"shard_{index:05d}.safetensors"
            tokens = sum(len(s.input_ids) for s in chunk)
            if name in done:
                bar.update(tokens)
                continue
            batches = []
            for s in chunk:  # on the model's device; the features come back to the host for the shard
                n = len(s.input_ids)
                cache = model.allocate_cache(1, n)
                mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().unsqueeze(0)  # [1, n, n]
                out = model(
                    s.input_ids[None].to(dev), s.position_id[None].to(dev), cache, 0, mask, taps, logits_rows="none"
                )
                batches.append(FeatureBatch(s.sample_id, s.input_ids, s.loss_mask, out.features[0]))
                bar.update(n)
                new_tokens += n
            self.write_shard(manifest, batches, name)
        bar.close()
        self.finish(manifest)
        elapsed = time.perf_counter() - t0
        print(
            f"feature cache {self.folder}: {len(samples)} samples, {total} tokens "
            f"({new_tokens} new in {elapsed:.0f} s, {new_tokens / max(elapsed, 1e-9):.0f} tok/s)"
        )
        return manifest

    def begin(
        self, fingerprint: dict, taps: tuple[FeatureTap, ...], data_info: dict, keep: set[str] | None = None
    ) -> dict:
        """The manifest to write shards under: this folder's, checked against ``fingerprint``, ``taps``
        and ``data_info`` (another use of the folder is refused), or a new one; marked incomplete
        until :meth:`finish`. ``keep``: the sample ids a shard must hold only of to stay -- a shard
        with any other (written by a run killed before it recorded them) is dropped and deleted."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.manifest_path.exists():
            manifest = self.check(fingerprint, taps)
            if manifest["data"] != data_info:
                raise ValueError(f"feature_cache.data: {manifest['data']} != {data_info}; use another folder")
        else:
            manifest = {
                "format": CACHE_FORMAT,
                "target_fingerprint": fingerprint,
                "feature_address": _taps_json(taps),
                "data": data_info,
                "shards": [],
            }
        if keep is not None:
            from safetensors import safe_open

            kept = []
            for shard in manifest["shards"]:
                path = self.folder / shard["file"]
                with safe_open(str(path), "pt") as f:
                    ids = json.loads(f.metadata()["sample_ids"])
                if set(ids) <= keep:
                    kept.append(shard)
                else:
                    path.unlink(missing_ok=True)
            manifest["shards"] = kept
        manifest["complete"] = False
        self._write_manifest(manifest)
        return manifest

    def write_shard(self, manifest: dict, samples: list[FeatureBatch], name: str | None = None) -> None:
        """Write ``samples`` (features cast to float16, refused if that overflows) as one shard, then
        record it in ``manifest``: the shard is durable before the manifest names it."""
        from safetensors.torch import save_file

        name = name or f"shard_{len(manifest['shards']):05d}.safetensors"
        feats = []
        for s in samples:
            f = s.features.to(FEATURE_DTYPE).cpu()
            if not torch.isfinite(f).all():
                raise ValueError(f"features: sample {s.sample_id} overflows {FEATURE_DTYPE}")
            feats.append(f)
        tmp = self.folder / (name + ".tmp")
        save_file(
            {
                "input_ids": torch.cat([s.input_ids for s in samples]),
                "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
                "lengths": torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64),
                "features": torch.cat(feats),
            },
            str(tmp),
            metadata={"sample_ids": json.dumps([s.sample_id for s in samples])},
        )
        os.replace(tmp, self.folder / name)
        tokens = sum(len(s.input_ids) for s in samples)
        manifest["shards"].append({"file": name, "num_samples": len(samples), "num_tokens": tokens})
        self._write_manifest(manifest)

    def finish(self, manifest: dict) -> None:
        manifest["complete"] = True
        self._write_manifest(manifest)

    def _write_manifest(self, manifest: dict) -> None:
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.manifest_path)

    # --- reading ------------------------------------------------------------------------------------
    def samples(self, stream: bool = False) -> list[FeatureBatch | StoredFeatureBatch]:
        """Every sample, in order. ``stream``: keep only token ids and masks in memory and read each
        sample's features from its shard when asked (:class:`StoredFeatureBatch`), so a multi-GB cache
        trains in a few hundred MB of RAM over many epochs (the OS page cache does the rest)."""
        from safetensors import safe_open

        manifest = self.manifest()
        if not manifest.get("complete"):
            raise ValueError(f"feature_cache.complete: {self.folder} is incomplete; rerun the extraction to resume")
        out = []
        for shard in sorted(manifest["shards"], key=lambda s: s["file"]):
            path = self.folder / shard["file"]
            stored = ShardFeatures(path)
            with safe_open(str(path), "pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask").bool()
                lengths = f.get_tensor("lengths").tolist()
                feats = None if stream else f.get_tensor("features")
                sample_ids = json.loads(f.metadata()["sample_ids"])
            start = 0
            for sid, n in zip(sample_ids, lengths):
                if stream:
                    out.append(StoredFeatureBatch(sid, ids[start : start + n], mask[start : start + n], stored, start))
                else:
                    out.append(
                        FeatureBatch(sid, ids[start : start + n], mask[start : start + n], feats[start : start + n])
                    )
                start += n
        return out


class FeatureCaches:
    """Several feature caches read as one (``data.train_cache`` as a list): their samples in the
    order of ``caches``, each cache checked against the trainer's target and taps on its own."""

    def __init__(self, caches: list[FeatureCache]):
        assert caches, "caches: at least one"
        self.caches = list(caches)

    def check(self, fingerprint: dict, taps: tuple[FeatureTap, ...]) -> list[dict]:
        return [cache.check(fingerprint, taps) for cache in self.caches]

    def samples(self, stream: bool = False) -> list[FeatureBatch | StoredFeatureBatch]:
        return [sample for cache in self.caches for sample in cache.samples(stream)]


class ShardFeatures:
    """The ``features`` tensor of one safetensors shard, memory-mapped on first use (read-only); rows
    are copied out on request, so the page cache, not the process, holds what was read."""

    def __init__(self, path: Path):
        self.path, self._rows = path, None

    def rows(self, start: int, stop: int) -> torch.Tensor:  # [stop - start, n_taps * d] float16
        if self._rows is None:
            with open(self.path, "rb") as fh:
                header_len = struct.unpack("<Q", fh.read(8))[0]
                info = json.loads(fh.read(header_len))["features"]
            if info["dtype"] != "F16":
                raise ValueError(f"feature_cache: {self.path} stores features as {info['dtype']}, expected F16")
            self._rows = np.memmap(
                self.path,
                dtype=np.float16,
                mode="r",
                shape=tuple(info["shape"]),
                offset=8 + header_len + info["data_offsets"][0],
            )
        return torch.from_numpy(np.array(self._rows[start:stop]))


@dataclass(frozen=True)
class StoredFeatureBatch:
    """A :class:`FeatureBatch` whose features stay in its shard until read (``features``)."""

    sample_id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    shard: ShardFeatures
    start: int  # the sample's first row in the shard's features

    @property
    def features(self) -> torch.Tensor:  # [S, n_taps * d] float16
        return self.shard.rows(self.start, self.start + self.input_ids.numel())


class OnlineFeatures:
    """Features made when a sample is read: the frozen target runs over it inside the training step
    (SpecForge's online mode) in ``dtype``, so nothing is written to disk and a stream of any length
    trains in constant space. Each sample costs one target forward per epoch; a cache costs one in
    all plus about 4.6 KB a token of disk (float16, four taps of 576), so the online source fits a
    single streaming pass and the cache several epochs.

    ``dtype`` bfloat16 runs a bfloat16 copy of the target (about 3x the float32 rate on a CPU with
    AVX-512 BF16); its features and soft labels differ from float32 in the last bits
    (``docs/benchmarks.md`` measures what that does to a drafter)."""

    def __init__(
        self,
        model: TargetModel,
        samples: list[Sample],
        taps: tuple[FeatureTap, ...],
        dtype: torch.dtype = torch.float32,
    ):
        import copy

        assert not any(p.requires_grad for p in model.parameters()), "the target must be frozen"
        self.model = model if model.embed.weight.dtype == dtype else copy.deepcopy(model).to(dtype)
        self.taps = taps
        self.dtype = dtype
        longest = max((len(s.input_ids) for s in samples), default=0)
        if longest > model.cfg.max_context:
            raise ValueError(
                f"data.max_len: a sample holds {longest} tokens, beyond the target's context "
                f"({model.cfg.max_context}); lower data.max_len"
            )
        self._samples = samples

    def samples(self) -> list[OnlineFeatureBatch]:
        return [OnlineFeatureBatch(s.sample_id, s.input_ids, s.loss_mask, s.position_id, self) for s in self._samples]

    @torch.no_grad()  # not inference_mode: the features enter autograd as inputs of the drafter
    def features(self, input_ids: torch.Tensor, position_id: torch.Tensor) -> torch.Tensor:  # [S, n_taps * d]
        model = self.model
        dev = model.embed.weight.device
        n = input_ids.numel()
        cache = model.allocate_cache(1, n)
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().unsqueeze(0)  # [1, n, n]
        out = model(input_ids[None].to(dev), position_id[None].to(dev), cache, 0, mask, self.taps, logits_rows="none")
        return out.features[0]


@dataclass(frozen=True)
class OnlineFeatureBatch:
    """A :class:`FeatureBatch` whose features the target computes when they are read."""

    sample_id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    position_id: torch.Tensor  # [S] int64
    source: OnlineFeatures

    @property
    def features(self) -> torch.Tensor:  # [S, n_taps * d], the source's dtype
        return self.source.features(self.input_ids, self.position_id)
