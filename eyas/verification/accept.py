"""Target-governed acceptance of a flattened draft tree (seed 0x05C).

Terms:

- **accepted rows**: the flat rows of one root->leaf path prefix that the target accepts. They
  always start with row 0, the root (the frontier token of the previous round, which the verify
  forward has now processed). Their KV and features are what publication commits (seed 0x05D).
- **accepted tokens**: the candidate tokens of the accepted rows after the root.
- **frontier token**: the next token chosen by the target at the last accepted row (a correction
  on rejection, a bonus token when the whole path was accepted). It is emitted at once but it is
  *not* a verified input row: its KV and feature come from the next target forward, where it is
  the root of the next tree (append required).

Greedy acceptance follows the argmax. Stochastic acceptance is exact for deterministically chosen
candidates (top-k from the drafter): at a row with target distribution p, try its children in row
order; accept child c with probability r(c), where r is p with previously rejected children
zeroed and renormalised; if every child is rejected (or the row is a leaf), sample the frontier
from r. Each emitted token is then distributed exactly as p: child c_i is emitted with
probability prod_{j<i}(1 - r_j(c_j)) * r_i(c_i) = p(c_i), and any other token x with probability
(1 - sum_i p(c_i)) * p(x) / (1 - sum_i p(c_i)) = p(x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.verification.flatten import RETRIEVE_PAD, FlatTree

ROOT_ROW: int = 0  # flat row of the root (the previous frontier token); first of every accepted path


@dataclass(frozen=True)
class AcceptDecision:
    accepted_rows: torch.Tensor  # [A] int64 flat rows on one root->leaf path; accepted_rows[0] == ROOT_ROW
    accepted_tokens: torch.Tensor  # int64 accepted candidate tokens = flat.tokens[accepted_rows[1:]]
    frontier_token: int  # target-governed next token; not a verified row, its KV/feature need an append

    def __post_init__(self) -> None:
        for name in ("accepted_rows", "accepted_tokens"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.ndim != 1 or value.dtype != torch.int64:
                raise ValueError(f"{name}: expected a 1-D int64 tensor")
        rows = self.accepted_rows.tolist()
        if not rows or rows[0] != ROOT_ROW:
            raise ValueError(f"accepted_rows: must start with the root row {ROOT_ROW}, got {rows}")
        if any(b <= a for a, b in zip(rows, rows[1:])):
            raise ValueError(f"accepted_rows: a path's rows must increase (parents precede children), got {rows}")
        if self.accepted_tokens.shape[0] != len(rows) - 1:
            raise ValueError(
                f"accepted_tokens: length {self.accepted_tokens.shape[0]} != len(accepted_rows) - 1 = {len(rows) - 1}"
            )
        if type(self.frontier_token) is not int or self.frontier_token < 0:
            raise ValueError(f"frontier_token: expected a nonnegative int, got {self.frontier_token!r}")

    @property
    def accept_length(self) -> int:
        """Number of candidate tokens accepted (root excluded)."""
        return self.accepted_tokens.shape[0]

    @property
    def num_new_tokens(self) -> int:
        """Tokens emitted this round: accepted candidates plus the frontier token."""
        return self.accept_length + 1

    @property
    def emitted_tokens(self) -> list[int]:
        """The output of this round in order: accepted candidates, then the frontier token."""
        return self.accepted_tokens.tolist() + [self.frontier_token]


def _check_target(flat: FlatTree, target: torch.Tensor, name: str) -> None:
    if not isinstance(target, torch.Tensor) or target.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [R, V]")
    if target.shape[0] != flat.num_rows:
        raise ValueError(f"{name}: {target.shape[0]} rows != flat tree rows {flat.num_rows}")
    if not target.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating dtype, got {target.dtype}")
    if int(flat.tokens.max().item()) >= target.shape[1] or int(flat.tokens.min().item()) < 0:
        raise ValueError(f"{name}: flat tree token ids fall outside the vocabulary of size {target.shape[1]}")


def _decision(flat: FlatTree, rows: torch.Tensor, frontier_token: int) -> AcceptDecision:
    rows = rows.to(device=flat.tokens.device, dtype=torch.int64)
    return AcceptDecision(
        accepted_rows=rows,
        accepted_tokens=flat.tokens[rows[1:]],
        frontier_token=frontier_token,
    )


def greedy_accept(
    flat: FlatTree,
    target_logits: torch.Tensor,  # [R, V] float, target logits of every flat row
) -> AcceptDecision:
    """Longest retrieve-map path whose every candidate equals the argmax of its parent row.

    The frontier is the argmax at the last accepted row. Rows, not tokens, identify the path:
    the same token id in two branches is two different rows.

    Worked example: rows [root, A=5, A1=7, B=6, B1=7], retrieve [[0, 1, 2], [0, 3, 4]] and
    argmax per row [6, 9, 9, 7, 3]: path 1 matches 0 candidates (5 != 6), path 2 matches B (6)
    then B1 (7 == argmax of row 3), so accepted_rows = [0, 3, 4], accepted_tokens = [6, 7],
    frontier = argmax of row 4 = 3.
    """
    _check_target(flat, target_logits, "target_logits")
    predicted = target_logits.argmax(dim=1)  # [R] first maximal index on ties
    retrieve = flat.retrieve  # [L, D+1]
    valid = retrieve != RETRIEVE_PAD  # [L, D+1]
    safe = retrieve.clamp(min=0)  # [L, D+1] pads point at the root, masked out by `valid`
    candidates = flat.tokens[safe]  # [L, D+1]
    matches = (candidates[:, 1:] == predicted[safe[:, :-1]]) & valid[:, 1:]  # [L, D]
    match_lengths = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [L]
    best = int(match_lengths.argmax().item())  # first longest path
    length = int(match_lengths[best].item())
    rows = retrieve[best, : length + 1]  # [A]
    return _decision(flat, rows, int(predicted[rows[-1]].item()))


def stochastic_accept(
    flat: FlatTree,
    target_probs: torch.Tensor,  # [R, V] float, the served target distribution of every flat row
    generator: torch.Generator,
) -> AcceptDecision:
    """Exact acceptance of deterministically chosen candidates (module docstring).

    Rows of `target_probs` need not be normalised; they need finite, nonnegative entries and
    positive mass. Uniforms and the frontier draw come from `generator` (on its own device).
    """
    _check_target(flat, target_probs, "target_probs")
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    if not bool(torch.isfinite(target_probs).all()) or bool((target_probs < 0).any()):
        raise ValueError("target_probs: entries must be finite and nonnegative")
    if bool((target_probs.sum(dim=1) <= 0).any()):
        raise ValueError("target_probs: every row needs positive mass")

    children: list[list[int]] = [[] for _ in range(flat.num_rows)]
    for row, parent in enumerate(flat.parents.tolist()[1:], start=1):
        children[parent].append(row)
    tokens = flat.tokens.tolist()

    path = [ROOT_ROW]
    while True:
        row = path[-1]
        accepted_child, residual = _accept_one_child(
            target_probs[row], children[row], [tokens[c] for c in children[row]], generator
        )
        if accepted_child is None:
            frontier = torch.multinomial(residual.to(generator.device), 1, generator=generator)
            return _decision(flat, torch.tensor(path), int(frontier.item()))
        path.append(accepted_child)


def _accept_one_child(
    probs: torch.Tensor,  # [V] target distribution at the current row (any scale, positive mass)
    children: list[int],  # child rows, in row order
    child_tokens: list[int],  # their tokens
    generator: torch.Generator,
) -> tuple[int | None, torch.Tensor]:
    """Try the children in order; return (accepted child row or None, [V] float64 residual).

    With p the row distribution, `outside` the mass of tokens that are no child, and the
    children's masses taken once per distinct token (a repeated token's second occurrence has
    residual mass 0), child i is accepted with probability r_i = p(c_i) / tail_i, where
    tail_i = sum_{j >= i} p(c_j) + outside is the residual mass left after rejecting c_1..c_{i-1}.
    This equals trying each child against p renormalised with rejected children zeroed. The
    residual returned on full rejection is p with every child token zeroed; its mass `outside`
    is positive by construction: if outside == 0 then r_last = p(c_m) / p(c_m) = 1 exactly (or an
    earlier tail already held only one child), so some child is always accepted.
    """
    row = probs.to(torch.float64)  # [V]
    if not children:
        return None, row
    token_index = torch.tensor(child_tokens, device=row.device)
    residual = row.index_fill(0, token_index, 0.0)  # [V] p outside the children
    outside = residual.sum().item()
    masses = row[token_index].tolist()
    seen: set[int] = set()
    for i, token in enumerate(child_tokens):
        if token in seen:
            masses[i] = 0.0
        seen.add(token)
    tails = [0.0] * len(masses)
    tail = outside
    for i in reversed(range(len(masses))):
        tail += masses[i]
        tails[i] = tail
    uniforms = torch.rand(
        len(children), generator=generator, dtype=torch.float64, device=generator.device
    ).tolist()
    for child, mass, tail, u in zip(children, masses, tails, uniforms):
        # tail > 0 here: this child is reached only after a rejection with r < 1, i.e. a
        # positive tail after it (the first tail is the row's positive total).
        assert tail > 0, "residual mass vanished after a rejection"
        if u < mass / tail:
            return child, residual
    return None, residual
