"""The training configuration (a YAML file, validated by pydantic; errors name the field)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    train_samples: int = Field(1000, ge=1)
    # the target's answers (regenerate: true) before these many are skipped: a run warm-started from
    # a drafter that trained on the file's first answers trains on the next ones (answers
    # skip_samples + 1 .. skip_samples + train_samples)
    skip_samples: int = Field(0, ge=0)
    heldout_samples: int = Field(32, ge=1)
    max_len: int = Field(512, ge=16)
    regenerate: bool = False  # answer the first user turns with the target itself (EAGLE-3 practice)
    regen_max_new_tokens: int = Field(192, ge=1)  # answers longer than this are cut (end token unsupervised)
    regen_batch: int = Field(64, ge=1)  # prompts per batched generate call
    regen_max_prompt_tokens: int = Field(256, ge=8)  # longer first turns are skipped
    regen_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # bf16: 533-692 tok/s here, fp32 60-143
    # the train split's answers sampled from the target at this temperature (0: greedy), pass
    # regen_sample: `python -m eyas.training.regen --temperature T --sample S`, in their own file
    # <target>-sharegpt-train.t<T>s<S>.answers.jsonl beside the greedy one; the held-out split stays greedy
    regen_temperature: float = Field(0.0, ge=0, le=2)
    regen_sample: int = Field(0, ge=0)
    # where the regenerated answers live: None = beside the feature cache; a folder (for example the
    # committed data/regen) holds <target>-sharegpt-<split>.answers.jsonl, made or resumed by
    # `python -m eyas.training.regen`
    answers_dir: str | None = None
    cache_dir: str = "~/.cache/eyas/features/smollm2-135m-sharegpt"
    # a feature cache to train on as it is: its samples after skip_samples, train_samples of them
    # (the target's answers with the features their own decoding recorded: `python -m
    # eyas.training.regen --features DIR`); the train split then needs no extraction or regeneration.
    # A list of caches is read as one, their samples in the order listed (greedy answers beside a
    # sampled pass, each made by its own regen run); the training order is a permutation anyway
    train_cache: str | list[str] | None = None

    @property
    def train_caches(self) -> list[str]:
        """``train_cache`` as a list of folders ([] when none)."""
        if self.train_cache is None:
            return []
        return [self.train_cache] if isinstance(self.train_cache, str) else list(self.train_cache)

    # the train cache to read, made for this many samples (None = train_samples); the run trains on
    # its first train_samples, so runs of several data sizes (a learning curve) share one extraction
    cache_samples: int | None = Field(None, ge=1)
    # beside the target's own answers (regenerate: true), this many ShareGPT conversations whole:
    # every assistant turn supervised by the target's soft distribution (EAGLE-1's data), no decoding
    sharegpt_samples: int = Field(0, ge=0)
    # where the training features come from: "cache" (extracted once to disk, float16, then read)
    # or "online" (the frozen target runs inside the training step, in feature_dtype; nothing on disk)
    features: Literal["cache", "online"] = "cache"
    # online extraction's compute dtype; "gguf": the target at the gguf precision (its checkpoint's own
    # 4-bit blocks, eyas.target.quantized), so a drafter learns the features it is served at gguf
    feature_dtype: Literal["float32", "bfloat16", "gguf"] = "float32"
    # the held-out split is the target's own answers to held-out first turns (what a drafter drafts
    # when served); None: as the train split (regenerate)
    heldout_answers: bool | None = None

    @property
    def heldout_regenerated(self) -> bool:
        return self.regenerate if self.heldout_answers is None else self.heldout_answers

    @model_validator(mode="after")
    def _cache_holds_the_train_samples(self):
        if self.cache_samples is not None and self.cache_samples < self.train_samples:
            raise ValueError(
                f"cache_samples ({self.cache_samples}) must be at least train_samples ({self.train_samples})"
            )
        if isinstance(self.train_cache, list) and (
            not self.train_cache or len(set(self.train_cache)) != len(self.train_cache)
        ):
            raise ValueError("train_cache: a list names one or more caches, each once")
        if self.train_cache is not None and (self.features != "cache" or self.sharegpt_samples):
            raise ValueError("train_cache: a cache is read as it is (features: cache, no sharegpt_samples)")
        if (self.regen_temperature or self.regen_sample) and not self.regenerate:
            raise ValueError("regen_temperature: sampled answers are the target's own (regenerate: true)")
        if self.regen_sample and not self.regen_temperature:
            raise ValueError("regen_sample: a sampling pass needs regen_temperature > 0")
        if self.skip_samples and not (self.regenerate or self.train_cache):
            raise ValueError(
                "skip_samples: skips the target's own answers (regenerate: true) or a train_cache's samples"
            )
        if self.skip_samples and self.cache_samples is not None:
            raise ValueError("skip_samples: a cache shared by several sizes (cache_samples) starts at the first answer")
        if self.sharegpt_samples and not self.regenerate:
            raise ValueError(
                "sharegpt_samples: ShareGPT conversations are added beside the target's own "
                "answers (regenerate: true); without them train_samples already counts ShareGPT"
            )
        if self.sharegpt_samples and self.features != "online":
            raise ValueError("sharegpt_samples: the mix is read online (features: online)")
        if self.feature_dtype != "float32" and self.features != "online":
            raise ValueError("feature_dtype: applies to online features (the cache is extracted in float32)")
        return self


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["eagle1", "hass", "eagle3"] = "eagle3"
    target: str = "smollm2-135m"
    out: str = "drafters/smollm2-135m-eagle3"
    layout: Literal["reference", "eyas-v1"] = "reference"  # the drafter network (eyas.drafting.model)
    fc_norm: bool = False  # reference EAGLE-3: a norm per tap before fc
    init_from: str | None = None  # warm start: a drafter folder of the same method and target
    # continue another run: its trainer state file (a wsd run's stable state, out/trainer_state.pt):
    # the drafter's weights and vocabulary and the optimizer's moments, with this run's own data, step
    # count and schedule, so that a run over new data goes on at the earlier run's rate instead of
    # re-warming a decayed drafter (set warmup_steps: 0)
    init_state: str | None = None
    data: DataConfig = Field(default_factory=DataConfig)
    epochs: float = Field(1.0, gt=0)
    batch_samples: int = Field(4, ge=1)  # samples per optimizer step (gradient accumulation)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(0.5, gt=0)  # pinned EAGLE: 0.5
    betas: tuple[float, float] = (0.9, 0.95)  # pinned EAGLE: AdamW(0.9, 0.95)
    noise: Literal["paper", "pinned", "none"] = "paper"  # design 0x04E (EAGLE-1 / HASS)
    reg_weight: float = 1.0  # v_w (design 0x04B)
    cls_weight: float = 0.1  # p_w (design 0x04B)
    hass_steps: int = Field(3, ge=1)  # HASS context-alignment steps (design 0x07C: 3)
    hass_topk: int = Field(10, ge=1)  # HASS top-K (design 0x07C: 10)
    hass_topk_weight: float = 1.0
    ttt_steps: int = Field(4, ge=1)  # EAGLE-3 training-time-test passes (pinned: 7)
    ttt_decay: float = Field(0.8, gt=0)  # weights 0.8^s (design 0x08C)
    draft_vocab_size: int = Field(8192, ge=16)  # EAGLE-3 draft vocabulary
    # EAGLE-3 with init_from or init_state: rebuild the draft vocabulary at draft_vocab_size from the
    # target's own answers (every <target>-sharegpt-train*.answers.jsonl in data.answers_dir, greedy
    # and sampled passes) instead of keeping the start's. A token both vocabularies hold keeps its
    # head row (and its optimizer moments); a new one starts at its target LM-head row taken into the
    # drafter's head space by a least-squares map (eyas.drafting.vocab.rebuilt_head)
    rebuild_draft_vocab: bool = False
    eval_every: int = Field(100, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"  # cpu | cuda | cuda:N: drafter, target head and batches
    # the drafter's compute dtype under autocast (weights, optimizer and losses stay float32)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # samples of a step packed into one token grid of at most this many tokens (one drafter pass per
    # rollout step for all of them; each keeps its own attention, supervision and loss); None: one by
    # one; "auto": 2048 on a GPU, one by one on the CPU (where packing measured 0.75x at fp32: the
    # attention over a pack grows with its square)
    pack_tokens: int | Literal["auto"] | None = "auto"
    # learning-rate schedule: "cosine" (warmup, cosine to 10 % over the run) or "wsd" (warmup, then
    # constant; at each of decay_points -- supervised tokens seen -- a branch continues from the
    # stable state for decay_fraction of those tokens with the rate falling linearly to 0, and is
    # exported as a drafter of its own under out/point-<tokens>; the main run goes on from the
    # stable state, so every point is both a learning-curve point and a shippable drafter)
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_points: list[int] = Field(default_factory=list)
    decay_fraction: float = Field(0.1, gt=0, le=1)

    @model_validator(mode="after")
    def _one_start(self):
        if self.init_from and self.init_state:
            raise ValueError("init_state: a run starts from a drafter folder (init_from) or a trainer state, not both")
        if self.rebuild_draft_vocab and not (self.init_from or self.init_state):
            raise ValueError("rebuild_draft_vocab: rebuilds a warm start's vocabulary (init_from or init_state)")
        if self.rebuild_draft_vocab and self.method != "eagle3":
            raise ValueError("rebuild_draft_vocab: only EAGLE-3 drafters have a draft vocabulary")
        if self.rebuild_draft_vocab and not self.data.answers_dir:
            raise ValueError("rebuild_draft_vocab: counts the answers in data.answers_dir; set it")
        return self

    @model_validator(mode="after")
    def _device_parses(self):
        from eyas.target.loader import check_device

        check_device(self.device, here=False)
        if isinstance(self.pack_tokens, int) and self.pack_tokens < 16:
            raise ValueError(f"pack_tokens: must be at least 16, got {self.pack_tokens}")
        if self.decay_points and self.schedule != "wsd":
            raise ValueError("decay_points: only a wsd schedule branches")
        if sorted(set(self.decay_points)) != self.decay_points or any(p < 1 for p in self.decay_points):
            raise ValueError(f"decay_points: supervised-token counts, positive and increasing, got {self.decay_points}")
        return self

    def pack_limit(self) -> int | None:
        """Tokens per pack (None: one sample at a time); see ``pack_tokens``."""
        if self.pack_tokens == "auto":
            return 2048 if self.device.startswith("cuda") else None
        return self.pack_tokens


def load_config(path: str | Path) -> TrainConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config: {path} is not valid YAML ({err})") from None
    return validated(raw)


def validated(raw: dict) -> TrainConfig:
    """``raw`` as a TrainConfig; the first error names its field (``config.<field>: ...``)."""
    try:
        return TrainConfig(**raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"config.{where}: {message}" if where else f"config.{message}") from None
