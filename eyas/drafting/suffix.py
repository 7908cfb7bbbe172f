"""Suffix drafts: candidate continuations from text the request has already seen (its prompt and its
answer so far), found by suffix matching as SuffixDecoding does (Oliaro et al., arXiv 2411.04975),
and grafted into a drafter's tree (:func:`graft`). No model runs: a draft costs a dictionary lookup.

Terms:

- **history**: the request's tokens in order, its prompt and its answer, the frontier (the tree's
  root token) last.
- **match**: the longest suffix of the history, of ``min_match`` to ``max_match`` tokens, that also
  ended earlier in the history; its **occurrences** are those earlier ends (the newest
  ``max_occurrences``).
- **continuation tree**: the trie of the tokens that followed each occurrence, up to ``max_depth``.
  A node's **score** is the fraction of its parent's occurrences that go on with its token
  (SuffixDecoding's frequency score; the tree's ``draft_probs``, as a drafter's conditional
  confidences); its **path value** is the product of the scores from the root, an estimate of the
  chance that the target accepts the whole path.
- The tree keeps the ``budget`` nodes of highest path value, each at least ``min_value``; a node's
  value never exceeds its parent's, so the kept set holds every kept node's ancestors.
- A match of n tokens draws at most ``max_spec_factor * n`` candidates, no deeper than that
  (SuffixDecoding's adaptive speculation length): a frequency score says nothing of a 2-token
  match's reliability (one occurrence scores 1 all the way down), its length does. A match as long
  as ``max_match`` is measured on backwards past it, up to the length that still moves the bound.

A serving loop (and an in-process ``Eyas``) also keeps a :class:`SharedSuffixCache` of recent
answers (SuffixDecoding's global tree): a request's match is looked up in its own history and in the
answers other requests of the app gave before, and the continuation tree with the larger expected
accepted tokens is drafted. The cache is bounded in tokens (the oldest answer evicted first) and holds
only answers whose request allows it to be kept (``learn``); the app has one API key, so its callers
share one cache.

Pure functions and two small owners (:class:`SuffixIndex`, one per request; :class:`SharedSuffixCache`,
one per serving loop); no Ray, no torch compute.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

import torch

from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree


@dataclass(frozen=True, kw_only=True)
class SuffixSpec:
    """How suffix candidates are drawn (module docstring)."""

    max_depth: int = 12  # the deepest candidate (a copied span may run past a drafter's depth)
    # candidate rows at most (12 / 12 rather than 6 / 8 since a gguf verify row got cheaper: one process, arms
    # alternating, code edits 1.88x vs 1.84x target-only, documents 1.68x vs 1.65x; docs/benchmarks.md)
    budget: int = 12
    # a tree holds at most this many candidates (and is at most as deep) per token of its match:
    # a short match copies a short span, a long one a long span (SuffixDecoding's max_spec_factor)
    max_spec_factor: float = 1.0
    min_value: float = 0.3  # a candidate's path value at least this
    min_match: int = 2  # tokens of the shortest suffix that counts as a match
    max_match: int = 12  # tokens of the longest suffix looked up
    max_occurrences: int = 32  # the newest earlier occurrences of the match read
    # grafted (hybrid), until the gate has timed both kinds of round (eyas.scheduler.gate): when the
    # suffix tree's expected accepted tokens (its nodes' path values added) reach this, the drafter
    # grows no tree that round: the copied span is likely enough that the drafter's steps and rows
    # would cost more than they could add
    drafter_skip_value: float = 1.0

    def __post_init__(self):
        for name in ("max_depth", "budget", "min_match", "max_match", "max_occurrences"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"suffix.{name}: must be a positive int, got {getattr(self, name)!r}")
        if self.min_match > self.max_match:
            raise ValueError(f"suffix.min_match: {self.min_match} exceeds max_match {self.max_match}")
        if not 0.0 <= self.min_value <= 1.0:
            raise ValueError(f"suffix.min_value: a path value in [0, 1], got {self.min_value!r}")
        factor = self.max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"suffix.max_spec_factor: a positive number, got {factor!r}")

    def row_limit(self, match_length: int) -> int:
        """The candidates (and depth) a tree drawn from a match of ``match_length`` tokens may have."""
        return max(1, min(self.budget, int(self.max_spec_factor * match_length)))

    @property
    def match_reach(self) -> int:
        """The longest match whose length still moves :meth:`row_limit` (a match is measured up to it)."""
        return max(self.max_match, math.ceil(self.budget / self.max_spec_factor))


def matched_length(a: list[int], a_end: int, b: list[int], b_end: int, n: int, limit: int) -> int:
    """How many tokens ending at ``a[a_end]`` and at ``b[b_end]`` agree, counted backwards from the ``n``
    already known to agree, up to ``limit``."""
    while n < limit and a_end - n >= 0 and b_end - n >= 0 and a[a_end - n] == b[b_end - n]:
        n += 1
    return n


class SuffixIndex:
    """One request's history and, for every n-gram of it (n <= ``max_match``), where it ended. Owned
    by the loop side that drafts for the request; grows by :meth:`extend` only."""

    def __init__(self, max_match: int):
        self.max_match = max_match
        self.tokens: list[int] = []  # the history from position 1 (a seed's tokens are the next row's)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.entries = 0  # positions recorded (the index's size, about ``max_match`` a token)

    def extend_seed(self, start_position: int, advanced_tokens: list[int]) -> None:
        """A seed's tokens: ``advanced_tokens[i]`` sits at position ``start_position + 1 + i``. Tokens
        already indexed (a seed handed over again, after a drafter call that failed) are skipped."""
        first = start_position + 1
        assert first <= len(self.tokens) + 1, "seeds arrive in order, without gaps"
        self.extend(advanced_tokens[len(self.tokens) + 1 - first :])

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1
            for n in range(1, min(self.max_match, end + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)
                self.entries += 1

    def occurrences(self, spec: SuffixSpec) -> list[int]:
        """The earlier ends of the longest matching suffix (module docstring), newest last; [] if none."""
        return self.match(spec)[0]

    def match(self, spec: SuffixSpec) -> tuple[list[int], int]:
        """-> (:meth:`occurrences`, the match's length): the longest of them measured backwards past
        ``max_match`` up to :attr:`SuffixSpec.match_reach` (0 where there is none)."""
        tokens, last = self.tokens, len(self.tokens) - 1
        for n in range(min(spec.max_match, last), spec.min_match - 1, -1):
            ends = self.ends.get(tuple(tokens[last - n + 1 :]), ())
            earlier = [e for e in ends if e < last][-spec.max_occurrences :]
            if earlier:
                length = n
                if n == spec.max_match:  # none is longer within the index; read on past it
                    length = max(matched_length(tokens, e, tokens, last, n, spec.match_reach) for e in earlier)
                return earlier, length
        return [], 0


def suffix_tree(index: SuffixIndex, spec: SuffixSpec) -> DraftTree:
    """The continuation tree of the history's match (module docstring), rooted at the frontier."""
    ends, length = index.match(spec)
    return continuation_tree([(index.tokens, e) for e in ends], spec, length)


def continuation_tree(
    occurrences: list[tuple[list[int], int]], spec: SuffixSpec, match_length: int | None = None
) -> DraftTree:
    """The trie of what followed each occurrence ``(tokens, end)`` (``tokens[end + 1:]``, up to
    ``max_depth``), scored and cut as the module docstring says, rooted at the frontier. A match of
    ``match_length`` tokens bounds its candidates and depth (:meth:`SuffixSpec.row_limit`; None: no bound)."""
    if not occurrences:
        return DraftTree.empty()
    if match_length is not None:
        limit = spec.row_limit(match_length)
        spec = replace(spec, budget=min(spec.budget, limit), max_depth=min(spec.max_depth, limit))
    node_token: list[int] = []
    node_parent: list[int] = []
    node_depth: list[int] = []
    node_count: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for tokens, e in occurrences:
        parent = PARENT_IS_ROOT
        for d in range(1, spec.max_depth + 1):
            if e + d >= len(tokens):
                break
            key = (parent, tokens[e + d])
            node = child.get(key)
            if node is None:
                node = child[key] = len(node_token)
                node_token.append(tokens[e + d])
                node_parent.append(parent)
                node_depth.append(d)
                node_count.append(0)
            node_count[node] += 1
            parent = node
    score, value = [], []
    for i in range(len(node_token)):  # parents are created before their children
        p = node_parent[i]
        base, above = (len(occurrences), 1.0) if p == PARENT_IS_ROOT else (node_count[p], value[p])
        score.append(node_count[i] / base)
        value.append(above * score[i])
    ranked = sorted(range(len(value)), key=lambda i: (-value[i], node_depth[i], i))
    kept = sorted(i for i in ranked[: spec.budget] if value[i] >= spec.min_value)
    return _tree([(node_token[i], node_parent[i], node_depth[i], score[i]) for i in kept], kept)


class SharedSuffixCache:
    """Recent answers of the app's requests, for suffix matches across requests (module docstring).
    Bounded by ``max_tokens`` answer tokens, the oldest answer evicted first. Indexed by its
    ``min_match``-grams only (one entry a token): a lookup reads the newest ``scan`` earlier ends of
    the history's last ``min_match`` tokens, extends each match backwards up to ``max_match``, and
    keeps the longest matches (the newest ``max_occurrences``). Owned by one serving loop (or one
    in-process ``Eyas``); grows by :meth:`add` only."""

    def __init__(self, max_tokens: int = 65_536, spec: SuffixSpec = SuffixSpec(), scan: int = 256):
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"suffix.shared_tokens: must be a positive int, got {max_tokens!r}")
        self.max_tokens, self.spec, self.scan = max_tokens, spec, scan
        self.answers: OrderedDict[int, list[int]] = OrderedDict()  # answer id -> its tokens, oldest first
        self.ends: dict[tuple[int, ...], deque[tuple[int, int]]] = {}  # min_match-gram -> (answer, end), oldest first
        self.tokens = 0  # answer tokens held
        self.entries = 0  # index entries (one a token past each answer's first min_match - 1)
        self._next = 0

    def add(self, tokens: list[int]) -> None:
        """Keep an answer (the oldest go while more than ``max_tokens`` are held)."""
        k = self.spec.min_match
        tokens = [int(t) for t in tokens][-self.max_tokens :]
        if len(tokens) <= k:
            return
        aid, self._next = self._next, self._next + 1
        self.answers[aid] = tokens
        for end in range(k - 1, len(tokens)):
            self.ends.setdefault(tuple(tokens[end - k + 1 : end + 1]), deque()).append((aid, end))
        self.tokens += len(tokens)
        self.entries += len(tokens) - k + 1
        while self.tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        aid, tokens = self.answers.popitem(last=False)
        k = self.spec.min_match
        for end in range(k - 1, len(tokens)):
            key = tuple(tokens[end - k + 1 : end + 1])
            ends = self.ends.get(key)
            while ends and ends[0][0] == aid:  # the oldest answer's entries lead every deque
                ends.popleft()
                self.entries -= 1
            if ends is not None and not ends:
                del self.ends[key]
        self.tokens -= len(tokens)

    def occurrences(self, history: list[int]) -> list[tuple[list[int], int]]:
        """The earlier answers' ends of the longest suffix of ``history`` they hold (at least
        ``min_match`` tokens): ``(answer tokens, end)``, newest last; [] if none."""
        return self.match(history)[0]

    def match(self, history: list[int], reach: int | None = None) -> tuple[list[tuple[list[int], int]], int]:
        """-> (:meth:`occurrences`, the match's length): matches longer than ``max_match`` count as
        ``max_match`` when they are chosen, and the chosen ones are measured on up to ``reach`` (None: the
        cache's :attr:`SuffixSpec.match_reach`)."""
        spec, k = self.spec, self.spec.min_match
        if len(history) < k:
            return [], 0
        ends = self.ends.get(tuple(history[-k:]))
        if not ends:
            return [], 0
        best, found = 0, []
        for i in range(len(ends) - 1, max(len(ends) - 1 - self.scan, -1), -1):  # newest first
            aid, end = ends[i]
            tokens = self.answers[aid]
            n = matched_length(tokens, end, history, len(history) - 1, k, spec.max_match)
            if n > best:
                best, found = n, []
            if n == best and len(found) < spec.max_occurrences:
                found.append((tokens, end))
        length = best
        if best == spec.max_match:  # read on past max_match
            reach = spec.match_reach if reach is None else reach
            length = max(matched_length(tokens, end, history, len(history) - 1, best, reach) for tokens, end in found)
        return found[::-1], length

    def tree(self, history: list[int], spec: SuffixSpec | None = None) -> DraftTree:
        """The continuation tree of ``history``'s match in the kept answers, cut by ``spec`` (its
        budget, depth and spec factor; None: the cache's own spec). The match itself follows the cache's spec."""
        spec = spec or self.spec
        found, length = self.match(history, spec.match_reach)
        return continuation_tree(found, spec, length)

    def stats(self) -> dict:
        """What it holds (``eyas stats``): answers, tokens, index entries, and its bound."""
        return {
            "answers": len(self.answers),
            "tokens": self.tokens,
            "index_entries": self.entries,
            "max_tokens": self.max_tokens,
        }


def expected_accepted(tree: DraftTree) -> float:
    """The tokens a tree is expected to get accepted: its nodes' path values (the products of their
    ``draft_probs`` from the root) added, each node's value the chance that its whole path is kept."""
    value: list[float] = []
    for p, q in zip(tree.parents.tolist(), tree.draft_probs.tolist()):
        value.append(q * (1.0 if p == PARENT_IS_ROOT else value[p]))
    return sum(value)


def first_token_value(tree: DraftTree) -> float:
    """The chance a tree's first token is accepted, by its own values: its root children's values added
    (at most 1)."""
    return min(sum(q for p, q in zip(tree.parents.tolist(), tree.draft_probs.tolist()) if p == PARENT_IS_ROOT), 1.0)


def accepted_depth(tree: DraftTree, accepted: list[int]) -> int:
    """How many of a round's ``accepted`` draft tokens (in order from the root) lie on one path of
    ``tree``: the tokens that tree would have got accepted alone."""
    children: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        children.setdefault((parent, token), i)
    node, depth = PARENT_IS_ROOT, 0
    for token in accepted:
        node = children.get((node, token))
        if node is None:
            break
        depth += 1
    return depth


def _tree(nodes: list[tuple[int, int, int, float]], ids: list[int]) -> DraftTree:
    """(token, parent id, depth, score) of nodes whose parents come first -> a DraftTree (ids remapped)."""
    if not nodes:
        return DraftTree.empty()
    at = {node_id: i for i, node_id in enumerate(ids)}
    parents = [PARENT_IS_ROOT if p == PARENT_IS_ROOT else at[p] for _, p, _, _ in nodes]
    return DraftTree(
        torch.tensor([t for t, _, _, _ in nodes], dtype=torch.int64),
        torch.tensor(parents, dtype=torch.int64),
        torch.tensor([d for _, _, d, _ in nodes], dtype=torch.int64),
        torch.tensor([v for _, _, _, v in nodes], dtype=torch.float32),
    )


def graft(base: DraftTree, extra: DraftTree) -> DraftTree:
    """One tree with every path of ``base`` and of ``extra`` (both rooted at the same frontier): a node
    of ``extra`` whose path ``base`` already holds is that node (its score the larger of the two);
    the others are added after ``base``'s, in ``extra``'s order. Verified in one forward."""
    if extra.num_nodes == 0:
        return base
    nodes = [
        (int(t), int(p), int(d), float(v))
        for t, p, d, v in zip(
            base.tokens.tolist(), base.parents.tolist(), base.depths.tolist(), base.draft_probs.tolist()
        )
    ]
    child = {(p, t): i for i, (t, p, _, _) in enumerate(nodes)}
    where: list[int] = []
    extra_nodes = zip(extra.tokens.tolist(), extra.parents.tolist(), extra.depths.tolist(), extra.draft_probs.tolist())
    for t, p, d, v in extra_nodes:
        parent = PARENT_IS_ROOT if p == PARENT_IS_ROOT else where[p]
        node = child.get((parent, t))
        if node is None:
            node = child[(parent, t)] = len(nodes)
            nodes.append((t, parent, d, v))
        else:
            old = nodes[node]
            nodes[node] = (old[0], old[1], old[2], max(old[3], v))
        where.append(node)
    return _tree(nodes, list(range(len(nodes))))
