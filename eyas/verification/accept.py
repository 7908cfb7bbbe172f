"""Target-governed acceptance of a flattened draft tree (design 0x05C).

Terms:

- **accepted rows**: the flat rows of one root->leaf path prefix that the target accepts. They
  always start with row 0, the root (the frontier token of the previous round, which the verify
  forward has now processed). Their KV and features are what publication commits (design 0x05D).
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

import math
from typing import TYPE_CHECKING

import torch

from eyas.protocol.messages import ROOT_ROW, AcceptDecision
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import RETRIEVE_PAD, FlatTree
from eyas.verification.processors import processed_logits
from eyas.verification.sampling import sample, target_probs

if TYPE_CHECKING:  # the type only: verification imports nothing of the target
    from eyas.target.engine import Verified


def _check_target(flat: FlatTree, target: torch.Tensor, name: str) -> None:
    if not isinstance(target, torch.Tensor) or target.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [R, V]")
    if target.shape[0] != flat.num_rows:
        raise ValueError(f"{name}: {target.shape[0]} rows != flat tree rows {flat.num_rows}")
    if not target.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating dtype, got {target.dtype}")
    lowest, highest = torch.aminmax(flat.tokens)
    if int(highest) >= target.shape[1] or int(lowest) < 0:
        raise ValueError(f"{name}: flat tree token ids fall outside the vocabulary of size {target.shape[1]}")


def greedy_accept(
    flat: FlatTree,
    target_logits: torch.Tensor,  # [R, V] float, target logits of every flat row
    argmax: torch.Tensor | None = None,  # [R] int64: the argmax of each row of target_logits, if known
) -> AcceptDecision:
    """Longest retrieve-map path whose every candidate equals the argmax of its parent row.

    The frontier is the argmax at the last accepted row. Rows, not tokens, identify the path:
    the same token id in two branches is two different rows. ``argmax``: the rows' argmax as the
    head's kernel found it (torch.argmax's choice: the first maximal index), else computed here.

    Worked example: rows [root, A=5, A1=7, B=6, B1=7], retrieve [[0, 1, 2], [0, 3, 4]] and
    argmax per row [6, 9, 9, 7, 3]: path 1 matches 0 candidates (5 != 6), path 2 matches B (6)
    then B1 (7 == argmax of row 3), so accepted_rows = [0, 3, 4], accepted_tokens = [6, 7],
    frontier = argmax of row 4 = 3.
    """
    _check_target(flat, target_logits, "target_logits")
    if argmax is not None and tuple(argmax.shape) != (flat.num_rows,):
        raise ValueError(f"argmax: shape {tuple(argmax.shape)} != ({flat.num_rows},)")
    # a tree is a few rows: its walk runs over Python lists (a dozen tensor ops on a handful of
    # elements cost more than the walk)
    tokens = flat.tokens.tolist()  # [R]
    predicted = (target_logits.argmax(dim=1) if argmax is None else argmax).tolist()  # [R] first maximal index on ties
    best, length = [0], 0
    for path in flat.retrieve.tolist():  # [L][D+1], RETRIEVE_PAD after a path's end
        n = 0
        while n + 1 < len(path) and path[n + 1] != RETRIEVE_PAD and tokens[path[n + 1]] == predicted[path[n]]:
            n += 1
        if n > length:  # the first longest path
            best, length = path, n
    rows = best[: length + 1]  # [A] flat rows, built once as tensors (an index op a field costs more)
    device = flat.tokens.device
    return AcceptDecision(
        accepted_rows=torch.tensor(rows, dtype=torch.int64, device=device),
        accepted_tokens=torch.tensor([tokens[r] for r in rows[1:]], dtype=torch.int64, device=device),
        frontier_token=predicted[rows[-1]],
    )


def stochastic_accept(
    flat: FlatTree,
    target_probs: torch.Tensor,  # [R, V] float, the served target distribution of every flat row
    generator: torch.Generator,
) -> AcceptDecision:
    """Exact acceptance of deterministically chosen candidates (module docstring).

    Implementation: at a row with distribution p (row of `target_probs`, any positive scale),
    children c_1..c_m in row order, and `outside` = mass of p on tokens that are no child,
    child c_i is accepted with probability r_i = p(c_i) / tail_i, where
    tail_i = sum_{j >= i} p(c_j) + outside is the residual mass left after c_1..c_{i-1} were
    rejected -- the same as testing against p renormalised with rejected children zeroed. A
    repeated sibling token counts its mass once (its second occurrence has residual mass 0). On
    full rejection the frontier is sampled from p with every child token zeroed.

    The residual is never empty, by construction: if outside == 0, the last child with positive
    mass has r = p(c) / p(c) = 1 exactly and u < 1, so it is always accepted.

    Each child row draws its own uniform from `generator`; the frontier draw uses it too (a
    generator on another device than `target_probs` gets the residual moved to it).
    """
    _check_target(flat, target_probs, "target_probs")
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    if not float(target_probs.min()) >= 0:  # also catches NaN
        raise ValueError("target_probs: entries must be finite and nonnegative")

    num_rows = flat.num_rows
    parents = flat.parents.tolist()
    tokens = flat.tokens.tolist()
    children: list[list[int]] = [[] for _ in range(num_rows)]
    for row in range(1, num_rows):
        children[parents[row]].append(row)

    child_parents, child_tokens = flat.parents[1:], flat.tokens[1:]  # each
    # mass[c]: the mass of row c's token under its parent row's distribution.
    mass = [0.0] + target_probs[child_parents, child_tokens].tolist()  # [R]
    # residual[r]: row r of p with its children's tokens zeroed; outside[r]: its mass.
    residual = target_probs.clone()  # [R, V]
    residual[child_parents, child_tokens] = 0.0
    outside = residual.sum(dim=1).tolist()  # [R]
    # Entries are nonnegative, so a row holds inf or NaN iff its outside or a child mass does.
    if not all(map(math.isfinite, mass)) or not all(map(math.isfinite, outside)):
        raise ValueError("target_probs: entries must be finite and nonnegative")
    row_mass = list(outside)
    for row in range(1, num_rows):
        row_mass[parents[row]] += mass[row]
    if min(row_mass) <= 0:
        raise ValueError("target_probs: every row needs positive mass")
    uniforms = torch.rand(num_rows, generator=generator, dtype=torch.float64, device=generator.device).tolist()

    path = [ROOT_ROW]
    while True:
        row = path[-1]
        accepted = _accept_child(children[row], [tokens[c] for c in children[row]], mass, outside[row], uniforms)
        if accepted is None:
            frontier = torch.multinomial(residual[row].to(generator.device), 1, generator=generator)
            return AcceptDecision(
                accepted_rows=torch.tensor(path, dtype=torch.int64, device=flat.tokens.device),
                accepted_tokens=torch.tensor(
                    [tokens[r] for r in path[1:]], dtype=torch.int64, device=flat.tokens.device
                ),
                frontier_token=int(frontier.item()),
            )
        path.append(accepted)


def _accept_child(
    children: list[int],  # child rows of the current row, in row order
    child_tokens: list[int],  # their tokens
    mass: list[float],  # [R] mass of each row's token under its parent's distribution
    outside: float,  # mass of the current row's distribution on tokens that are no child
    uniforms: list[float],  # [R] one U[0, 1) draw per row, used by that row as a child
) -> int | None:
    """The first accepted child row, or None when all are rejected (see stochastic_accept)."""
    masses = []
    seen: set[int] = set()
    for child, token in zip(children, child_tokens):
        # A repeated sibling token was zeroed by its first occurrence's rejection.
        masses.append(0.0 if token in seen else mass[child])
        seen.add(token)
    tails = []
    tail = outside
    for m in reversed(masses):
        tail += m
        tails.append(tail)
    tails.reverse()
    for child, m, tail in zip(children, masses, tails):
        # tail > 0: a child is reached only after a rejection with r < 1, which leaves a
        # positive tail (and the first tail is the row's positive total mass).
        assert tail > 0, "residual mass vanished after a rejection"
        if uniforms[child] < m / tail:
            return child
    return None


def decide(
    v: Verified,
    prompt_ids: list[int],
    sampling: SamplingParams,
    generator: torch.Generator,
    output_ids: list[int] = (),
    allowed: torch.Tensor | None = None,
) -> AcceptDecision:
    """The accept step: a pure function of the verified rows (design 0x05C). A prefill accepts every
    prompt row and draws the frontier from the last row; a verify accepts greedily or by the
    stochastic rule below, over the logits as the request's processors leave them, each row under
    its own path's history (``processors.processed_logits``; ``output_ids``: the committed answer so
    far, the previous frontier excluded; ``allowed``: each row's structured-output grammar mask,
    ``int32 [R, W]``, from the request's ``GrammarCursor``)."""
    if v.flat is None:  # prefill: every prompt row is accepted, the frontier comes from the last
        rows = torch.arange(len(prompt_ids), dtype=torch.int64)
        accepted = torch.tensor(prompt_ids[1:], dtype=torch.int64)
        raw = v.logits[-1:]
        last = processed_logits(raw, None, prompt_ids, [], sampling, allowed)  # [1, V]
        if sampling.greedy:
            frontier = int(v.argmax[-1] if last is raw and v.argmax is not None else last[0].argmax())
        else:
            frontier = int(sample(target_probs(last, sampling)[0], generator))
        return AcceptDecision(rows, accepted, frontier)
    logits = processed_logits(v.logits, v.flat, prompt_ids, list(output_ids), sampling, allowed)  # [R, V]
    if sampling.greedy:  # the head's own argmax while the logits are as it wrote them
        return greedy_accept(v.flat, logits, v.argmax if logits is v.logits else None)
    return stochastic_accept(v.flat, target_probs(logits, sampling), generator)


def emitted_logprobs(
    logits: torch.Tensor, decision: AcceptDecision, prefill: bool, top: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Each token a round emits, with its log-probability under the target's raw distribution at the
    row that emitted it (log-softmax of the logits: before temperature and top-k/top-p, as vLLM's
    default ``raw_logprobs`` reports), and the ``top`` most likely tokens there with theirs.

    logits: the round's [R, V] (a prefill's: [1, V], its last prompt row). Emitted token i of a verify
    is ``accepted_tokens[i]`` (then the frontier), drawn from row ``accepted_rows[i]``: a verify row's
    logits are its one-row decode's, so speculation does not change a logprob. -> one
    ``(logprob, ((token, logprob), ...))`` per emitted token, in order."""
    rows = [logits.shape[0] - 1] if prefill else decision.accepted_rows.tolist()
    tokens = ([] if prefill else decision.accepted_tokens.tolist()) + [decision.frontier_token]
    lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [A, V]
    chosen = lp[torch.arange(len(rows)), torch.tensor(tokens)].tolist()
    if top:
        values, ids = lp.topk(top, dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(rows)
    return list(zip(chosen, alternatives))
