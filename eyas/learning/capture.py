"""What a target replica keeps of the traffic it serves, for the drafter that learns from it.

Terms:

- a **learning session**: a request served by a target worker whose capture is on (a deployment
  switch, off by default) at the learning drafter's feature address, that did not opt out
  (``learn: false``);
- its **sample**: the committed tokens (prompt + answer) and, for every committed row, the features a
  drafter trains on (:func:`eyas.training.features.training_taps`: the EAGLE-3 taps and the LM-head
  input), exactly what ``eyas train`` extracts offline, but computed by the verify forwards that
  served the request (the served taps plus the engine's *capture taps*, in the same pass: no extra
  target forward). The answer rows are supervised, the prompt rows are context only;
- the **buffer**: the samples of closed learning sessions, newest last, bounded in bytes and in age
  (the oldest go first). It owns nothing else; a learner takes samples out of it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from eyas.target.config import FeatureTap
from eyas.target.engine import CommittedRows
from eyas.training.features import FeatureBatch

MIN_ANSWER_ROWS = 2  # a sample needs two answer rows: one a chain reads, one whose distribution it learns


@dataclass(frozen=True)
class CaptureConfig:
    """A target replica's capture: the sessions served at the feature address ``taps`` (the learning
    drafter's: its sessions' prompt rows carry the features that drafter reads), at most
    ``max_bytes`` of samples, none older than ``max_age_s``."""

    taps: tuple[FeatureTap, ...]
    max_bytes: int = 64 << 20
    max_age_s: float = 3600.0

    def __post_init__(self):
        if not self.taps:
            raise ValueError("learn.method: capture needs the learning drafter's feature address (taps)")
        if self.max_bytes <= 0:
            raise ValueError(f"learn.capture_bytes: must be positive, got {self.max_bytes}")
        if self.max_age_s <= 0:
            raise ValueError(f"learn.capture_age_s: must be positive, got {self.max_age_s}")


def sample_of(rows: CommittedRows, train_taps: tuple[FeatureTap, ...], sample_id: str) -> FeatureBatch | None:
    """A learning session's committed rows as a training sample over ``train_taps`` (each tap's
    columns from the served features or the capture, whichever holds it); prompt rows have no capture
    and are zeros there: the learning drafter reads only the served taps of a prompt row (its input),
    the captured ones at answer rows (its teacher). -> None when the answer is too short to learn from.

    The loss mask marks the rows whose chains are supervised: the last prompt row and every answer
    row, so every teacher distribution read is an answer row's (``eyas.training.masks.rollout_valid``)."""
    S, P = rows.tokens.numel(), rows.prompt_len
    if S - P < MIN_ANSWER_ROWS:
        return None
    d = rows.captured.shape[1] // len(rows.capture_taps)  # a learning session's engine captures at least one tap
    assert rows.features.shape[0] == S and rows.captured.shape[0] == S - P, "one feature row per committed row"
    columns = []
    for tap in train_taps:
        if tap in rows.taps:
            k = rows.taps.index(tap)
            columns.append(rows.features[:, k * d : (k + 1) * d])
        elif tap in rows.capture_taps:
            k = rows.capture_taps.index(tap)
            col = rows.captured.new_zeros(S, d)
            col[P:] = rows.captured[:, k * d : (k + 1) * d]
            columns.append(col)
        else:
            raise ValueError(f"learn: the feature tap {tap} is neither served nor captured by this engine")
    loss_mask = torch.zeros(S, dtype=torch.bool)
    loss_mask[P - 1 :] = True
    return FeatureBatch(sample_id, rows.tokens.clone(), loss_mask, torch.cat(columns, dim=1).to(torch.float16))


def sample_bytes(sample: FeatureBatch) -> int:
    return sum(t.numel() * t.element_size() for t in (sample.input_ids, sample.loss_mask, sample.features))


class TrafficBuffer:
    """The samples of closed learning sessions, oldest first, within ``config``'s bytes and age."""

    def __init__(self, config: CaptureConfig):
        self.config = config
        self._items: deque[tuple[float, int, FeatureBatch]] = deque()  # (captured at, bytes, sample)
        self.bytes = 0
        self.samples_in = 0  # every sample ever added
        self.samples_evicted = 0  # dropped for bytes or age before a learner took them
        self.tokens_in = 0  # answer tokens ever added

    def __len__(self) -> int:
        return len(self._items)

    def add(self, sample: FeatureBatch, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        size = sample_bytes(sample)
        if size > self.config.max_bytes:
            self.samples_evicted += 1  # larger than the whole buffer: never kept
            return
        self._items.append((now, size, sample))
        self.bytes += size
        self.samples_in += 1
        self.tokens_in += int(sample.loss_mask.sum()) - 1
        self._evict(now)

    def _evict(self, now: float) -> None:
        while self._items and (self.bytes > self.config.max_bytes or now - self._items[0][0] > self.config.max_age_s):
            _, size, _ = self._items.popleft()
            self.bytes -= size
            self.samples_evicted += 1

    def take(self, max_samples: int | None = None, now: float | None = None) -> list[FeatureBatch]:
        """Remove and return up to ``max_samples`` samples, oldest first (None: all), after evicting
        what has aged out."""
        self._evict(time.monotonic() if now is None else now)
        n = len(self._items) if max_samples is None else min(max_samples, len(self._items))
        out = []
        for _ in range(n):
            _, size, sample = self._items.popleft()
            self.bytes -= size
            out.append(sample)
        return out

    def stats(self) -> dict[str, int]:
        return {
            "samples": len(self._items),
            "bytes": self.bytes,
            "samples_in": self.samples_in,
            "samples_evicted": self.samples_evicted,
            "tokens_in": self.tokens_in,
        }
