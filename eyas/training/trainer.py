"""The drafter trainer: EAGLE-1 (design 0x04), HASS (design 0x07) and EAGLE-3 (design 0x08C).

All three share one *rollout*: on the token grid of one sample (length S), step 0 row ``i`` reads
the teacher state at ``i`` and token ``x_{i+1}``; step ``s`` row ``i`` reads the drafter's own output
of ``(s-1, i)`` and token ``x_{i+s+1}``, at position ``i + s``, seeing the target prefix ``j <= i`` of
step 0 plus its own chain (``rollout_visibility``). It is supervised against the teacher feature
``f_{i+s+1}`` and the target distribution ``q = softmax(W_U f_{i+s+1})`` of ``x_{i+s+2}``.

- ``eagle1``: one step; ``reg_weight * SmoothL1 + cls_weight * soft CE`` with feature noise.
- ``hass``: ``hass_steps`` steps of the EAGLE-1 loss plus ``hass_topk_weight *`` top-K distillation
  (target mass not renormalised), with the alignment mask (harmonized context).
- ``eagle3``: ``ttt_steps`` steps, three fused taps at step 0, no regression, soft CE over the draft
  vocabulary, weighted ``ttt_decay ** s``.

The target is frozen and owns no gradient (design 0x04D, asserted each step). A step whose batch
has no supervised row is skipped entirely, weight decay included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.drafting.manifest import TreeABI, manifest_for, save_drafter
from eyas.drafting.model import Drafter, DrafterConfig, drafter_feature_address, init_drafter
from eyas.drafting.vocab import build_draft_vocab, carry_rows, rebuilt_head
from eyas.target.config import FeatureTap
from eyas.target.layers import GrowingKV
from eyas.target.loader import DTYPES, check_device
from eyas.target.model import TargetModel
from eyas.training.config import TrainConfig
from eyas.training.features import (
    FeatureBatch,
    FeatureCache,
    FeatureCaches,
    OnlineFeatures,
    SampleList,
    training_taps,
)
from eyas.training.losses import feature_noise, row_soft_cross_entropy
from eyas.training.masks import rollout_valid, rollout_visibility
from eyas.training.rows import dense_row_masks

STATE_FILE = "trainer_state.pt"
TOPK_STATS = 8  # evaluation reports top-1..8 accuracy per rollout step (the tree model's rank rates)


@dataclass(frozen=True)
class StepStats:
    loss: float
    supervised_rows: int
    per_step_loss: tuple[float, ...]


def packs(samples: list[FeatureBatch], max_tokens: int | None) -> list[list[FeatureBatch]]:
    """``samples`` in order, grouped into packs of at most ``max_tokens`` tokens (a longer sample is
    a pack of its own; None: one sample per pack)."""
    if max_tokens is None:
        return [[fb] for fb in samples]
    out: list[list[FeatureBatch]] = []
    used = 0
    for fb in samples:
        n = fb.input_ids.numel()
        if out and used + n <= max_tokens:
            out[-1].append(fb)
            used += n
        else:
            out.append([fb])
            used = n
    return out


class DrafterTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        target: TargetModel,
        fingerprint: dict,
        train: FeatureCache | FeatureCaches | OnlineFeatures | SampleList,
        heldout: FeatureCache | SampleList,
        out: str | Path | None = None,
        vocab_counts: torch.Tensor | None = None,  # [V] int64: rebuild_draft_vocab's token counts
    ):
        self.cfg = cfg
        self.device = check_device(cfg.device)  # here: the config checked its syntax (dtype: a Literal)
        self.target = target.requires_grad_(False).to(self.device)
        self.fingerprint = fingerprint
        self.out = Path(out or cfg.out)
        self.d = target.cfg.hidden_size
        taps = training_taps(target)
        self.train_data = self._load(train, fingerprint, taps)
        if isinstance(train, (FeatureCache, FeatureCaches)):  # a prefix of a larger cache (data.cache_samples), or a
            # train_cache's samples after skip_samples (a regenerated cache is made for its own skip)
            skip = cfg.data.skip_samples if cfg.data.train_caches else 0
            self.train_data = self.train_data[skip : skip + cfg.data.train_samples]
        self.heldout_data = self._load(heldout, fingerprint, taps)
        method = "eagle3" if cfg.method == "eagle3" else "eagle1"
        dcfg = DrafterConfig.for_target(
            method,
            target.cfg,
            min(cfg.draft_vocab_size, target.cfg.vocab_size) if method == "eagle3" else None,
            layout=cfg.layout,
            fc_norm=cfg.fc_norm and method == "eagle3",
        )
        self.serve_taps: tuple[FeatureTap, ...] = drafter_feature_address(dcfg, target.cfg)
        self.drafter: Drafter = init_drafter(dcfg, seed=cfg.seed)
        self.new_d2t: torch.Tensor | None = None  # [Vd] int64: the rebuilt draft vocabulary (rebuild_draft_vocab)
        if cfg.rebuild_draft_vocab:
            if vocab_counts is None or tuple(vocab_counts.shape) != (target.cfg.vocab_size,):
                raise ValueError(f"vocab_counts: rebuild_draft_vocab needs [V={target.cfg.vocab_size}] token counts")
            self.new_d2t = build_draft_vocab(vocab_counts.to(torch.int64), dcfg.out_vocab)
        if cfg.init_from:
            self._warm_start(Path(cfg.init_from), method, dcfg)
        elif method == "eagle3" and not cfg.init_state:
            counts = torch.zeros(target.cfg.vocab_size, dtype=torch.int64)
            for fb in self.train_data:
                counts += torch.bincount(fb.input_ids[fb.loss_mask], minlength=target.cfg.vocab_size)
            self.drafter.set_draft_vocab(build_draft_vocab(counts, dcfg.out_vocab))
        self.drafter.to(self.device)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        # fused: one kernel per parameter for the whole update (the foreach path makes a pass, and a
        # fresh head-sized temporary, per arithmetic op)
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
        )
        self.steps_per_epoch = max(1, len(self.train_data) // cfg.batch_samples)
        self.total_steps = max(1, int(math.ceil(cfg.epochs * self.steps_per_epoch)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step = 0
        if cfg.init_state:
            self._continue_from(Path(cfg.init_state))
        self.noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
        # a wsd decay branch in progress: {"tokens", "start", "length"} (None on the main run)
        self.branch: dict | None = None
        self._perms: dict[int, list[int]] = {}

    def _warm_start(self, folder: Path, method: str, dcfg: DrafterConfig) -> None:
        """Start from a shipped drafter's weights (and its draft vocabulary): fresh optimizer and schedule."""
        from eyas.drafting.manifest import load_drafter, read_manifest
        from eyas.target.loader import TargetFingerprint

        if (found := read_manifest(folder).method) != method:
            raise ValueError(f"config.init_from: {folder} is a {found} drafter, not {method}")
        source, _ = load_drafter(folder, TargetFingerprint(**self.fingerprint), self.serve_taps)
        expected = (
            dataclasses.replace(dcfg, draft_vocab_size=source.cfg.draft_vocab_size)
            if self.new_d2t is not None
            else dcfg
        )
        if source.cfg != expected:
            raise ValueError(f"config.init_from: {folder} has drafter config {source.cfg}, expected {expected}")
        state = {k: v.float() if v.is_floating_point() else v for k, v in source.state_dict().items()}
        self.drafter.load_state_dict(self._rebuilt(state)[0] if self.new_d2t is not None else state)
        if method == "eagle3":
            self.drafter.set_draft_vocab(self.drafter.d2t.clone())  # validates the map, rebuilds t2d

    def _rebuilt(self, drafter_state: dict, optimizer_state: dict | None = None) -> tuple[dict, dict | None]:
        """A drafter state dict (and the optimizer's) moved to the rebuilt draft vocabulary
        ``self.new_d2t``: head rows by :func:`rebuilt_head`, the head's moments by :func:`carry_rows`
        (a new row's start at zero)."""
        old_d2t = drafter_state["d2t"].to(torch.int64)  # [Vo]
        new_d2t = self.new_d2t.to(old_d2t.device)  # [Vn]
        head = rebuilt_head(old_d2t, drafter_state["head.weight"], new_d2t, self.target.lm_head.weight.detach())
        t2d = torch.zeros_like(drafter_state["t2d"])
        t2d[new_d2t] = True
        drafter_state = {**drafter_state, "head.weight": head, "d2t": new_d2t.clone(), "t2d": t2d}
        if optimizer_state is not None:
            names = [n for n, p in self.drafter.named_parameters() if p.requires_grad]
            slot = optimizer_state["param_groups"][0]["params"][names.index("head.weight")]
            moments = dict(optimizer_state["state"].get(slot, {}))
            for key in ("exp_avg", "exp_avg_sq"):
                if key in moments:
                    old = moments[key]
                    moments[key] = carry_rows(old_d2t, old, new_d2t, old.new_zeros((new_d2t.shape[0], *old.shape[1:])))
            optimizer_state = {**optimizer_state, "state": {**optimizer_state["state"], slot: moments}}
        kept = int(torch.isin(new_d2t, old_d2t).sum())
        print(f"draft vocabulary rebuilt: {new_d2t.shape[0]} tokens, {kept} kept from the start's {old_d2t.shape[0]}")
        return drafter_state, optimizer_state

    def _continue_from(self, path: Path) -> None:
        """Take another run's drafter (weights, vocabulary) and optimizer moments from its trainer
        state file; this run keeps its own step count, schedule and data (``init_state``)."""
        if not path.exists():
            raise ValueError(f"config.init_state: {path} does not exist")
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state.get("method") != self.cfg.method:
            raise ValueError(f"config.init_state: {path} is a {state.get('method')} run's state, not {self.cfg.method}")
        if state.get("branch") is not None:
            raise ValueError(f"config.init_state: {path} is inside a decay branch; continue from the stable state")
        drafter_state, optimizer_state = state["drafter"], state["optimizer"]
        if self.new_d2t is not None:
            drafter_state, optimizer_state = self._rebuilt(drafter_state, optimizer_state)
        try:
            self.drafter.load_state_dict(drafter_state)
        except RuntimeError as err:
            raise ValueError(f"config.init_state: {path} holds another drafter shape ({str(err)[:200]})") from None
        self.optimizer.load_state_dict(optimizer_state)
        if self.cfg.method == "eagle3":
            self.drafter.set_draft_vocab(self.drafter.d2t.clone())
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["initial_lr"], group["lr"] = base, base * self._lr_factor(0)  # this run's rate, from its step 0

    @staticmethod
    def _load(
        cache: FeatureCache | FeatureCaches | OnlineFeatures | SampleList, fingerprint: dict, taps
    ) -> list[FeatureBatch]:
        if isinstance(cache, (OnlineFeatures, SampleList)):
            if cache.taps != taps:
                raise ValueError(f"features.taps: {cache.taps} != the trainer's {taps}")
            return cache.samples()
        cache.check(fingerprint, taps)
        return cache.samples(stream=True)  # features read from disk per step: a cache of any size fits

    def _lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine decay to 10 % (``cosine``), or constant (``wsd``), falling
        linearly to 0 over a decay branch: 1 at its first step, 1/length at its last."""
        if step < self.cfg.warmup_steps:
            return (step + 1) / self.cfg.warmup_steps
        if self.cfg.schedule == "wsd":
            branch = getattr(self, "branch", None)
            if branch is None:
                return 1.0
            return max(branch["start"] + branch["length"] - step, 0) / branch["length"]
        progress = (step - self.cfg.warmup_steps) / max(1, self.total_steps - self.cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def set_rate(self, step: int) -> None:
        """Put the optimizer at ``step``'s rate (the schedule, and the decay branch when one is set)
        without stepping the scheduler: a caller that moves ``step`` or ``branch`` itself (the online
        learner's decay branches)."""
        self.scheduler.last_epoch = step
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self._lr_factor(step)

    # --- data order ------------------------------------------------------------------------------------
    def batch_indices(self, step: int) -> list[int]:
        """The samples of optimizer step ``step``: a seeded permutation per epoch (resumable by step)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch not in self._perms:
            self._perms = {
                epoch: torch.randperm(
                    len(self.train_data), generator=torch.Generator().manual_seed(self.cfg.seed + epoch)
                ).tolist()
            }
        b = self.cfg.batch_samples
        return self._perms[epoch][within * b : (within + 1) * b]

    def supervised_tokens_before(self, steps: int) -> list[int]:
        """Supervised tokens seen before each step ``0..steps`` (``steps + 1`` counts)."""
        sizes = [int(fb.loss_mask.sum()) for fb in self.train_data]
        out, seen = [0], 0
        for step in range(steps):
            seen += sum(sizes[i] for i in self.batch_indices(step))
            out.append(seen)
        return out

    def decay_point_steps(self) -> list[tuple[int, int]]:
        """(tokens, step) for each ``decay_points`` entry: the first step at which that many supervised
        tokens have been seen. A point beyond the run's data (``epochs``) is refused, naming it."""
        seen = self.supervised_tokens_before(self.total_steps)
        out = []
        for tokens in self.cfg.decay_points:
            step = next((k for k, n in enumerate(seen) if n >= tokens), None)
            if step is None:
                raise ValueError(
                    f"config.decay_points: {tokens} supervised tokens is past the run's "
                    f"{seen[-1]} ({self.total_steps} steps); add data or epochs"
                )
            out.append((tokens, step))
        return out

    # --- the rollout loss ------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return {"eagle1": 1, "hass": self.cfg.hass_steps, "eagle3": self.cfg.ttt_steps}[self.cfg.method]

    def pack_loss(
        self, samples: list[FeatureBatch], noise: bool, stats: dict | None = None
    ) -> tuple[torch.Tensor | None, int]:
        """The sum of ``samples``' own losses, computed *packed*: their rows are concatenated into one
        token grid of ``N`` rows and every rollout step is one drafter pass over all of them. Segment
        ids keep each sample's attention (``rollout_visibility``) and supervision (``rollout_valid``)
        inside it (design 0x02A, 0x07B), positions restart per sample, and each sample's loss is the
        mean over its own supervised rows, as if it ran alone. -> (the sum, or None with no
        supervised row; the supervised-row count)."""
        cfg, d, dev = self.cfg, self.d, self.device
        lengths = [fb.input_ids.numel() for fb in samples]
        N = sum(lengths)
        ids = torch.cat([fb.input_ids for fb in samples]).to(dev)  # [N]
        loss_mask = torch.cat([fb.loss_mask for fb in samples]).to(dev)  # [N]
        feats = torch.cat([fb.features for fb in samples]).to(dev).float()  # [N, 4d]: low, mid, high, final
        counts = torch.tensor(lengths, device=dev)
        seg = torch.repeat_interleave(torch.arange(len(samples), device=dev), counts)  # [N] sample of each row
        starts = torch.cumsum(counts, 0) - counts  # [K]
        local = torch.arange(N, device=dev) - starts[seg]  # [N] position in its sample
        last = (starts + counts - 1)[seg]  # [N] its sample's last row
        final = feats[:, 3 * d :]  # [N, d] LM-head input
        valid = torch.ones(N, dtype=torch.bool, device=dev)
        row_valid = dense_row_masks(valid[None], seg[None], loss_mask[None])[0][0]  # b_t  [N]
        steps = self.num_steps
        supervised = rollout_valid(valid, seg, loss_mask, steps)  # [steps, N]
        visible = rollout_visibility(seg, row_valid, steps)  # [steps, N, steps*N]
        with torch.no_grad():  # the frozen target's distribution of every row's next token, once a pack
            q_all = torch.softmax(self._teacher_logits(final, exact=stats is not None), dim=-1)  # [N, V or Vd] fp32
        # one autocast region for the whole rollout: autocast casts each drafter weight to the compute
        # dtype once per region (its cast cache), where a region per call recast every weight each call
        with self.autocast():
            if cfg.method == "eagle3":
                taps = [feats[:, k * d : (k + 1) * d] for k in range(3)]  # raw low/mid/high
                taps = [self.target.norm(t) if tap.normed else t for t, tap in zip(taps, self.serve_taps)]
                state = self.drafter.target_state(torch.cat(taps, dim=-1))  # [N, d]
            else:
                state = final + (
                    torch.cat(
                        [
                            feature_noise(final[a : a + n][None], cfg.noise, self.noise_gen)[0]
                            for a, n in zip(starts.tolist(), lengths)
                        ]
                    )
                    if noise
                    else 0.0
                )
            cache = GrowingKV(1)
            rows = torch.arange(N, device=dev)
            n_sup = int(supervised[0].sum())
            outs, teacher_rows, weights, step_of_row = [], [], [], []
            for s in range(steps):
                nxt = torch.minimum(rows + s + 1, last)  # token x_{i+s+1} and teacher index f_{i+s+1}, in its sample
                h = self.drafter(
                    state[None],
                    self.target.embed(ids[nxt])[None],
                    (local + s)[None],
                    cache,
                    s * N,
                    visible[s, :, : (s + 1) * N][None],
                )[0]  # [N, d]
                m = supervised[s]
                if int(m.sum()) == 0:
                    break
                # each sample's loss at this step is the mean over its own supervised rows
                per_sample = torch.bincount(seg[m], minlength=len(samples)).to(torch.float32)  # [K]
                step_weight = cfg.ttt_decay**s if cfg.method == "eagle3" else 1.0
                outs.append(h[m])
                teacher_rows.append(nxt[m])
                weights.append(step_weight / per_sample[seg[m]])
                step_of_row.append(torch.full((int(m.sum()),), s, device=dev))
                state = h
            if not outs:
                return None, n_sup
            # one head call and one loss for every step's supervised rows (R of them)
            h_rows = torch.cat(outs)  # [R, d]
            teacher = torch.cat(teacher_rows)  # [R] rows of f_{i+s+1}
            logits = (
                self.drafter.head(self.drafter.norm(h_rows)) if cfg.method == "eagle3" else self._frozen_head(h_rows)
            )  # [R, V or Vd]
        q = q_all[teacher]  # [R, V or Vd] fp32
        row_loss = self._row_losses(h_rows, logits, final[teacher], q)  # [R] fp32
        total = (torch.cat(weights) * row_loss).sum()
        if stats is not None:
            step_of_row = torch.cat(step_of_row)
            top = logits.detach().float().topk(min(TOPK_STATS, logits.shape[-1]), dim=-1).indices
            rank_hit = (top == q.argmax(-1, keepdim=True)).cumsum(-1).bool()  # [R, k]: within the k best
            for s in range(steps):
                at = step_of_row == s
                hits = rank_hit[at].sum(0).tolist()
                topk = stats.setdefault("topk", [[0] * rank_hit.shape[1] for _ in range(steps)])[s]
                stats["topk"][s] = [a + b for a, b in zip(topk, hits)]
                stats.setdefault("rows", [0] * steps)[s] += int(at.sum())
                stats.setdefault("loss", [0.0] * steps)[s] += float(row_loss[at].sum())
        return total, n_sup

    def _teacher_logits(self, final: torch.Tensor, exact: bool) -> torch.Tensor:
        """The frozen target's logits of LM-head inputs ``final`` [N, d] -> [N, Vd] over the draft
        vocabulary (EAGLE-3) or [N, V] (EAGLE-1, HASS), returned as float32. EAGLE-3's head rows are
        gathered once per draft vocabulary, not once a pack. ``exact``: in float32 (evaluation, whose
        top-1 is against the target's argmax); else in the training dtype (a soft label's last bits
        do not move its gradient, and the product is the step's largest one in float32)."""
        dtype = torch.float32 if exact else DTYPES[self.cfg.dtype]
        if self.cfg.method != "eagle3":
            weight = self.target.lm_head.weight
            if dtype != weight.dtype:
                weight = self._frozen_head_weight(dtype)
            return (final.to(dtype) @ weight.T).float()
        key = self.drafter.d2t.data_ptr(), self.drafter.d2t._version, dtype
        if getattr(self, "_head_draft_key", None) != key:
            self._head_draft = self.target.lm_head.weight[self.drafter.d2t].to(dtype).contiguous()  # [Vd, d]
            self._head_draft_key = key
        return (final.to(dtype) @ self._head_draft.T).float()

    def _frozen_head_weight(self, dtype: torch.dtype) -> torch.Tensor:  # [V, d]
        """The frozen target LM head's weight in ``dtype``, cast once."""
        if getattr(self, "_head_lowp", None) is None or self._head_lowp.dtype != dtype:
            self._head_lowp = self.target.lm_head.weight.detach().to(dtype)
        return self._head_lowp

    def _frozen_head(self, h: torch.Tensor) -> torch.Tensor:
        """The frozen target LM head on drafter outputs h [M, d] -> [M, V] (EAGLE-1, HASS). Under
        autocast its weight is cast once and kept: autocast recasts only trainable weights once a
        region, and a frozen one every call."""
        dtype = DTYPES[self.cfg.dtype]
        if dtype == torch.float32:
            return self.target.lm_head(h)
        return torch.nn.functional.linear(h.to(dtype), self._frozen_head_weight(dtype))

    def _row_losses(
        self, h: torch.Tensor, logits: torch.Tensor, target_feature: torch.Tensor, q: torch.Tensor
    ) -> torch.Tensor:
        """Each supervised row's loss (before its step weight and its sample's mean): h [R, d],
        logits [R, V], target_feature [R, d], q [R, V] -> [R] fp32."""
        cfg = self.cfg
        ce = row_soft_cross_entropy(logits, q)
        if cfg.method == "eagle3":
            return ce
        reg = torch.nn.functional.smooth_l1_loss(h.float(), target_feature.float(), reduction="none").mean(-1)
        loss = cfg.reg_weight * reg + cfg.cls_weight * ce
        if cfg.method == "hass":
            log_p = torch.log_softmax(logits.float(), dim=-1)
            q_top, top_ids = q.topk(cfg.hass_topk, dim=-1)
            loss = loss - cfg.hass_topk_weight * (q_top * log_p.gather(-1, top_ids)).sum(-1)
        return loss

    def autocast(self):
        """Mixed precision for the drafter's forward (``dtype``): weights and optimizer stay float32,
        losses are float32."""
        return torch.autocast(self.device.type, dtype=DTYPES[self.cfg.dtype], enabled=self.cfg.dtype != "float32")

    # --- optimisation ----------------------------------------------------------------------------------
    def train_step(self) -> StepStats | None:
        """One optimizer step over ``batch_samples`` samples; None (skipped) with no supervised row."""
        return self.train_on([self.train_data[i] for i in self.batch_indices(self.step)])

    def train_on(self, samples: list[FeatureBatch]) -> StepStats | None:
        """One optimizer step over ``samples`` (a batch chosen by the caller: the online learner's mix
        of served traffic and replay); None (skipped) with no supervised row."""
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses, n_rows = [], 0
        for group in packs(samples, self.cfg.pack_limit()):
            loss, n = self.pack_loss(group, noise=True)
            if loss is not None:
                (loss / self.cfg.batch_samples).backward()
                losses.append(float(loss.detach()) / max(sum(bool(fb.loss_mask.any()) for fb in group), 1))
                n_rows += n
        self.step += 1
        if n_rows == 0:  # nothing supervised: no update, no weight decay (design 0x04A)
            self.scheduler.step()
            return None
        self.assert_gradient_ownership()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return StepStats(sum(losses) / len(losses), n_rows, ())

    def assert_gradient_ownership(self) -> None:
        """The target owns no gradient; the drafter does (design 0x04D)."""
        assert all(not p.requires_grad and p.grad is None for p in self.target.parameters()), "target has grads"
        assert any(p.grad is not None for p in self.drafter.parameters()), "drafter has no gradient"

    @torch.no_grad()
    def evaluate(self, data: list[FeatureBatch] | None = None) -> dict:
        """Loss and draft top-k accuracy against the target argmax, per rollout step, on ``data``
        (default: the held-out split): ``top1``, ``top3`` and ``topk`` ([step][k - 1], k = 1..8)."""
        self.drafter.eval()
        stats: dict = {}
        for group in packs(list(self.heldout_data if data is None else data), self.cfg.pack_limit()):
            self.pack_loss(group, noise=False, stats=stats)
        rows = [max(r, 1) for r in stats.get("rows", [1])]
        topk = [[h / r for h in hits] for hits, r in zip(stats.get("topk", [[0] * 3]), rows)]
        return {
            "top1": [t[0] for t in topk],
            "top3": [t[min(2, len(t) - 1)] for t in topk],
            "topk": topk,
            "loss": [x / r for x, r in zip(stats.get("loss", [0.0]), rows)],
        }

    # --- checkpoints -----------------------------------------------------------------------------------
    def save_state(self, name: str = STATE_FILE) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "noise_gen": self.noise_gen.get_state(),
            "method": self.cfg.method,
            "branch": self.branch,
        }
        tmp = self.out / (name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / name)

    def load_state(self, name: str = STATE_FILE) -> bool:
        path = self.out / name
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state.get("method") != self.cfg.method:
            raise ValueError(f"checkpoint.method: {state.get('method')!r} != config method {self.cfg.method!r}")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.noise_gen.set_state(state["noise_gen"].cpu())
        self.branch = state.get("branch")
        return True

    def export(self, summary: dict, out: Path | None = None) -> Path:
        """Write the servable checkpoint: model.safetensors + manifest.json."""
        default_tree = {"kind": "dynamic", "expand_width": 4, "max_depth": 5, "verify_budget": 16}
        weights = {"reg_weight": self.cfg.reg_weight, "cls_weight": self.cfg.cls_weight}
        if self.cfg.method == "hass":
            weights.update(
                hass_topk_weight=self.cfg.hass_topk_weight, hass_topk=self.cfg.hass_topk, hass_steps=self.cfg.hass_steps
            )
        if self.cfg.method == "eagle3":
            weights = {"ttt_steps": self.cfg.ttt_steps, "ttt_decay": self.cfg.ttt_decay}
        from eyas.target.loader import TargetFingerprint

        manifest = manifest_for(
            "eagle3" if self.cfg.method == "eagle3" else "eagle1",
            self.drafter,
            TargetFingerprint(**self.fingerprint),
            self.serve_taps,
            tree_abi=TreeABI(default_tree=default_tree),
            loss_weights=weights,
            recipe={"trained_as": self.cfg.method, **summary, "config": json.loads(self.cfg.model_dump_json())},
        )
        return save_drafter(out or self.out, self.drafter, manifest)

    # --- the loop ----------------------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> dict:
        """Train to ``total_steps`` (resuming from a saved state); ``stop_after`` simulates a kill."""
        if self.cfg.schedule == "wsd":
            return self.fit_wsd(stop_after)
        resumed = self.load_state()
        t0, last, skipped = time.perf_counter(), None, 0
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.cfg.method}", dynamic_ncols=True)
        ema = None
        start = None
        if self.cfg.init_from and self.step == 0:
            # a warm start's held-out accuracy before any step: the baseline the summary compares with
            start = self.evaluate()
            bar.write(
                f"warm start {self.cfg.init_from}: held-out top1 {start['top1'][0]:.3f} "
                f"top3 {start['top3'][0]:.3f} per-step top1 {[round(x, 3) for x in start['top1']]}"
            )
        while self.step < self.total_steps:
            if stop_after is not None and self.step >= stop_after:
                self.save_state()
                bar.close()
                return {"stopped_at": self.step}
            stats = self.train_step()
            bar.update(1)
            if stats is None:
                skipped += 1
            else:
                ema = stats.loss if ema is None else 0.95 * ema + 0.05 * stats.loss
                bar.set_postfix(loss=f"{ema:.3f}", lr=f"{self.scheduler.get_last_lr()[0]:.1e}")
            if self.step % self.cfg.eval_every == 0:
                last = self.evaluate()
                bar.write(
                    f"step {self.step}: held-out top1 {last['top1'][0]:.3f} top3 {last['top3'][0]:.3f} "
                    f"per-step top1 {[round(x, 3) for x in last['top1']]}"
                )
            if self.step % self.cfg.checkpoint_every == 0:
                self.save_state()
        bar.close()
        self.save_state()
        final = self.evaluate()
        wall = time.perf_counter() - t0
        tokens = sum(len(fb.input_ids) for fb in self.train_data)
        supervised = sum(int(fb.loss_mask.sum()) for fb in self.train_data)
        summary = {
            "steps": self.step,
            "train_samples": len(self.train_data),
            "train_tokens": tokens,
            "train_supervised_tokens": supervised,
            "epochs": self.cfg.epochs,
            "wall_s": round(wall, 1),
            "resumed": resumed,
            "skipped_steps": skipped,
            "final_loss_ema": ema,
            "heldout": final,
        }
        if start is not None:
            summary["heldout_at_start"] = start
        print(
            f"done: {self.step} steps in {wall:.0f} s; loss {ema if ema is None else round(ema, 4)}; held-out "
            f"top-1 {final['top1'][0]:.3f}, top-3 {final['top3'][0]:.3f}; per-step top-1 "
            f"{[round(x, 3) for x in final['top1']]}"
        )
        return summary

    # --- warmup-stable-decay with decay branches -------------------------------------------------------
    BRANCH_FILE = "branch_state.pt"
    POINTS_FILE = "points.json"
    LOG_FILE = "curve.jsonl"

    def _log(self, record: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / self.LOG_FILE, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _points_done(self) -> dict:
        path = self.out / self.POINTS_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def fit_wsd(self, stop_after: int | None = None) -> dict:
        """The ``wsd`` schedule: warmup, then a constant rate to the last decay point; at each point the
        stable state is saved and a decay branch trains on from it (the next ``decay_fraction`` of the
        steps so far, the rate falling linearly to 0), is evaluated on the held-out split and exported
        to ``out/point-<tokens>``; then the main run resumes from the stable state. Every phase
        checkpoints; a rerun resumes where it stopped (a branch first). ``stop_after``: stop (saving)
        once that many optimizer steps have run in this call, as a kill would."""
        cfg = self.cfg
        points = self.decay_point_steps() if cfg.decay_points else []
        end = points[-1][1] if points else self.total_steps
        seen = self.supervised_tokens_before(end + (math.ceil(cfg.decay_fraction * end) if points else 0))
        t0, ran = time.perf_counter(), 0
        resumed = self.load_state(self.BRANCH_FILE) or self.load_state()
        summaries = self._points_done()
        print(
            f"wsd: {len(points)} decay points {[p for p, _ in points]} (steps {[k for _, k in points]}); "
            f"main run to step {end}; resuming at step {self.step}"
            + (f" in the branch at {self.branch['tokens']}" if self.branch else ""),
            flush=True,
        )

        def run_to(stop: int, phase: str, state_file: str) -> bool:
            nonlocal ran
            bar = tqdm(total=stop, initial=self.step, desc=f"{phase} {cfg.method}", dynamic_ncols=True)
            ema = None
            while self.step < stop:
                if stop_after is not None and ran >= stop_after:
                    self.save_state(state_file)
                    bar.close()
                    return False
                stats = self.train_step()
                ran += 1
                bar.update(1)
                if stats is not None:
                    ema = stats.loss if ema is None else 0.95 * ema + 0.05 * stats.loss
                    bar.set_postfix(
                        loss=f"{ema:.3f}",
                        lr=f"{self.scheduler.get_last_lr()[0]:.1e}",
                        tokens=f"{seen[min(self.step, len(seen) - 1)] / 1e6:.2f}M",
                    )
                if phase == "main" and self.step % cfg.eval_every == 0:
                    last = self.evaluate()
                    self._log(
                        {
                            "phase": "stable",
                            "step": self.step,
                            "supervised_tokens": seen[self.step],
                            "heldout": last,
                            "wall_s": round(time.perf_counter() - t0, 1),
                        }
                    )
                    bar.write(
                        f"step {self.step} ({seen[self.step]} supervised tokens): held-out per-step top1 "
                        f"{[round(x, 3) for x in last['top1']]}"
                    )
                if self.step % cfg.checkpoint_every == 0:
                    self.save_state(state_file)
            bar.close()
            return True

        for tokens, step in points:
            if str(tokens) in summaries:
                continue
            if self.branch is None:  # the main run up to this point, then its stable state
                if not run_to(step, "main", STATE_FILE):
                    return {"stopped_at": self.step}
                self.save_state()
                self.branch = {"tokens": tokens, "start": step, "length": max(1, math.ceil(cfg.decay_fraction * step))}
                self.scheduler.last_epoch = self.step - 1
                self.scheduler.step()  # the branch's own rate from its first step
                self.save_state(self.BRANCH_FILE)
            b = self.branch
            if not run_to(b["start"] + b["length"], f"decay@{tokens}", self.BRANCH_FILE):
                return {"stopped_at": self.step}
            heldout = self.evaluate()
            summary = {
                "supervised_tokens": tokens,
                "stable_steps": b["start"],
                "decay_steps": b["length"],
                "steps": self.step,
                "supervised_tokens_with_decay": seen[min(self.step, len(seen) - 1)],
                "train_samples": len(self.train_data),
                "schedule": "wsd",
                "heldout": heldout,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            path = self.export(summary, self.out / f"point-{tokens}")
            self._log({"phase": "decayed", "step": self.step, **summary})
            summaries[str(tokens)] = {**summary, "drafter": str(path)}
            tmp = self.out / (self.POINTS_FILE + ".tmp")
            tmp.write_text(json.dumps(summaries, indent=1))
            os.replace(tmp, self.out / self.POINTS_FILE)
            print(
                f"point {tokens}: held-out per-step top-1 {[round(x, 3) for x in heldout['top1']]}, "
                f"top-3 {[round(x, 3) for x in heldout['top3']]} -> {path}",
                flush=True,
            )
            (self.out / self.BRANCH_FILE).unlink(missing_ok=True)
            self.branch = None
            self.load_state()  # back to the stable state at this point
        if not points:
            if not run_to(end, "main", STATE_FILE):
                return {"stopped_at": self.step}
            self.save_state()
        final = summaries[str(points[-1][0])] if points else {"heldout": self.evaluate()}
        return {
            "steps": self.step,
            "points": summaries,
            "heldout": final["heldout"],
            "resumed": resumed,
            "wall_s": round(time.perf_counter() - t0, 1),
            "train_samples": len(self.train_data),
            "schedule": "wsd",
        }
