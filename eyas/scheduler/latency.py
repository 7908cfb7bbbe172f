"""The target's verify latency as a function of the total rows in a batch, measured and kept current.

``LatencyCurve`` holds (rows, ms) knots, interpolates linearly between them, and extrapolates past
the last knot with the last segment's slope (at least flat). It is measured at start-up on the
machine that serves (:func:`measure_curve`, given a function that runs a verify of R rows) and updated
from live rounds (:meth:`LatencyCurve.observe`: most of a round's error scales the whole curve, the
rest goes, as an exponential moving average, into the two knots around the observed row count,
weighted by distance).

Pure: no model, no Ray.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64)
EMA_WEIGHT = 0.2
# of a live round's error, the share that scales every knot (the machine got faster or slower at every row
# count: a shared host's speed moves by tens of percent between minutes); the rest goes into the knots
# around the observed row count (the curve's shape, measured at start-up, changes only where rounds
# land). Without it, a loop that decodes plainly moves only its 1-row knot, and the marginal cost of a
# tree, read off knots measured at start-up, stays whatever that minute's speed made it.
LEVEL_SHARE = 0.8


@dataclass
class LatencyCurve:
    rows: list[int]  # increasing knot positions (total verify rows in a batch)
    ms: list[float]  # latency at each knot
    observations: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)  # the newest live observations

    def __post_init__(self):
        if not self.rows or len(self.rows) != len(self.ms):
            raise ValueError("latency_curve: rows and ms must be non-empty and of equal length")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])) or self.rows[0] < 1:
            raise ValueError(f"latency_curve.rows: {self.rows} must increase from >= 1")
        if any(not (m > 0) for m in self.ms):
            raise ValueError(f"latency_curve.ms: {self.ms} must be positive")

    @classmethod
    def from_points(cls, points: dict[int, float]) -> LatencyCurve:
        keys = sorted(points)
        return cls(keys, [float(points[k]) for k in keys])

    def predict(self, rows: int) -> float:
        """Milliseconds for a verify of ``rows`` total rows (>= 1)."""
        if rows <= self.rows[0]:
            return self.ms[0]
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.ms[i]
        if i >= len(self.rows):  # past the last knot: the last slope, never decreasing
            if len(self.rows) == 1:
                return self.ms[0]
            slope = max((self.ms[-1] - self.ms[-2]) / (self.rows[-1] - self.rows[-2]), 0.0)
            return self.ms[-1] + slope * (rows - self.rows[-1])
        r0, r1, m0, m1 = self.rows[i - 1], self.rows[i], self.ms[i - 1], self.ms[i]
        return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)

    def marginal_ms(self, rows: int, extra: int) -> float:
        return self.predict(rows + extra) - self.predict(rows)

    def observe(self, rows: int, ms: float, weight: float = EMA_WEIGHT) -> None:
        """Fold a live round's (rows, ms) into the knots around ``rows``."""
        if rows < 1 or not ms > 0:
            return
        self.observations += 1
        self.history = (self.history + [(rows, ms)])[-256:]
        predicted = self.predict(rows)
        scale = 1.0 + weight * LEVEL_SHARE * (ms - predicted) / predicted
        self.ms = [max(m * scale, 1e-6) for m in self.ms]  # the whole curve follows the machine's speed
        weight *= 1.0 - LEVEL_SHARE
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            self.ms[i] += weight * (ms - self.ms[i])
            return
        if i == 0 or i >= len(self.rows):
            j = 0 if i == 0 else len(self.rows) - 1
            self.ms[j] += weight * (ms - self.predict(rows))  # shift the end knot by the error
            self.ms[j] = max(self.ms[j], 1e-6)
            return
        err = ms - self.predict(rows)
        r0, r1 = self.rows[i - 1], self.rows[i]
        t = (rows - r0) / (r1 - r0)
        self.ms[i - 1] = max(self.ms[i - 1] + weight * (1 - t) * err, 1e-6)
        self.ms[i] = max(self.ms[i] + weight * t * err, 1e-6)

    def copy(self) -> LatencyCurve:
        return LatencyCurve(list(self.rows), list(self.ms), self.observations, list(self.history))

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "ms": [round(m, 4) for m in self.ms], "observations": self.observations}


def measure_curve(
    run_rows: Callable[[int], float | None], rows: tuple[int, ...] = DEFAULT_ROWS, repeats: int = 5, warmup: int = 1
) -> LatencyCurve:
    """Time ``run_rows(R)`` (one verify forward of R total rows) ``repeats`` times per R; the median.

    ``run_rows`` may return the seconds of its timed part itself (when it also has set-up to do, such
    as a prefill that must not count); otherwise its whole call is timed."""
    points = {}
    for r in rows:
        for _ in range(warmup):
            run_rows(r)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            timed = run_rows(r)
            samples.append(1000 * (timed if timed is not None else time.perf_counter() - t0))
        points[r] = statistics.median(samples)
    return LatencyCurve.from_points(points)


DRAFT_HISTORY = 64


@dataclass
class DraftCost:
    """What drafting adds to a round, in milliseconds: ``base_ms + per_depth_ms * D + per_row_ms * R``
    for a round whose deepest tree has depth ``D`` and that packs ``R`` drafter rows in all (summed
    over the drafting requests: the context rows of their unread seeds plus their trees'
    :attr:`TreeShape.draft_rows`); a round where nobody drafts pays nothing.

    The drafter grows all of a round's trees together, one packed drafter forward per depth, so the
    cost has a part per depth (the forward's fixed cost and the hop) and a part per row (the rows
    packed into those forwards: many drafting requests cost more than one). ``per_row_ms`` is a
    device constant measured at start-up (:meth:`from_points`, from rounds of one and of several
    requests at the same depth); ``base_ms`` and ``per_depth_ms`` are refitted by least squares over
    the newest live rounds (:meth:`observe`) after the per-row part is taken out. With rounds at one
    depth only, the whole rest is put on ``per_depth_ms``. Until the first observation the cost is
    ``prior_ms_per_depth`` per depth (0 by default: optimistic, so that the policy tries a tree and
    learns what it costs).

    Worked example: with ``per_row_ms = 0.5``, rounds at depth 2 with 4 rows costing 32 ms and at
    depth 4 with 12 rows costing 56 ms fit ``base_ms = 10, per_depth_ms = 10``, so a depth-5 round
    with 16 rows is predicted at 10 + 50 + 8 = 68 ms.

    Pure: no model, no Ray.
    """

    prior_ms_per_depth: float = 0.0
    per_row_ms: float = 0.0
    base_ms: float = 0.0
    per_depth_ms: float = 0.0
    history: list[tuple[int, int, float]] = field(default_factory=list)  # (deepest depth, draft rows, ms), newest last

    def __post_init__(self):
        for name in ("prior_ms_per_depth", "per_row_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"draft_cost.{name}: {getattr(self, name)} must be >= 0")
        if not self.history:
            self.per_depth_ms = self.prior_ms_per_depth

    @classmethod
    def from_points(cls, points: list[tuple[int, int, float]]) -> DraftCost:
        """A cost measured at start-up (:meth:`DrafterEngine.measure_cost`: ``(depth, draft rows, ms)``).

        ``per_row_ms`` is the least-squares slope of ms over rows among points of the same depth
        (0 when no depth was measured at two row counts); the points then seed the live fit as if
        they were rounds, and live rounds push them out of the history.

        Worked example: ``[(1, 0, 20.0), (3, 8, 44.0), (5, 16, 68.0), (5, 64, 92.0)]``: at depth 5,
        48 more rows cost 24 ms more, so ``per_row_ms = 0.5``; without the rows' part the points are
        20, 40, 60, 60 ms at depths 1, 3, 5, 5, which fit ``base_ms = 10, per_depth_ms = 10``."""
        for p in points:
            depth, rows, ms = p
            if not (type(depth) is int and depth >= 1 and type(rows) is int and rows >= 0 and ms >= 0):
                raise ValueError(f"draft_cost.points: {p!r} is not a (depth >= 1, rows >= 0, ms >= 0) measurement")
        slopes = []
        for depth in sorted({d for d, _, _ in points}):
            same = [(r, m) for d, r, m in points if d == depth]
            mr = sum(r for r, _ in same) / len(same)
            srr = sum((r - mr) ** 2 for r, _ in same)
            if srr > 0:
                mm = sum(m for _, m in same) / len(same)
                slopes.append(sum((r - mr) * (m - mm) for r, m in same) / srr)
        cost = cls(per_row_ms=max(sum(slopes) / len(slopes), 0.0) if slopes else 0.0)
        for depth, rows, ms in points:
            cost.observe(depth, ms, rows)
        return cost

    def predict(self, depth: int, rows: int = 0) -> float:
        """Milliseconds a round pays for drafting trees of at most ``depth`` that write ``rows``
        draft rows in all (depth 0: nobody drafts, nothing to pay)."""
        if depth <= 0:
            return 0.0
        return max(self.base_ms + self.per_depth_ms * depth, 0.0) + self.per_row_ms * max(rows, 0)

    def observe(self, depth: int, ms: float, rows: int = 0) -> None:
        if depth <= 0 or not ms >= 0:
            return
        self.history = (self.history + [(depth, int(rows), float(ms))])[-DRAFT_HISTORY:]
        pts = [(d, m - self.per_row_ms * r) for d, r, m in self.history]  # the part per depth
        n = len(pts)
        mx = sum(d for d, _ in pts) / n
        my = sum(m for _, m in pts) / n
        sxx = sum((d - mx) ** 2 for d, _ in pts)
        if sxx > 0:
            slope = sum((d - mx) * (m - my) for d, m in pts) / sxx
            if slope >= 0 and my - slope * mx >= 0:
                self.per_depth_ms, self.base_ms = slope, my - slope * mx
                return
        # one depth seen (or a fit out of bounds): all of it per depth
        self.per_depth_ms, self.base_ms = max(my, 0.0) / mx, 0.0

    def to_dict(self) -> dict:
        return {
            "base_ms": round(self.base_ms, 3),
            "per_depth_ms": round(self.per_depth_ms, 3),
            "per_row_ms": round(self.per_row_ms, 4),
            "observations": len(self.history),
        }
