"""The drafter gate of a hybrid request (suffix drafts grafted into a drafter's tree, ``SuffixSide``):
whether its drafter grows a tree this round, decided by what rounds measurably cost and what each
source gets accepted.

Terms.

- A *drafted* round: a hybrid request's drafter grew a tree (its suffix tree grafted into it). A
  *skipped* round: it did not; only the suffix tree (or nothing) was verified, and the drafter reads
  the seeds it missed when it drafts next (one call over the backlog).
- ``e_suffix``: the suffix tree's expected accepted tokens this round (its nodes' path values added,
  known before the drafter is asked: suffix lookups cost no model).
- ``gain``: what a drafter's tree adds to a round, per unit of room the copied span leaves it (``1 -
  first_suffix``): over the drafted rounds, the accepted tokens beyond those the suffix tree alone held
  (all of them where there was none), summed with forgetting, over the room summed the same way
  (started from ``PRIOR_GAIN`` tokens for one unit: EAGLE-3 at tau ~1.7).
- ``round_s``: a round's wall time (propose to the next propose: drafting, the verify of its rows,
  the decision, the publish), predicted for this round's own rows by :class:`RoundCost`, two linear
  models fitted on the loop's recent rounds: a base and a verify row from the rounds less their drafter
  calls, and the drafter call (timed by the loop) with a seed row it reads first (its backlog after
  skipped rounds: the whole prompt in its first drafting round).

The rule, expected tokens a second (each round commits its accepted tokens plus one):

    draft  iff  (1 + e_suffix + (1 - first_suffix) gain) / round_s(drafted: suffix + drafter nodes, backlog)
             >  (1 + e_suffix) / round_s(skipped: suffix nodes)

(``first_suffix``: the chance the copied span's first token is accepted)

so where a drafter round costs more than its tokens are worth (a cheap target: ``gguf`` on a CPU,
where a drafting round costs ~1.8 decodes) the request goes on with its suffix drafts alone, and where
the target is expensive (``fp16w``) it drafts unless the copied span alone is worth more. Until both
kinds have ``MIN_SAMPLES`` timed rounds the old threshold decides (skip when ``e_suffix >=
skip_value``) in a request's first round, and the kinds alternate after it (each timed at a short
backlog); after that a request that
took one kind ``EXPLORE_EVERY`` rounds in a row takes the other once while the two are close
(``EXPLORE_MARGIN``), so that both estimates follow the machine and the request; each such try that
leaves the rule's choice as it was doubles the request's run before the next one (up to
``EXPLORE_MAX``: a tried drafter reads the backlog of the rounds it skipped, the dearest round it has),
and a change of the rule's own choice starts the runs at ``EXPLORE_EVERY`` again; a drafter far from
paying is not tried again, nor one that has not read the request's context yet (its first drafting round
reads the whole prompt: a code edit's 200-700 rows cost 10-30 ms on a CPU, so it is the rule's to take).
The backlog a drafter reads after skipped rounds is paid once, and the drafted rounds after it read their
own seed rows only: a round's worth charges the rows beyond its own seed spread over ``BACKLOG_ROUNDS``
rounds, so that a long run of skipped rounds (a long backlog) does not by itself keep a drafter that pays
round by round from drafting again.
A suffix tree's values are the frequencies of what followed its match, not acceptance rates: the gate
scales ``e_suffix`` and ``first_suffix`` by what the verified suffix trees got accepted against what
they predicted (``DrafterGate.calibrated``).

Pure bookkeeping: numbers in, a decision out. No model, no Ray. One owner (the ``SuffixSide``, or the
``Eyas`` object that lends one to each of its requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DRAFTED, SKIPPED = "drafted", "skipped"
DRAFT_CALL = "draft call"  # RoundCost's sums of the drafter calls' own seconds
MIN_SAMPLES = 8  # timed rounds of each kind before the costs decide
EXPLORE_EVERY = 16  # rounds one kind may run in a row for a request before the other is tried once
# ... and only while the two kinds are this close (a drafted round's worth over a skipped one's between
# this and its inverse): a drafter that reads a backlog of skipped rounds costs the most when it is tried
EXPLORE_MARGIN = 0.75
EXPLORE_MAX = 256  # the run between two tries, doubled after each that left the rule's choice as it was, up to this
FORGET = 0.98  # a timed round's weight in the cost model, multiplied by this each round after it
REFIT_EVERY = 8  # rounds between two fits of the cost model
CALIBRATION_MIN = 2.0  # predicted tokens (forgetting sum) before the suffix trees' calibration is used
PRIOR_DRAFTER_NODES = 4.0  # nodes a drafter tree adds before any is seen
NODES_EMA = 0.3  # how fast the drafter's nodes a round follow its drafted rounds
PRIOR_GAIN = 0.7  # a drafter round's accepted tokens before any is seen (EAGLE-3 at tau ~1.7)
BACKLOG_ROUNDS = EXPLORE_EVERY  # the rounds a backlog's rows (beyond a round's own seed) are charged over


@dataclass(frozen=True, kw_only=True)
class SuffixOffer:
    """What a round's suffix tree offers, known before the drafter is asked."""

    expected: float = 0.0  # expected accepted tokens: its nodes' path values added
    first: float = 0.0  # the chance its first token is accepted: its root children's values added (at most 1)
    nodes: int = 0  # the rows it adds to the verify


def drafted_worth(offer: SuffixOffer, gain: float, drafted_s: float, skipped_s: float) -> float:
    """A drafted round's expected tokens a second over a skipped round's (module docstring): the drafter's
    tree adds ``gain`` tokens per unit of room the copied span leaves it."""
    assert drafted_s > 0 and skipped_s > 0, "round times: positive seconds"
    union = offer.expected + (1.0 - offer.first) * gain
    return ((1.0 + union) / drafted_s) / ((1.0 + offer.expected) / skipped_s)


def drafter_pays(offer: SuffixOffer, gain: float, drafted_s: float, skipped_s: float) -> bool:
    """The gate's rule: whether a drafted round's expected tokens a second beat a skipped round's."""
    return drafted_worth(offer, gain, drafted_s, skipped_s) > 1.0


def _fit(sums: list[tuple[list[float], list[float]]]) -> tuple[float, float]:
    """Least squares of y on x = [1, n] from the summed x x^T and x y (no part of a round saves time:
    negative coefficients are 0; none summed: 0, 0)."""
    if not sums:
        return 0.0, 0.0
    solution = np.linalg.lstsq(
        np.array([sum(col) for col in zip(*(xtx for xtx, _ in sums))]).reshape(2, 2),
        np.array([sum(col) for col in zip(*(xty for _, xty in sums))]),
        rcond=1e-9,
    )[0]
    return max(float(solution[0]), 0.0), max(float(solution[1]), 0.0)


@dataclass(frozen=True, kw_only=True)
class RoundWork:
    """What a round did, as the gate's cost model reads it."""

    drafted: bool  # a drafter grew a tree
    verify_rows: int  # rows the target verified (roots and every tree's nodes)
    context_rows: int = 0  # seed rows the drafter read before it drafted (its backlog); 0 when skipped
    draft_s: float = 0.0  # the drafter call's own seconds, as the loop timed it (0 when skipped)


@dataclass
class RoundCost:
    """A round's seconds as ``base + per_row * verify_rows`` plus, in a drafted round, the drafter call's
    ``drafting + per_context_row * context_rows`` (the rows as :class:`RoundWork` counts them). The two
    are fitted apart by least squares, so that neither is read into the other: the round's seconds less
    its drafter call's (timed by the loop) over every round, the drafter call's over the drafted rounds.
    A timed round's weight is multiplied by ``FORGET`` for each later round of its kind (a drafter skipped
    for long keeps what its rounds cost). A skipped round with a 6-node suffix tree costs more than one
    with none; a drafter's first round reads the whole prompt."""

    # kind -> the weighted sums x x^T (row-major) and x y of its rounds: the round less its drafter call
    # over x = [1, verify_rows]; DRAFT_CALL: the drafter call over x = [1, context_rows]. Plain floats: a
    # round's update is a few microseconds where numpy's small arrays cost tens after a forward
    sums: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    coef: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # (base, drafting, per verify row, per context row), seconds
    unfitted: int = 0  # rounds observed since the last fit

    def observe(self, work: RoundWork, seconds: float) -> None:
        kind = DRAFTED if work.drafted else SKIPPED
        self._add(kind, (1.0, float(work.verify_rows)), seconds - work.draft_s)
        if work.drafted:
            self._add(DRAFT_CALL, (1.0, float(work.context_rows)), work.draft_s)
        self.unfitted += 1
        if self.unfitted < REFIT_EVERY and any(self.coef):  # a fit costs more than a round's bookkeeping
            return
        self.unfitted = 0
        base, row = _fit([v for k, v in self.sums.items() if k != DRAFT_CALL])
        drafting, context = _fit([self.sums[DRAFT_CALL]] if DRAFT_CALL in self.sums else [])
        self.coef = (base, drafting, row, context)

    def _add(self, key: str, x: tuple[float, float], y: float) -> None:
        xtx, xty = self.sums.get(key, ((0.0,) * 4, (0.0,) * 2))
        self.sums[key] = (
            [FORGET * s + a * b for s, (a, b) in zip(xtx, ((a, b) for a in x for b in x))],
            [FORGET * s + a * y for s, a in zip(xty, x)],
        )

    def predict(self, work: RoundWork) -> float:
        base, drafting, row, context = self.coef
        return base + row * work.verify_rows + (drafting + context * work.context_rows if work.drafted else 0.0)


@dataclass
class DrafterGate:
    """The gate's estimates (module docstring) and its per-request state."""

    skip_value: float = 1.0  # the rule before the costs are known: skip when e_suffix reaches it
    cost: RoundCost = field(default_factory=RoundCost)
    samples: dict[str, int] = field(default_factory=lambda: {DRAFTED: 0, SKIPPED: 0})
    drafter_nodes: float = PRIOR_DRAFTER_NODES  # EMA of the nodes a drafter tree adds to a round
    # forgetting sums over drafted rounds of (tokens the drafter added, room the copied span left it)
    gain_sums: list[float] = field(default_factory=lambda: [PRIOR_GAIN, 1.0])
    streak: dict[str, tuple[str, int]] = field(default_factory=dict)  # request id -> (kind, rounds in a row)
    # request id -> (the rule's own last choice, the run after which the other kind is tried next)
    explore: dict[str, tuple[str, int]] = field(default_factory=dict)
    drafted_once: set[str] = field(default_factory=set)  # requests whose drafter has read their context
    decisions: dict[str, int] = field(default_factory=lambda: {DRAFTED: 0, SKIPPED: 0})
    # the suffix trees' calibration: forgetting sums of (predicted, accepted) tokens and of (predicted,
    # accepted) first tokens over the rounds that verified one (a suffix tree's values are frequencies of
    # what followed the match, not acceptance rates)
    suffix_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])

    def calibrated(self, offer: SuffixOffer) -> SuffixOffer:
        """``offer`` with its values scaled by what suffix trees' values got accepted so far (as they are
        until a few rounds are seen)."""
        pe, ae, pf, af = self.suffix_sums
        if pe < CALIBRATION_MIN or pf < CALIBRATION_MIN:
            return offer
        return SuffixOffer(expected=offer.expected * ae / pe, first=min(offer.first * af / pf, 1.0), nodes=offer.nodes)

    def observe_suffix(self, offer: SuffixOffer, accepted: int) -> None:
        """A verified suffix tree's offer (uncalibrated) and how many of its tokens got accepted
        (``eyas.drafting.suffix.accepted_depth``)."""
        update = (offer.expected, float(accepted), offer.first, float(accepted >= 1))
        self.suffix_sums = [FORGET * old + new for old, new in zip(self.suffix_sums, update)]

    @property
    def warm(self) -> bool:
        return min(self.samples.values()) >= MIN_SAMPLES

    def worth(self, offer: SuffixOffer, context_rows: int, fresh_rows: int | None = None) -> float | None:
        """A drafted round's expected tokens a second over a skipped one's now (None until both kinds are
        timed): ``offer`` the round's suffix tree's, ``context_rows`` the seed rows the drafter would
        read first (its backlog), ``fresh_rows`` those of them this round's own seed holds (None: all):
        the rest are charged over ``BACKLOG_ROUNDS`` rounds (module docstring)."""
        if not self.warm:
            return None
        if fresh_rows is not None and context_rows > fresh_rows:
            context_rows = fresh_rows + (context_rows - fresh_rows) / BACKLOG_ROUNDS
        offer = self.calibrated(offer)
        skipped = self.cost.predict(RoundWork(drafted=False, verify_rows=1 + offer.nodes))
        drafted = self.cost.predict(
            RoundWork(drafted=True, verify_rows=1 + offer.nodes + round(self.drafter_nodes), context_rows=context_rows)
        )
        if not (skipped > 0 and drafted > 0):
            return None
        return drafted_worth(offer, self.gain, drafted, skipped)

    @property
    def gain(self) -> float:
        return self.gain_sums[0] / self.gain_sums[1]

    def should_draft(
        self, request_id: str, offer: SuffixOffer = SuffixOffer(), context_rows: int = 0, fresh_rows: int | None = None
    ) -> bool:
        """This round's decision for ``request_id`` (counted, and its streak advanced); the rows as :meth:`worth`
        reads them."""
        worth = self.worth(offer, context_rows, fresh_rows)
        if worth is None:
            draft, close = offer.expected < self.skip_value, True
        else:
            draft, close = worth > 1.0, EXPLORE_MARGIN < worth < 1.0 / EXPLORE_MARGIN
        kind = DRAFTED if draft else SKIPPED
        last, run = self.streak.get(request_id, (kind, 0))
        ruled, every = self.explore.get(request_id, (kind, EXPLORE_EVERY))
        if ruled != kind:  # the rule changed its mind: tries come at the first interval again
            every = EXPLORE_EVERY
        self.explore[request_id] = (kind, every)
        if not self.warm and run:  # warming up: the kinds alternate, so that each is timed at a short backlog
            kind = SKIPPED if last == DRAFTED else DRAFTED
        elif close and last == kind and run >= every and (kind == DRAFTED or request_id in self.drafted_once):
            # the other kind once; the next try twice as far
            self.explore[request_id] = (kind, min(2 * every, EXPLORE_MAX))
            kind = SKIPPED if kind == DRAFTED else DRAFTED
        run = run + 1 if kind == last else 1
        self.streak[request_id] = (kind, run)
        self.decisions[kind] += 1
        if kind == DRAFTED:
            self.drafted_once.add(request_id)
        return kind == DRAFTED

    def observe_round(self, work: RoundWork, seconds: float) -> None:
        """A round's wall time and what it did."""
        self.cost.observe(work, seconds)
        self.samples[DRAFTED if work.drafted else SKIPPED] += 1

    def observe_drafted(self, nodes: int, added: int, room: float) -> None:
        """A drafted round: its drafter tree's ``nodes``, the accepted tokens it ``added`` beyond what
        the suffix tree alone held, and the ``room`` the suffix tree left it (1 - its calibrated first-
        token chance; 1 with no suffix tree)."""
        self.drafter_nodes += NODES_EMA * (nodes - self.drafter_nodes)
        self.gain_sums = [FORGET * self.gain_sums[0] + added, FORGET * self.gain_sums[1] + room]

    def forget(self, request_id: str) -> None:
        self.streak.pop(request_id, None)
        self.explore.pop(request_id, None)
        self.drafted_once.discard(request_id)

    def stats(self) -> dict:
        """Rounds decided each way, the cost model (ms: a round's base, a drafter's, a verify row's, a
        drafter context row's), the drafter's gain and nodes, and the suffix trees' calibration."""
        base, drafting, row, context = (round(1000 * c, 4) for c in self.cost.coef)
        return {
            "rounds": dict(self.decisions),
            "cost_ms": {"base": base, "drafting": drafting, "verify_row": row, "context_row": context},
            "drafter_gain": round(self.gain, 3),
            "drafter_nodes": round(self.drafter_nodes, 2),
            "suffix_calibration": {
                "expected": round(self.suffix_sums[1] / self.suffix_sums[0], 3) if self.suffix_sums[0] else None,
                "first": round(self.suffix_sums[3] / self.suffix_sums[2], 3) if self.suffix_sums[2] else None,
            },
        }
