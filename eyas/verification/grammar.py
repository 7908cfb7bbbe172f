"""Structured output, exact under speculation: a grammar (any JSON object, or a JSON schema) that
every emitted token must keep satisfiable, applied to every verify row under *its own* path.

Terms:

- **response format**: what a request asks for, OpenAI's shapes: ``{"type": "text"}`` (nothing),
  ``{"type": "json_object"}`` (one JSON object) or ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}`` (a value valid against the schema), checked at the edge
  (``eyas.protocol.response_format``). Its **key** is its canonical JSON text (``grammar_key``
  there: compact, the schema's key order kept, since a schema's property order is the order the
  answer gives them in): what ``SamplingParams``, ``SessionSpec`` and the wire carry
  (``GRAMMAR_OFF``, the empty string, for none).
- **allowed mask** of a row: the tokens the grammar lets follow the row's history (the answer so
  far, then the row's path in the tree), as xgrammar's bitmask: ``int32 [R, ceil(V / 32)]``, bit
  ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed. Once the grammar is complete only
  the stop tokens are allowed, so a constrained answer ends with its value.
- **cursor** (:class:`GrammarCursor`): one request's matcher after its answer so far, advanced as
  the answer grows; owned by the request's session, like its KV.

A verify row's mask is the one a one-row decode of its path would get, so greedy speculative output
under a grammar is target-only constrained decoding's, token for token, and a sampled one keeps the
masked target distribution. A row whose own token the grammar refuses is never accepted (its parent
gives that token probability 0); its mask is empty, and it is left unmasked (it is never read).

The engine is xgrammar (a pushdown automaton compiled over the tokenizer's vocabulary): one C++ call
fills the masks of a whole draft tree (``GrammarMatcher.traverse_draft_tree``), and a JSON schema
compiles in milliseconds. outlines-core was measured beside it (``bench/grammar_engines.py``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from eyas.protocol.response_format import GRAMMAR_OFF, xgrammar, xgrammar_reason
from eyas.protocol.tree import FlatTree

COMPILED_CACHE = 64  # compiled grammars a compiler keeps (least recently used go first)
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})  # response_format json_object: any JSON object
MAX_ROLLBACK_TOKENS = 64  # a matcher's undo depth: deeper than any draft tree (MAX_TREE_DEPTH 32)
NO_CHILD = -1  # xgrammar's "no such node" in the first-child / next-sibling arrays


class GrammarCompiler:
    """Compiles response formats for one tokenizer (and the model's vocabulary size, which may pad
    the tokenizer's). Thread-safe; compiled grammars are cached by key."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = xgrammar()

        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, key: str):
        """The compiled grammar of a key (a ``ValueError`` naming ``response_format`` if it is not one)."""
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        try:
            fmt = json.loads(key)
            if fmt.get("type") == "json_object":  # an object, as OpenAI's json_object promises (xgrammar's
                # builtin JSON grammar also admits a top-level array, string or number)
                compiled = self._compiler.compile_json_schema(JSON_OBJECT_SCHEMA)
            else:
                compiled = self._compiler.compile_json_schema(json.dumps(fmt["schema"]))
        except Exception as err:  # noqa: BLE001 - named for the client: the key came from its request
            raise ValueError(f"response_format: cannot compile this grammar ({xgrammar_reason(err)})") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def cursor(self, key: str) -> GrammarCursor | None:
        """A fresh cursor (an empty answer) for a key; None for :data:`GRAMMAR_OFF`."""
        return None if key == GRAMMAR_OFF else GrammarCursor(self.compile(key), self.vocab_size)


class Grammars:
    """Where a process gets its requests' cursors: the compiler over the target's vocabulary is built
    on the first grammar asked for (the tokenizer's vocabulary read in: ~0.2 s) and kept. ``make``
    builds it (None: this process has no tokenizer); ``missing``: the refusal then (a ``ValueError``
    naming ``response_format``), or None to go on without a grammar (a drafter then drafts unmasked:
    the target still enforces it)."""

    def __init__(self, make: Callable[[], GrammarCompiler] | None, missing: str | None = None):
        self._make, self.missing = make, missing
        self._compiler: GrammarCompiler | None = None

    def cursor(self, key: str) -> GrammarCursor | None:
        """A new request's cursor (None for :data:`GRAMMAR_OFF`, or when there is no compiler and no refusal)."""
        if key == GRAMMAR_OFF:
            return None
        if self._make is None:
            if self.missing is not None:
                raise ValueError(self.missing)
            return None
        if self._compiler is None:
            self._compiler = self._make()
        return self._compiler.cursor(key)


class GrammarCursor:
    """One request's matcher after its answer so far (module docstring); not thread-safe: its
    session's owner calls it. ``tokens``: the answer the matcher has accepted; ``refused``: the last
    answer asked for went past the grammar (a token it refuses, or one after its end), so nothing
    is enforced on it."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        self.tokens: list[int] = []
        self.refused = False

    def twin(self) -> GrammarCursor:
        """A cursor of the same grammar at an empty answer (the drafter's own, beside the target's)."""
        return GrammarCursor(self.compiled, self.vocab_size)

    def advance(self, answer: list[int]) -> bool:
        """Move the matcher to ``answer``: back over the tokens it does not share with the answer
        accepted so far (rolled back when at most ``MAX_ROLLBACK_TOKENS``, else replayed from the start),
        then forward over the rest. -> whether the grammar accepts all of ``answer`` and is not over."""
        shared = 0
        for a, b in zip(self.tokens, answer):
            if a != b:
                break
            shared += 1
        undo = len(self.tokens) - shared
        if undo and undo <= MAX_ROLLBACK_TOKENS:
            self.matcher.rollback(undo)
            del self.tokens[shared:]
        elif undo:
            self.matcher.reset()
            self.tokens = []
        self.refused = False
        for t in answer[len(self.tokens) :]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                self.refused = True
                break
            self.tokens.append(int(t))
        return not self.refused and not self.matcher.is_terminated()

    def tree_bitmask(self, answer: list[int], flat: FlatTree | None) -> torch.Tensor | None:
        """The allowed mask of every verify row, ``int32 [R, W]``: ``flat`` None (a prefill's one row)
        -> the mask after ``answer``; else row 0 is the frontier (emitted, not in ``answer``) and row
        i's mask is the one after ``answer``, the frontier and row i's path. None when the answer
        has left the grammar or ended it (nothing to enforce)."""
        if not self.advance(list(answer) if flat is None else [*answer, int(flat.tokens[0])]):
            return None
        rows = 1 if flat is None else flat.num_rows
        bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        if rows == 1:
            self.matcher.fill_next_token_bitmask(bitmask, 0)
            return bitmask
        first_child, next_sibling = _child_sibling(flat.parents.tolist())
        self.matcher.traverse_draft_tree(first_child, next_sibling, flat.tokens, bitmask)
        return bitmask

    def rows_bitmask(self, answers: list[list[int]]) -> torch.Tensor:
        """The allowed mask after each of ``answers`` (a drafter's rows at one growth step: the answer
        so far, then the row's path), ``int32 [P, W]``; a row the grammar does not accept (or has
        ended) is all zero, which :func:`apply_bitmask` leaves unmasked."""
        bitmask = self._xgr.allocate_token_bitmask(len(answers), self.vocab_size)
        bitmask.zero_()
        for i, answer in enumerate(answers):
            if self.advance(answer):
                self.matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask


def _child_sibling(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree's first-child / next-sibling arrays (xgrammar's draft-tree layout) from its parent rows
    (row 0 the root; a parent before its children). Worked example: parents [root, 0, 0, 1] ->
    first child [1, 3, -1, -1], next sibling [-1, 2, -1, -1]."""
    rows = len(parents)
    first_child = [NO_CHILD] * rows
    next_sibling = [NO_CHILD] * rows
    last_child = [NO_CHILD] * rows
    for row in range(1, rows):
        p = parents[row]
        if first_child[p] == NO_CHILD:
            first_child[p] = row
        else:
            next_sibling[last_child[p]] = row
        last_child[p] = row
    return torch.tensor(first_child, dtype=torch.int64), torch.tensor(next_sibling, dtype=torch.int64)


def allowed_rows(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:  # [R, W] int32 -> [R, vocab] bool
    """The bitmask as booleans (bit ``t % 32`` of word ``t // 32`` = token ``t``), cut to ``vocab``."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(bool))


def apply_bitmask(
    logits: torch.Tensor,  # [R, V] float32, changed in place
    bitmask: torch.Tensor,  # [R, W] int32 allowed masks, one per row
    columns: torch.Tensor | None = None,  # [C] int64: the target token of each logit column (a draft vocab)
) -> torch.Tensor:  # logits, disallowed tokens at -inf
    """Disallowed tokens to -inf, row by row; a row with no allowed token (one the grammar refused,
    never read) is left as it is. ``columns``: the logits are a draft vocabulary's (column j is
    target token ``columns[j]``)."""
    assert logits.ndim == 2 and bitmask.shape[0] == logits.shape[0], "logits [R, V] and one bitmask row per row"
    allowed = allowed_rows(bitmask, bitmask.shape[1] * 32)
    allowed = allowed[:, columns] if columns is not None else allowed[:, : logits.shape[1]]
    live = allowed.any(dim=1)  # [R]
    mask = ~allowed & live.unsqueeze(1)
    return logits.masked_fill_(mask.to(logits.device), float("-inf"))
