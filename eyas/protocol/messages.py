"""The per-round messages of the wire contract (docs/architecture.md, "One round").

- `Seed`: what the target hands the drafter after a publish (design 0x05A, 0x05D).
- `AcceptDecision`: the verifier's choice of one accepted path and the frontier token (design 0x05C).
- `PublishAck`: the receipt of the publish transaction keyed by `(request_id, round)` (design 0x05D).

Frozen dataclasses over tensors; the gRPC codec and pydantic models wrap these at process edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT_ROW: int = 0  # flat row of the root (the previous frontier token); starts every path


@dataclass(frozen=True)
class AcceptDecision:
    """One round's verdict (design 0x05C): the accepted path and the target's next token.

    Publication gathers target KV and features through `accepted_rows` (design 0x05D), outputs
    `accepted_tokens` then `frontier_token`, and marks the frontier as append-required.
    """

    accepted_rows: torch.Tensor  # [A] int64 rows of one root->leaf path prefix; [0] == ROOT_ROW
    accepted_tokens: torch.Tensor  # int64 = flat.tokens[accepted_rows[1:]]
    frontier_token: int  # target-governed next token; not a verified row (append required)

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


@dataclass(frozen=True)
class Seed:
    """What the drafter needs to (re)seed after a publish (design 0x05A, 0x05D).

    Draft row ``t`` reads the verified target feature ``f_t`` and the advanced token ``x_{t+1}``.
    """

    features: torch.Tensor  # [A, F] verified target features of the newly committed rows
    advanced_tokens: torch.Tensor  # [A] int64 x_{t+1} for each row t (the last one is the frontier)
    start_position: int  # position of the first row
    round: int  # the round this seed was published in

    @property
    def frontier_token(self) -> int:
        return int(self.advanced_tokens[-1])

    @property
    def end_position(self) -> int:
        """One past the last row: the committed length after this seed."""
        return self.start_position + int(self.features.shape[0])

    @staticmethod
    def total_rows(seeds: list[Seed]) -> int:
        """Context rows in ``seeds`` together: what the drafter must read before it drafts again."""
        return sum(int(s.features.shape[0]) for s in seeds)

    @staticmethod
    def join(seeds: list[Seed]) -> Seed:
        """Contiguous seeds, in order, as one (one concatenation); see :meth:`then`."""
        if len(seeds) == 1:
            return seeds[0]
        for a, b in zip(seeds, seeds[1:]):
            if b.start_position != a.end_position:
                raise ValueError(
                    f"seed.start_position: {b.start_position} != {a.end_position}, the end of the seed it follows"
                )
            if b.round <= a.round:
                raise ValueError(f"seed.round: {b.round} is not after {a.round}")
        dtype = seeds[0].features.dtype
        return Seed(
            torch.cat([x.features.to(dtype) for x in seeds]),
            torch.cat([x.advanced_tokens for x in seeds]),
            seeds[0].start_position,
            seeds[-1].round,
        )

    def to(self, device: torch.device) -> Seed:
        """This seed with its tensors on ``device`` (itself when they are there already)."""
        if self.features.device == device and self.advanced_tokens.device == device:
            return self
        return Seed(self.features.to(device), self.advanced_tokens.to(device), self.start_position, self.round)

    def then(self, later: Seed) -> Seed:
        """This seed followed by ``later`` as one seed, for a drafter that skipped rounds.

        A request that decodes plainly for a few rounds need not call its drafter each round: the
        seeds of those rounds are contiguous (each starts where the last ended), so they concatenate
        into one, which the drafter consumes when the request drafts again (design 0x05A).
        Worked example: rows [5, 7) then [7, 8) -> rows [5, 8), the later round and frontier token."""
        return Seed.join([self, later])


@dataclass(frozen=True)
class PublishAck:
    request_id: str
    round: int
    committed_len: int
    output_tokens: tuple[int, ...]  # tokens this publish emitted (accepted candidates + frontier)


@dataclass(frozen=True)
class Refusal:
    """One refused item of a batched call: the message names the field (``not_found``: no session)."""

    message: str
    not_found: bool = False

    @classmethod
    def of(cls, err: Exception) -> Refusal:
        if isinstance(err, LookupError):  # an unknown request id (the worker's SessionNotFound)
            return cls(str(err.args[0]), True)
        return cls(str(err))
