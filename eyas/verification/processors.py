"""Logits processors, exact under speculation: every verify row is processed with the history of
*its own* path in the draft tree, so a row's processed logits are the ones a one-row decode of that
path would compute, and acceptance (``accept.py``) keeps exactly the processed target distribution.

Terms:

- **history of a row**: the answer's tokens so far (committed output, the previous frontier
  included: it is the tree's root row) followed by the tokens of the row's ancestors below the root
  and its own. A prefill's one row (the last prompt row) has an empty history.
- **logit bias**: a constant added to the logits of the given token ids (OpenAI's ``logit_bias``).
- **repetition penalty** ``r`` (vLLM's and HF's): a token seen in the prompt or the history has its
  logit divided by ``r`` where positive and multiplied by ``r`` where not.
- **frequency / presence penalty** (OpenAI's): ``logit -= frequency * count + presence * (count > 0)``
  where ``count`` is the token's occurrences in the history (the answer only, not the prompt).
- **min_tokens** (vLLM's): a row whose history is shorter than ``min_tokens`` has the logits of the
  answer's stop ids (``SamplingParams.min_tokens_stop_ids``) at -inf: the token it draws would be the
  answer's token number ``len(history) + 1``.

Order (vLLM's): logit bias, then the repetition penalty, then frequency and presence, then the
min_tokens mask; temperature,
min-p, top-k and top-p follow in ``sampling.target_probs``. Pure functions: tensors in, tensors out.
"""

from __future__ import annotations

from collections import Counter

import torch

from eyas.protocol.checks import check_in_vocab
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import FlatTree
from eyas.verification.grammar import GrammarCursor, apply_bitmask


def processed_logits(
    logits: torch.Tensor,  # [R, V] float: one row per flat tree row (a prefill: [1, V])
    flat: FlatTree | None,  # the verified tree (None: a prefill's last prompt row)
    prompt_ids: list[int],
    output_ids: list[int],  # the committed answer so far, the previous frontier excluded
    params: SamplingParams,
    allowed: torch.Tensor | None = None,  # [R, W] int32: each row's grammar mask (eyas.verification.grammar)
) -> torch.Tensor:  # [R, V] float32
    """``logits`` with ``params``' processors applied to each row under its own history (module
    docstring), after the structured-output grammar's mask of each row when ``allowed`` is given
    (disallowed tokens at -inf). Unchanged (the same tensor) when nothing is on."""
    if allowed is not None:
        logits = apply_bitmask(logits.float().clone(), allowed)  # a copy of its own from here on
    if not params.processes:
        return logits
    assert logits.ndim == 2, "logits: [R, V]"
    rows, vocab = logits.shape
    out = logits if allowed is not None else logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=out.device)
        if int(ids.max()) >= vocab:
            raise ValueError(f"logit_bias: token id {int(ids.max())} is outside the vocabulary of size {vocab}")
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
    if _penalizes(params):
        counts, tokens = history_counts(flat, output_ids, rows)  # [R, U], [U]
        out = _penalize(out, counts, tokens, list(prompt_ids), params)
    if params.holds_stops:
        # a row's history: the answer so far, the root (the previous frontier) and its path below it
        lengths = torch.zeros(rows, dtype=torch.int64) if flat is None else len(output_ids) + 1 + flat.depths
        _hold_stops(out, lengths, list(params.min_tokens_stop_ids), params.min_tokens)
    return out


def _hold_stops(
    out: torch.Tensor,  # [R, C] float32, changed in place
    lengths: torch.Tensor,  # [R] int64 each row's answer length before the token it draws
    stop_columns: list[int],  # the stop ids' logit columns
    min_tokens: int,
) -> torch.Tensor:  # out
    """min_tokens (module docstring): the stop columns of every row shorter than ``min_tokens`` at -inf."""
    short = (lengths < min_tokens).to(out.device)  # [R]
    if stop_columns and bool(short.any()):
        check_in_vocab(stop_columns, out.shape[1], "min_tokens_stop_ids")
        cols = torch.tensor(stop_columns, dtype=torch.int64, device=out.device)
        out[short.nonzero().flatten()[:, None], cols[None, :]] = float("-inf")
    return out


def _penalizes(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)


def _penalize(
    out: torch.Tensor,  # [R, C] float32, changed in place: one row per history
    counts: torch.Tensor,  # [R, U] each row's occurrences of ``columns`` in its answer history
    columns: torch.Tensor,  # [U] int64 the logit columns counted
    prompt_columns: list[int],  # the prompt's tokens' columns (the repetition penalty reads them too)
    params: SamplingParams,
) -> torch.Tensor:  # out
    """The repetition penalty over prompt and answer, then the frequency and presence penalties over
    the answer (module docstring), each row under its own counts."""
    rows = out.shape[0]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.isin(columns, torch.tensor(prompt_columns, dtype=torch.int64))  # [U]
        seen = (counts > 0) | in_prompt  # [R, U]
        # columns only the prompt holds: penalized too
        prompt_only = torch.tensor(sorted(set(prompt_columns) - set(columns.tolist())), dtype=torch.int64)
        columns_all = torch.cat([columns, prompt_only]).to(out.device)  # [U + P]
        seen = torch.cat([seen, torch.ones(rows, prompt_only.numel(), dtype=torch.bool)], 1)  # [R, U + P]
        sel = out[:, columns_all]  # [R, U + P]
        r = params.repetition_penalty
        out[:, columns_all] = torch.where(seen.to(out.device), torch.where(sel > 0, sel / r, sel * r), sel)
    if params.presence_penalty or params.frequency_penalty:
        c = counts.to(out.device, out.dtype)  # [R, U]
        out[:, columns.to(out.device)] -= params.frequency_penalty * c + params.presence_penalty * (c > 0).to(out.dtype)
    return out


def history_counts(
    flat: FlatTree | None,
    output_ids: list[int],
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, U] float32 occurrences, [U] int64 token ids
    """Each row's history (module docstring) as counts over the tokens any history holds: the answer
    so far is every row's, then each row adds its path's tokens (the root row's token, the previous
    frontier, and the tokens of its ancestors and itself). Rows are in topological order (a parent
    before its children), so a row's counts are its parent's plus its own token."""
    path_tokens = [] if flat is None else flat.tokens.tolist()
    answer = Counter(output_ids)
    tokens = sorted(set(answer) | set(path_tokens))  # [U]
    column = {t: i for i, t in enumerate(tokens)}
    base = [float(answer.get(t, 0)) for t in tokens]
    if flat is None:
        return torch.tensor([base] * rows).reshape(rows, len(tokens)), torch.tensor(tokens, dtype=torch.int64)
    assert flat.num_rows == rows, "one logits row per flat row"
    parents = flat.parents.tolist()
    counts: list[list[float]] = []
    for row in range(rows):  # host lists: a tree has tens of rows, a history hundreds of distinct tokens
        own = list(base if row == 0 else counts[parents[row]])
        own[column[path_tokens[row]]] += 1
        counts.append(own)
    return torch.tensor(counts).reshape(rows, len(tokens)), torch.tensor(tokens, dtype=torch.int64)


def draft_processor(
    params: SamplingParams,
    prompt_ids: list[int],
    columns: dict[int, int] | None = None,
    grammar: GrammarCursor | None = None,
):
    """The request's processors for a drafter's logits, so that the tree is drafted for the
    distribution that is verified: -> ``process(logits [P, C], histories) -> [P, C]``, where row i's
    history is the committed tokens after the first (``Seed.advanced_tokens`` joined: the prompt from
    its second token, the answer, the frontier) followed by its tree path. ``columns`` maps a target
    token id to its logit column (an EAGLE-3 draft vocabulary; None: the ids themselves); a token the
    drafter cannot draft has no column and is skipped. ``grammar``: the drafter's own cursor of the
    request's structured-output grammar (its rows masked as the verifier's are). None when no
    processor and no grammar is on."""
    if not params.processes and grammar is None:
        return None
    answer_from = max(len(prompt_ids) - 1, 0)  # history index of the first answer token
    prompt = list(prompt_ids)

    def col(tokens):
        return [t if columns is None else columns[t] for t in tokens if columns is None or t in columns]

    bias = [(c, b) for t, b in params.logit_bias for c in col([t])]
    prompt_columns = col(prompt)
    stop_columns = col(list(params.min_tokens_stop_ids))
    targets = None  # [C] the target token of each logit column (a draft vocabulary), for the grammar's mask
    if grammar is not None and columns is not None:
        targets = torch.zeros(len(columns), dtype=torch.int64)
        targets[torch.tensor(list(columns.values()))] = torch.tensor(list(columns.keys()))

    def process(logits: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:  # [P, C] -> [P, C]
        out = logits.float().clone()
        if grammar is not None:
            out = apply_bitmask(out, grammar.rows_bitmask([h[answer_from:] for h in histories]), targets)
        if not params.processes:
            return out
        if bias:
            out[:, torch.tensor([c for c, _ in bias], dtype=torch.int64)] += torch.tensor([b for _, b in bias])
        if _penalizes(params):
            answers = [Counter(col(history[answer_from:])) for history in histories]
            counted = sorted(set().union(*answers))  # [U] the columns any row's answer holds
            counts = torch.tensor([[float(a[c]) for c in counted] for a in answers]).reshape(len(answers), len(counted))
            out = _penalize(out, counts, torch.tensor(counted, dtype=torch.int64), prompt_columns, params)
        if params.holds_stops:
            lengths = torch.tensor([len(h) - answer_from for h in histories], dtype=torch.int64)
            _hold_stops(out, lengths, stop_columns, params.min_tokens)
        return out

    return process
