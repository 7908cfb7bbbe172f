"""Expert-union accounting for mixture-of-experts targets (design 0x09A), pure over routing tensors.

For a dense model a verify of more rows reads the same weights; for an MoE target the candidate rows
may route to a wider union of experts:  E_verify = U_{u in rows} E_u. The scheduler's cost model
takes the bytes of that union (``RoundWork.expert_bytes``).
"""

from __future__ import annotations


def expert_union(routing: list, rows: slice = slice(None)) -> tuple[tuple[int, ...], ...]:
    """Per MoE layer, the sorted union of experts that any row (of ``rows``) routed to (design 0x09A).

    routing: per layer a [N, k] int64 tensor (row -> its top-k experts), as
    ``TargetModel.expert_routing()`` returns after a verify; ``rows`` picks one request's rows of a
    packed batch. Worked example: rows routed [[0, 2], [2, 3], [0, 3]] -> (0, 2, 3); rows 1:2 alone
    -> (2, 3).
    """
    return tuple(tuple(sorted(set(r[rows].reshape(-1).tolist()))) for r in routing)


def expert_bytes(union: tuple[tuple[int, ...], ...], bytes_per_expert: int) -> int:
    """Bytes of expert weights a verify touched: the union's size, summed over layers, times one expert."""
    return sum(len(u) for u in union) * bytes_per_expert
