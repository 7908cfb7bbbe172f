"""In-process Eyas: one target, its drafters, and ``generate`` from a validated request.

This is what the CLI, the benches and the tests call. The Ray actors (``eyas.actors``) wrap the same
engines; nothing here holds state that the engines do not own.
"""

from __future__ import annotations

import os
import uuid
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from eyas import compute
from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.drafting.manifest import load_drafter
from eyas.drafting.model import DrafterConfig, drafter_feature_address, init_drafter
from eyas.drafting.suffix import SharedSuffixCache, SuffixSpec
from eyas.generate import GenerationResult, generate, keeps_answer, stop_ids_for
from eyas.protocol.schema import GenerateRequest
from eyas.protocol.text import AnswerText
from eyas.scheduler.gate import DrafterGate
from eyas.step import SUFFIX, suffix_tree_spec
from eyas.target.config import FeatureTap, TargetConfig
from eyas.target.engine import TargetEngine
from eyas.target.loader import (
    DEFAULT_TARGET,
    LoadedTarget,
    TargetFingerprint,
    encode_prompt,
    load_target,
    request_prompt_ids,
)
from eyas.target.precision import quantize_fp16_weights
from eyas.verification.grammar import GrammarCompiler, Grammars

REPO_DRAFTERS = Path(__file__).resolve().parents[1] / "drafters"
DEFAULT_DRAFTER_DIRS = {"eagle1": "smollm2-135m-eagle1", "hass": "smollm2-135m-hass", "eagle3": "smollm2-135m-eagle3"}
# A serving method's drafter architecture: HASS changes training only (design 0x07C), so it serves as EAGLE-1.
ARCHITECTURE = {"eagle1": "eagle1", "hass": "eagle1", "eagle3": "eagle3"}
# The default tree at fp16w (fbgemm, CPU only), in place of a manifest's larger one: a cost-aware
# EAGLE-2 tree (eyas.drafting.tree, "value floors"). On this CPU every verify row is a full pass of
# the weights' arithmetic: a verify of 2 rows costs 1.12 one-row forwards, 6 rows 1.35-1.39, 7 rows
# 1.57 (2 threads, a 300-token context), and each drafting step about 0.095 (the drafter's weights
# come back from DRAM after every target forward). So a node is verified only when its path value (the
# drafter's estimate that the target accepts it) is at least 0.06, and a node is expanded only at
# 0.35. Measured on all 80 MT-bench first turns, 40 tokens, EAGLE-3 (stage 5's drafter), against
# fp16w target-only in the same run (bench/results/trees-fp16w-floors.json): 3/4/6 with floors
# 0.06/0.35 1.18x (tau 1.64), 3/4/4 with 0.06/0.45 1.17x, 3/3/3 with 0.06/0.6 1.17x, plain 2/2/4
# (the default before) 1.13x (tau 1.72, 4 rows every round). Re-measured with stage 12's drafter
# (bench/results/trees-fp16w-stage12.json): this tree 1.18x (tau 1.68); lower floors and deeper trees
# raise tau (3/4/8 with 0.04/0.3: 1.73; 3/5/7 with 0.05/0.25: 1.73) but cost more than it buys
# (1.14-1.15x), plain 2/4/8 0.88x (tau 1.91). A request's own knobs still win.
FP16W_DEFAULT_TREE = TreeSpec(
    kind="dynamic", expand_width=3, max_depth=4, verify_budget=6, min_value=0.06, expand_min_value=0.35
)


@dataclass
class DrafterHandle:
    engine: DrafterEngine
    taps: tuple[FeatureTap, ...]
    source: str  # checkpoint folder, or "random-init" (untrained)
    default_tree: TreeSpec


def make_drafter(
    method: str,
    path: str | None,
    cfg: TargetConfig,
    fingerprint: TargetFingerprint,
    embed: nn.Embedding,
    lm_head: nn.Module,
    precision: str,
    dtype: torch.dtype = torch.float32,
) -> DrafterHandle:
    """The drafter of ``method`` for the target with ``cfg``/``fingerprint``: the checkpoint at
    ``path`` (default: the shipped one; refused if trained for another target), or a random one with
    a warning when none is shipped. ``embed``/``lm_head`` are the target's own (not owned here); at
    ``fp16w`` the drafter's linears hold fp16 weights too and the default tree is at most
    :data:`FP16W_DEFAULT_TREE`. ``dtype``: the target's compute dtype, which the drafter takes too
    (it reads the target's features), on the target's device; the int8 draft head is a float32-only
    CPU path."""
    folder = Path(path) if path else REPO_DRAFTERS / DEFAULT_DRAFTER_DIRS[method]
    if path or (folder / "manifest.json").exists():
        drafter, manifest = load_drafter(folder, fingerprint)
        if manifest.method != ARCHITECTURE[method]:
            raise ValueError(f"drafter: {folder} holds a {manifest.method} drafter, not {ARCHITECTURE[method]}")
        taps, source = manifest.taps(), str(folder)
        default_tree = TreeSpec(**manifest.tree_abi.default_tree)
    else:
        warnings.warn(f"no trained {method} drafter at {folder}; using an untrained (random) one", stacklevel=2)
        arch = ARCHITECTURE[method]
        drafter = init_drafter(DrafterConfig.for_target(arch, cfg))
        taps = drafter_feature_address(drafter.cfg, cfg)
        source, default_tree = "random-init", TreeSpec()
    if precision == "fp16w":
        quantize_fp16_weights(drafter)  # drafting precision moves acceptance only, never the output
        default_tree = smaller_tree(default_tree, FP16W_DEFAULT_TREE)
    elif precision == "gguf":
        gguf_drafter(drafter)
        default_tree = smaller_tree(default_tree, FP16W_DEFAULT_TREE)
    drafter = drafter.to(device=embed.weight.device, dtype=dtype)
    int8_head = dtype == torch.float32 and embed.weight.device.type == "cpu"  # fbgemm: a CPU-only path
    return DrafterHandle(
        DrafterEngine(drafter, embed, lm_head, int8_head=int8_head, taps=taps), taps, source, default_tree
    )


def gguf_drafter(drafter: nn.Module) -> nn.Module:
    """A drafter beside a ``gguf`` target, in place: its linears as Q4_1 blocks (the GGUF's own layers'
    type) through the gguf kernels, its decoder layer fused (``eyas.target.quantized``). Q4_1 over Q8_0:
    a drafter step reads 7.8 MB instead of 13.7, from DRAM each round (the target's pass evicts it); on
    all 80 MT-bench first turns (128 tokens, EAGLE-3) τ 1.761 against 1.770 and a round's drafting
    0.84x (``docs/benchmarks.md``). Drafting precision moves acceptance only, never an output."""
    from eyas.target.quantized import Q4_1, FusedDraftLayer, blocks_on_huge_pages, quantize_linears

    quantize_linears(drafter, Q4_1)
    blocks_on_huge_pages(drafter)  # as the target's
    if FusedDraftLayer.fits(drafter.layer):
        drafter.layer.fused = FusedDraftLayer(drafter.layer)
    return drafter


def smaller_tree(tree: TreeSpec, cap: TreeSpec) -> TreeSpec:
    """``tree`` with each EAGLE-2 knob (width, depth, budget) at most ``cap``'s, and each value
    floor at least ``cap``'s."""
    return replace(
        tree,
        expand_width=min(tree.expand_width, cap.expand_width),
        max_depth=min(tree.max_depth, cap.max_depth),
        verify_budget=min(tree.verify_budget, cap.verify_budget),
        min_value=max(tree.min_value, cap.min_value),
        expand_min_value=max(tree.expand_min_value, cap.expand_min_value),
    )


def set_threads(threads: int | None = None) -> None:
    """Torch's CPU threads, on this thread and on the process's compute thread (``eyas.compute``)."""
    n = threads or int(os.environ.get("EYAS_THREADS", "0")) or os.cpu_count() or 1
    torch.set_num_threads(n)
    compute.run(torch.set_num_threads, n)


class Eyas:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        precision: str = "fp32",
        loaded: LoadedTarget | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        prefix_cache_bytes: int = 0,
        shared_suffix_tokens: int = 0,
    ):
        """``dtype``: the compute dtype at precision fp32 (float32, bfloat16, float16); ``device``:
        where the target and its drafters compute (cpu, cuda, cuda:N; not yet run on a GPU);
        ``prefix_cache_bytes``: the target engines' prefix cache across ``generate`` calls (0: off);
        ``shared_suffix_tokens``: earlier answers (this many tokens, the oldest evicted first) that
        later calls' suffix drafts may copy from, as a serving loop's do (0: each call its own history
        only; an answer of a request with ``learn: false`` is never kept)."""
        from eyas.target.prefix_cache import PrefixCache

        self.prefix_cache = PrefixCache(prefix_cache_bytes)  # checked before the load, naming the knob
        self.shared_suffix = SharedSuffixCache(shared_suffix_tokens) if shared_suffix_tokens else None
        # per drafter: the gate of its grafted requests (eyas.scheduler.gate), round costs kept across requests
        self.drafter_gates: dict[tuple[str, str | None], DrafterGate] = {}
        self.loaded = loaded or load_target(target, precision, device=device, dtype=dtype)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.grammars = Grammars(  # structured output's cursors, the compiler built on first use
            lambda: GrammarCompiler(self.tokenizer, self.cfg.vocab_size, list(self.cfg.eos_token_ids))
        )
        self.cfg = self.model.cfg
        self._drafters: dict[tuple[str, str | None], DrafterHandle] = {}
        self._targets: dict[tuple[FeatureTap, ...], TargetEngine] = {}

    # --- tokens -----------------------------------------------------------------------------------
    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, raw)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- engines ----------------------------------------------------------------------------------
    def target_engine(self, taps: tuple[FeatureTap, ...]) -> TargetEngine:
        if taps not in self._targets:
            self._targets[taps] = TargetEngine(self.model, taps, self.prefix_cache)
        return self._targets[taps]

    def drafter(self, method: str, path: str | None = None) -> DrafterHandle:
        key = (method, path)
        if key in self._drafters:
            return self._drafters[key]
        handle = make_drafter(
            method,
            path,
            self.cfg,
            self.loaded.fingerprint,
            self.model.embed,
            self.model.lm_head,
            self.loaded.precision,
            self.model.embed.weight.dtype,
        )
        self._drafters[key] = handle
        return handle

    # --- generate ---------------------------------------------------------------------------------
    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        return request_prompt_ids(self.tokenizer, req, self.cfg.vocab_size)[0]

    def tree_for(self, req: GenerateRequest, handle: DrafterHandle | None) -> TreeSpec:
        return tree_for(req, handle.default_tree if handle else TreeSpec())

    def generate(self, req: GenerateRequest) -> tuple[GenerationResult, dict]:
        ids = self.prompt_ids(req)
        stop_ids = stop_ids_for(
            self.cfg.eos_token_ids,
            ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids,
            vocab_size=self.cfg.vocab_size,
        )
        sampling = req.to_sampling_params(stop_ids)
        handle = None if req.method in ("target", SUFFIX) else self.drafter(req.method, req.drafter)
        suffix = SuffixSpec() if req.method == SUFFIX or req.suffix_drafts else None
        tree = self.tree_for(req, handle) if req.method != SUFFIX else suffix_tree_spec(suffix)
        engine = self.target_engine(handle.taps if handle else ())
        stops = AnswerText(self.tokenizer, req.stop, req.min_tokens)
        result = generate(
            engine,
            ids,
            shared_suffix=self.shared_suffix,
            gate=self.drafter_gates.setdefault((req.method, req.drafter), DrafterGate()) if req.suffix_drafts else None,
            max_new_tokens=req.max_new_tokens,
            sampling=sampling,
            drafter=handle.engine if handle else None,
            suffix=suffix,
            tree=tree,
            seed=req.seed,
            request_id=req.request_id or uuid.uuid4().hex,
            on_tokens=stops.on_tokens,
            grammar=self.grammars.cursor(sampling.grammar),
            stop_ids=stop_ids,
        )
        if self.shared_suffix is not None and keeps_answer(result.finish_reason, req.learn):
            self.shared_suffix.add(result.token_ids)
        return result, self.report(req, result, handle, tree)

    def report(self, req: GenerateRequest, r: GenerationResult, handle: DrafterHandle | None, tree: TreeSpec) -> dict:
        return build_report(
            req,
            r,
            AnswerText.of(self.tokenizer, r.token_ids, req.stop, req.min_tokens),
            self.loaded.precision,
            handle.source if handle else None,
            tree,
        )


def tree_for(req: GenerateRequest, base: TreeSpec) -> TreeSpec:
    """The request's tree: its own knobs where given, else the drafter's defaults ``base``."""
    return TreeSpec(
        kind=req.tree_kind,
        expand_width=req.tree_width if req.tree_width is not None else base.expand_width,
        max_depth=req.tree_depth if req.tree_depth is not None else base.max_depth,
        verify_budget=req.tree_budget if req.tree_budget is not None else base.verify_budget,
        min_value=req.tree_min_value if req.tree_min_value is not None else base.min_value,
        expand_min_value=req.tree_expand_min_value if req.tree_expand_min_value is not None else base.expand_min_value,
    )


def build_report(
    req: GenerateRequest, r: GenerationResult, text: str, precision: str, drafter: str | None, tree: TreeSpec | None
) -> dict:
    """The machine-readable output of ``eyas generate --json`` (in-process and over ``--server``)."""
    return {
        "method": req.method,
        "suffix_drafts": req.suffix_drafts,
        "token_ids": r.token_ids,
        "text": text,
        "new_tokens": len(r.token_ids),
        "target_forwards": r.target_forwards,
        "accept_length_mean": r.accept_length_mean,
        "wall_s": r.wall_s,
        "tokens_per_s": len(r.token_ids) / r.wall_s if r.wall_s > 0 else 0.0,
        "finish_reason": r.finish_reason,
        "seed": req.seed,
        "prefill_s": r.prefill_s,
        "draft_s": r.draft_s,
        "verify_s": r.verify_s,
        "hop_s": r.hop_s,
        "drafter_fallback": r.drafter_fallback,
        "drafter_reseeds": r.drafter_reseeds,
        "drafter_version": r.drafter_version,
        "cached_tokens": r.cached_tokens,
        "precision": precision,
        "drafter": drafter if req.method not in ("target", SUFFIX) else None,
        "tree": None
        if req.method == "target" or tree is None
        else {
            "kind": tree.kind,
            "expand_width": tree.expand_width,
            "max_depth": tree.max_depth,
            "verify_budget": tree.verify_budget,
            "min_value": tree.min_value,
            "expand_min_value": tree.expand_min_value,
        },
        "rounds": [
            {
                "accept_length": x.accept_length,
                "new_tokens": x.new_tokens,
                "tree_nodes": x.tree_nodes,
                "draft_ms": 1000 * x.draft_s,
                "verify_ms": 1000 * x.verify_s,
            }
            for x in r.rounds
        ],
    }
