"""Drafter checkpoints: ``model.safetensors`` plus a JSON manifest (design 0x01A).

A drafter fits only the target it was trained on. The manifest records the target fingerprint
(config, weight and tokenizer digests), the feature address (which taps, pre- or post-norm), the
drafter configuration (draft vocabulary included, its maps live in the safetensors file), the loss
weights and recipe it was trained with, and the tree ABI. Loading against a target with another
fingerprint or feature address is refused with an error naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eyas.drafting.model import EYAS_V1, Drafter, DrafterConfig
from eyas.target.config import FeatureTap
from eyas.target.loader import TargetFingerprint

MANIFEST_FORMAT = "eyas-drafter/1"
MANIFEST_FILE, WEIGHTS_FILE = "manifest.json", "model.safetensors"


class FingerprintSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config_digest: str
    weight_digest: str
    tokenizer_digest: str


class TapSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layers_applied: int = Field(ge=0)
    normed: bool


class TreeABI(BaseModel):
    """How a tree built by this drafter is laid out for the verifier (design 0x05C)."""

    model_config = ConfigDict(extra="forbid")
    root_row: Literal["frontier_token"] = "frontier_token"
    positions: Literal["base_plus_depth"] = "base_plus_depth"
    draft_row_input: Literal["state_t;embed(x_t+1)"] = "state_t;embed(x_t+1)"
    default_tree: dict = Field(
        default_factory=lambda: {"kind": "dynamic", "expand_width": 4, "max_depth": 5, "verify_budget": 16}
    )


class DrafterManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["eyas-drafter/1"] = MANIFEST_FORMAT
    method: Literal["eagle1", "eagle3"]
    target_fingerprint: FingerprintSpec
    feature_address: list[TapSpec]
    drafter_config: dict
    tree_abi: TreeABI = Field(default_factory=TreeABI)
    loss_weights: dict[str, float] = Field(default_factory=dict)
    recipe: dict = Field(default_factory=dict)

    def taps(self) -> tuple[FeatureTap, ...]:
        return tuple(FeatureTap(t.layers_applied, t.normed) for t in self.feature_address)


def _pydantic_error(err: ValidationError, prefix: str) -> ValueError:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"])
    return ValueError(f"{prefix}{field}: {first['msg']}")


def check_compatible(
    manifest: DrafterManifest, fingerprint: TargetFingerprint, taps: tuple[FeatureTap, ...] | None = None
) -> None:
    """Refuse a drafter whose target fingerprint (or feature address) differs (design 0x01A)."""
    for name in ("config_digest", "weight_digest", "tokenizer_digest"):
        want, have = getattr(manifest.target_fingerprint, name), getattr(fingerprint, name)
        if want != have:
            raise ValueError(
                f"manifest.target_fingerprint.{name}: the drafter was trained for target "
                f"{want[:12]}…, this target is {have[:12]}…"
            )
    if taps is not None and manifest.taps() != tuple(taps):
        raise ValueError(f"manifest.feature_address: {manifest.taps()} differs from the target's taps {taps}")


def save_drafter(
    folder: str | Path, drafter: Drafter, manifest: DrafterManifest, dtype: torch.dtype = torch.float16
) -> Path:
    """Write the weights (floating tensors stored as ``dtype``, fp16 by default: half the bytes of a
    served fp32 drafter, which loads them back as fp32) and the manifest."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in drafter.state_dict().items()
    }
    save_file(state, str(folder / WEIGHTS_FILE))
    (folder / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    return folder


def read_manifest(folder: str | Path) -> DrafterManifest:
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"drafter: {folder} has no {MANIFEST_FILE}")
    try:
        return DrafterManifest.model_validate_json(path.read_text())
    except ValidationError as err:
        raise _pydantic_error(err, "manifest.") from None


def load_drafter(
    folder: str | Path, fingerprint: TargetFingerprint, taps: tuple[FeatureTap, ...] | None = None
) -> tuple[Drafter, DrafterManifest]:
    """Load a drafter checkpoint for the target with ``fingerprint``; refuse a mismatch."""
    from safetensors.torch import load_file

    manifest = read_manifest(folder)
    check_compatible(manifest, fingerprint, taps)
    try:
        # a manifest written before layouts existed is the eyas-v1 layout
        cfg = DrafterConfig(**{"layout": EYAS_V1, **manifest.drafter_config})
    except TypeError as err:
        raise ValueError(f"manifest.drafter_config: {err}") from None
    if cfg.method != manifest.method:
        raise ValueError(f"manifest.drafter_config.method: {cfg.method!r} != manifest.method {manifest.method!r}")
    drafter = Drafter(cfg)
    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    expected = drafter.state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise ValueError(f"checkpoint.{name}: missing from {WEIGHTS_FILE}")
        if (
            state[name].shape != tensor.shape
            or state[name].is_floating_point() != tensor.is_floating_point()
            or (not tensor.is_floating_point() and state[name].dtype != tensor.dtype)
        ):
            raise ValueError(
                f"checkpoint.{name}: shape/dtype {tuple(state[name].shape)}/{state[name].dtype} "
                f"!= expected {tuple(tensor.shape)}/{tensor.dtype}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ValueError(f"checkpoint.{extra[0]}: unexpected tensor")
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    if cfg.method == "eagle3":
        drafter.set_draft_vocab(drafter.d2t.clone())  # validates the maps and rebuilds t2d
    return drafter, manifest


def manifest_for(
    method: str, drafter: Drafter, fingerprint: TargetFingerprint, taps: tuple[FeatureTap, ...], **extra
) -> DrafterManifest:
    return DrafterManifest(
        method=method,
        target_fingerprint=FingerprintSpec(**fingerprint.to_dict()),
        feature_address=[TapSpec(layers_applied=t.layers_applied, normed=t.normed) for t in taps],
        drafter_config=drafter.cfg.to_dict(),
        **extra,
    )


def trim_drafter_vocab(
    folder: str | Path,
    out: str | Path,
    fingerprint: TargetFingerprint,
    token_counts: torch.Tensor,  # [V] int64 occurrences of each target token in the training answers
    size: int,
    note: str,
) -> tuple[Drafter, DrafterManifest, torch.Tensor]:
    """Write to ``out`` the EAGLE-3 drafter of ``folder`` with its draft vocabulary cut to the ``size``
    most frequent of its own tokens (:func:`eyas.drafting.vocab.trim_draft_vocab`): the kept tokens'
    head rows as trained, every other weight unchanged, ``d2t``/``t2d`` and
    ``drafter_config.draft_vocab_size`` to match, ``note`` recorded as ``recipe.draft_vocab_trimmed``.
    A smaller head is a smaller folder and a cheaper draft step; what it drops is the mass of the
    rare tokens (a draft can no longer propose them). Returns the trimmed drafter, its manifest and
    the source's ``d2t`` ([Vo] int64, what it held before)."""
    import dataclasses

    from safetensors import safe_open

    from eyas.drafting.vocab import carry_rows, trim_draft_vocab

    drafter, manifest = load_drafter(folder, fingerprint)
    if drafter.cfg.method != "eagle3":
        raise ValueError(f"drafter: {folder} is an {drafter.cfg.method} drafter; only EAGLE-3 has a draft vocabulary")
    if tuple(token_counts.shape) != (drafter.cfg.target_vocab_size,):
        raise ValueError(f"token_counts: expected [V={drafter.cfg.target_vocab_size}], got {list(token_counts.shape)}")
    if Path(out).resolve() == Path(folder).resolve():
        raise ValueError("out: must differ from the drafter folder it trims")
    old_d2t = drafter.d2t.clone()  # [Vo]
    new_d2t = trim_draft_vocab(old_d2t, token_counts, size)  # [size]
    state = drafter.state_dict()
    head = state["head.weight"]  # [Vo, d]
    state["head.weight"] = carry_rows(old_d2t, head, new_d2t, head.new_zeros((size, head.shape[1])))
    state["d2t"] = new_d2t
    trimmed = Drafter(dataclasses.replace(drafter.cfg, draft_vocab_size=size))
    trimmed.load_state_dict(state)
    trimmed.set_draft_vocab(new_d2t.clone())  # validates the map, rebuilds t2d
    new_manifest = manifest.model_copy(
        update={
            "drafter_config": trimmed.cfg.to_dict(),
            "recipe": {**manifest.recipe, "draft_vocab_trimmed": note},
        }
    )
    with safe_open(str(Path(folder) / WEIGHTS_FILE), "pt") as f:  # written as it was stored (fp16 by default)
        stored = f.get_tensor("head.weight").dtype
    save_drafter(out, trimmed, new_manifest, dtype=stored)
    return trimmed, new_manifest, old_d2t
