"""``DrafterWorker``: the owner of drafter weights and draft KV for one or more drafting methods.

A plain class; each ``EyasDrafter`` Serve replica owns one (eyas/serve/deployments.py). Per request it holds one draft session in the :class:`DrafterEngine` of the request's
method. A round: ``propose(request_id, seed, tree)`` first discards the previous round's provisional
tree rows (the seed proves that round was published), appends the seed's verified context rows and
grows the next tree (design 0x05B, 0x06B). The seed arrives as the wire message (``pb.Seed``) and is
validated before use. A drafter that lost a session is reseeded with a seed that covers every
committed row from position 0 (design 0x05D); it never builds context on an unverified feature.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import wire
from eyas.protocol.messages import Refusal, Seed
from eyas.protocol.tree import DraftTree
from eyas.verification.grammar import GrammarCompiler, Grammars
from eyas.verification.processors import draft_processor


class DrafterWorker:
    def __init__(
        self,
        engines: dict[str, DrafterEngine],
        vocab_size: int,
        sources: dict[str, str] | None = None,
        default_trees: dict[str, TreeSpec] | None = None,
        name: str = "drafter",
        grammars: Callable[[], GrammarCompiler] | None = None,
        reload: Callable[[str, str], DrafterEngine] | None = None,
    ):
        """``grammars``: builds the structured-output compiler over the target's vocabulary when a
        request first asks for a grammar (None: such a request drafts unmasked; the target still
        enforces the grammar, so only acceptance suffers). ``reload``: (method, folder) -> an engine
        over that checkpoint at this worker's precision, whose drafter :meth:`swap` takes (None: no swap)."""
        if not engines:
            raise ValueError("methods: a drafter worker needs at least one drafting method")
        self.engines = engines
        self.vocab_size = vocab_size
        self.sources = sources or {m: "in-memory" for m in engines}
        self.default_trees = default_trees or {m: TreeSpec() for m in engines}
        self.name = name
        self.session_method: dict[str, str] = {}  # request id -> method
        self.draft_points: dict[str, list[tuple[int, int, float]]] = {}  # method -> (depth, rows, ms) (measure_costs)
        self.grammars = Grammars(grammars)  # without a compiler a grammar's request drafts unmasked
        self._reload = reload

    @classmethod
    def load(
        cls,
        target: str,
        methods: tuple[str, ...] = ("eagle3",),
        drafter_dirs: dict[str, str] | None = None,
        threads: int | None = None,
        precision: str = "fp32",
        dtype: str = "float32",
        device: str = "cpu",
    ) -> DrafterWorker:
        """Load the target's embedding and LM head (and no decoder layer: :func:`load_target_head`) plus a
        drafter per method (shipped ones by default).
        ``precision``: the served target precision; at ``fp16w`` the drafters and the target head they
        read run with fp16 weights too, at ``gguf`` the drafters with Q4_1 blocks and the head with the
        GGUF's own blocks (fp32 otherwise: an int8 target still drafts at fp32).
        ``dtype``, ``device``: the target's compute dtype and where these drafters compute."""
        from eyas.runtime import make_drafter
        from eyas.target.loader import load_target_head, load_tokenizer

        if threads:
            torch.set_num_threads(threads)
        from eyas.target.loader import DTYPES

        head = load_target_head(
            target, precision if precision in ("fp16w", "gguf") else "fp32", device=device, dtype=dtype
        )
        handles = {
            m: make_drafter(
                m,
                (drafter_dirs or {}).get(m),
                head.cfg,
                head.fingerprint,
                head.embed,
                head.lm_head,
                head.precision,
                DTYPES[dtype],
            )
            for m in methods
        }
        return cls(
            {m: h.engine for m, h in handles.items()},
            head.cfg.vocab_size,
            {m: h.source for m, h in handles.items()},
            {m: h.default_tree for m, h in handles.items()},
            name=f"{target}/{'+'.join(methods)}",
            grammars=lambda: GrammarCompiler(load_tokenizer(target), head.cfg.vocab_size, list(head.cfg.eos_token_ids)),
            reload=lambda m, folder: (
                make_drafter(
                    m, folder, head.cfg, head.fingerprint, head.embed, head.lm_head, head.precision, DTYPES[dtype]
                ).engine
            ),
        )

    def swap(self, method: str, folder: str, version: int | None = None) -> int:
        """Serve the drafter checkpoint at ``folder`` for ``method`` from the next round on (a learned
        version of the live one: same network, address and vocabulary, checked against the target's
        fingerprint) -> the method's drafter version now. :meth:`load_version` then :meth:`swap_in`;
        a replica loads outside its worker lock and swaps inside it, between two rounds."""
        return self.swap_in(method, self.load_version(method, folder), folder, version)

    def load_version(self, method: str, folder: str):
        """The drafter at ``folder``, loaded and checked for ``method`` at this worker's precision (no
        state changes: safe beside rounds in progress) -> the drafter for :meth:`swap_in`."""
        if method not in self.engines:
            raise ValueError(f"method: this drafter worker serves {sorted(self.engines)}, not {method!r}")
        if self._reload is None:
            raise ValueError("drafter: this worker was built without a loader; it cannot swap drafters")
        engine, fresh = self.engines[method], self._reload(method, folder)
        if fresh.taps != engine.taps:
            raise ValueError(f"drafter: {folder} reads the feature address {fresh.taps}, the live one {engine.taps}")
        return fresh.drafter

    def swap_in(self, method: str, drafter, folder: str, version: int | None = None) -> int:
        """Make ``drafter`` (from :meth:`load_version`) the live one of ``method`` -> its version now
        (``version``: the learner's number for it; None: the live one's plus 1)."""
        engine = self.engines[method]
        engine.swap_drafter(drafter, version)
        self.sources[method] = str(folder)
        return engine.version

    def info(self) -> dict:
        """Per method: the feature address a target must tap, the checkpoint, the default tree, and
        the start-up draft cost (``(depth, draft rows, ms)`` points; empty until :meth:`measure_costs`)."""
        return {
            m: {
                "taps": [(t.layers_applied, t.normed) for t in e.taps],
                "source": self.sources[m],
                "default_tree": self.default_trees[m],
                "draft_points": list(self.draft_points.get(m, [])),
                "version": e.version,
            }
            for m, e in self.engines.items()
        }

    def measure_costs(self, repeats: int = 3) -> dict[str, list[tuple[int, int, float]]]:
        """Time each method's drafting at depths 1, 3 and its default depth on this device
        (:meth:`DrafterEngine.measure_cost`), for the scheduler's starting draft cost."""
        for m, e in self.engines.items():
            tree = self.default_trees[m]
            depths = tuple(sorted({1, min(3, tree.max_depth), tree.max_depth} - {0}))
            self.draft_points[m] = e.measure_cost(tree, depths, repeats)
        return self.draft_points

    def open_session(
        self, request_id: str, method: str, max_slots: int, sampling=None, prompt_ids: tuple[int, ...] = ()
    ) -> None:
        """``sampling``: the request's ``SamplingParams`` when a logits processor or a grammar is on
        (with its ``prompt_ids``): the drafter drafts under them
        (``eyas.verification.processors.draft_processor``; the grammar through its own cursor)."""
        wire.check_request_id(request_id)
        if method not in self.engines:
            raise ValueError(f"method: this drafter worker serves {sorted(self.engines)}, not {method!r}")
        if request_id in self.session_method:
            raise ValueError(f"request_id: {request_id!r} already has a live draft session")
        engine = self.engines[method]
        process = None
        if sampling is not None:
            grammar = self.grammars.cursor(sampling.grammar)
            process = draft_processor(sampling, list(prompt_ids), engine.draft_columns, grammar)
        engine.open_session(request_id, max_slots, process)
        self.session_method[request_id] = method

    def propose(self, request_id: str, seed: pb.Seed | Seed, tree: TreeSpec) -> tuple[DraftTree, float]:
        """-> (the next tree, seconds of drafter compute); a refusal raises ``ValueError`` naming the field."""
        (draft,), seconds, _ = self.propose_batch([(request_id, seed, tree)])
        if isinstance(draft, Refusal):
            raise ValueError(draft.message)
        return draft, seconds

    def version_of(self, request_id: str) -> int:
        """The drafter version that drafts ``request_id``'s trees now (its method's live one; 0 unknown)."""
        method = self.session_method.get(request_id)
        return self.engines[method].version if method is not None else 0

    def propose_batch(self, items: list[tuple[str, pb.Seed | Seed, TreeSpec]]) -> tuple[list, float, list[int]]:
        """Grow several requests' trees, one packed drafter pass per growth step and method.

        -> (per item a ``DraftTree`` or a ``Refusal``, seconds of drafter compute, per item the
        drafter version that drafted it: 0 the one the worker was built with, or a refusal)."""
        t0 = time.perf_counter()
        out: list = [None] * len(items)
        groups: dict[str, list[tuple[int, str, Seed, TreeSpec]]] = {}
        for i, (rid, seed, tree) in enumerate(items):
            try:
                engine = self._engine(rid)
                if isinstance(seed, pb.Seed):
                    dims = {"feature_dim": len(engine.taps) * engine.embed.weight.shape[1]} if engine.taps else {}
                    seed = wire.seed_from_proto(seed, vocab_size=self.vocab_size, **dims)
                s = engine.sessions[rid]
                if s.provisional_len:
                    engine.publish(rid)  # a new seed: the previous round was published
                if seed.start_position != s.committed_len:
                    raise ValueError(
                        f"seed.start_position: {seed.start_position} != draft context length {s.committed_len}"
                    )
                groups.setdefault(self.session_method[rid], []).append((i, rid, seed, tree))
            except ValueError as err:
                out[i] = Refusal.of(err)
        for method, members in groups.items():
            trees = self.engines[method].propose_batch([(rid, seed, tree) for _, rid, seed, tree in members])
            for (i, *_), tree in zip(members, trees):
                out[i] = tree
        versions = [0 if isinstance(t, Refusal) else self.version_of(rid) for (rid, _, _), t in zip(items, out)]
        return out, time.perf_counter() - t0, versions

    def publish(self, request_id: str) -> None:
        self._engine(request_id).publish(request_id)

    def close_session(self, request_id: str) -> bool:
        method = self.session_method.pop(request_id, None)
        if method is not None:
            self.engines[method].close_session(request_id)
        return method is not None

    def leak_check(self) -> dict:
        engine_ids = {rid for e in self.engines.values() for rid in e.sessions}
        allocated = sum(e.kv_slots_allocated() for e in self.engines.values())
        nbytes = sum(e.kv_bytes_allocated() for e in self.engines.values())
        return {
            "worker": self.name,
            "live_sessions": len(self.session_method),
            "kv_slots_allocated": allocated,
            "kv_bytes_allocated": nbytes,
            "kv_bytes_spare": sum(e.kv.spare_nbytes for e in self.engines.values()),  # kept for the next request
            "orphans": sorted(engine_ids ^ set(self.session_method)),
            "ok": engine_ids == set(self.session_method) and (allocated == 0) == (not self.session_method),
        }

    def _engine(self, request_id: str) -> DrafterEngine:
        if request_id not in self.session_method:
            raise ValueError(f"request_id: {request_id!r} has no live draft session")
        return self.engines[self.session_method[request_id]]
