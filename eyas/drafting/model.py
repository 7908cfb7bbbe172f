"""Drafter networks: EAGLE-1 (design 0x03) and EAGLE-3 (design 0x08B), in two layouts.

Terms:
- *state*: the d-wide vector a draft row reads besides its token. For a row whose feature comes
  from the target it is the target feature (EAGLE-1) or the learned reduction of the three tapped
  features ``r_t = W_R [f_low; f_mid; f_high]`` (EAGLE-3). For a row the drafter generated it is
  the drafter's own output for the parent row (predicted feature / draft state).
- *draft row t* reads ``state_t`` and the frozen embedding ``E(x_{t+1})``, runs one decoder layer
  with its own KV cache and outputs ``h_{t+1}``: EAGLE-1's predicted feature ``f^_{t+1}`` (mapped by
  the frozen target LM head to the distribution of ``x_{t+2}``), or EAGLE-3's draft state (normed,
  then a draft-vocabulary head, mapped by ``d2t`` to target ids).
- *layout*: how that layer combines the two inputs.
  - ``reference``: the ecosystem's layout (SafeAILab EAGLE, SpecForge/SGLang, vLLM speculators),
    so that a drafter can be exported to and imported from them (``eyas.drafting.interop``).
    EAGLE-1: ``x = W_F [E(x); state] + b`` then the layer with no input norm (layer 0 of the
    reference has none). EAGLE-3: ``x = [input_norm(E(x)); hidden_norm(state)]`` (2d) feeds q/k/v
    directly, the residual is the un-normed state, then ``o_proj + residual``, post-attention norm,
    MLP, residual; EAGLE-3 taps are the *un-normed* residual streams entering layers 2, L//2, L-3.
  - ``eyas-v1``: the layout Eyas's first drafters were trained in: ``x = W_F [norm(state);
    norm(E(x))]`` (2d -> d) then a standard pre-norm decoder layer; EAGLE-3 taps through the
    target's final norm. No reference can load it; it stays loadable for those checkpoints.

The frozen target embedding and LM head are passed in; the drafter owns neither (design 0x03A).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from eyas.target.batch_kv import BatchKV, BatchRows, RowGroup
from eyas.target.config import FeatureTap, TargetConfig, eagle1_feature_address, eagle3_feature_address
from eyas.target.layers import MLP, Attention, KVCache, RMSNorm, RotaryTable, head_rows

METHODS = ("eagle1", "eagle3")
REFERENCE, EYAS_V1 = "reference", "eyas-v1"
LAYOUTS = (REFERENCE, EYAS_V1)
FULL_VOCAB = 0  # draft_vocab_size value meaning "the target's whole vocabulary"
# SafeAILab's EAGLE-1 network fixes its rotary base; a reference-layout EAGLE-1 drafter uses it too
# (its positions are its own, whatever the target's base), so that it can be exported there.
SAFEAILAB_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class DrafterConfig:
    method: str  # "eagle1" | "eagle3"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    num_taps: int  # target features per row: 1 (EAGLE-1) or 3 (EAGLE-3)
    draft_vocab_size: int = FULL_VOCAB
    layout: str = REFERENCE  # "reference" | "eyas-v1" (module docstring)
    # reference EAGLE-3 only: an RMSNorm of its own per tap before fc (SpecForge's and speculators'
    # ``fc_norm``), so that fc does not read SmolLM2's raw massive activations
    fc_norm: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"drafter_config.method: {self.method!r} is not one of {METHODS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"drafter_config.layout: {self.layout!r} is not one of {LAYOUTS}")
        if self.method == "eagle1" and (self.num_taps != 1 or self.draft_vocab_size != FULL_VOCAB):
            raise ValueError("drafter_config: eagle1 reads one feature tap and the full target vocabulary")
        if self.fc_norm and (self.method, self.layout) != ("eagle3", REFERENCE):
            raise ValueError("drafter_config.fc_norm: only a reference-layout EAGLE-3 drafter has per-tap norms")
        if self.method == "eagle3" and self.num_taps != 3:
            raise ValueError("drafter_config.num_taps: eagle3 fuses three feature taps")
        if not 0 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"drafter_config.draft_vocab_size: {self.draft_vocab_size} is outside [0, {self.target_vocab_size}]"
            )

    @classmethod
    def for_target(
        cls,
        method: str,
        target: TargetConfig,
        draft_vocab_size: int | None = None,
        layout: str = REFERENCE,
        fc_norm: bool = False,
    ) -> DrafterConfig:
        if draft_vocab_size is None:
            draft_vocab_size = min(8192, target.vocab_size) if method == "eagle3" else FULL_VOCAB
        return cls(
            method=method,
            hidden_size=target.hidden_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=SAFEAILAB_ROPE_THETA if (method, layout) == ("eagle1", REFERENCE) else target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            target_vocab_size=target.vocab_size,
            num_taps=1 if method == "eagle1" else 3,
            draft_vocab_size=draft_vocab_size,
            layout=layout,
            fc_norm=fc_norm,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.target_vocab_size


def drafter_feature_address(cfg: DrafterConfig, target: TargetConfig) -> tuple[FeatureTap, ...]:
    """The target taps a drafter of this method and layout reads (recorded in its manifest)."""
    if cfg.method == "eagle1":
        return eagle1_feature_address(target)
    return eagle3_feature_address(target, normed=cfg.layout == EYAS_V1)


class DraftLayer(nn.Module):
    """The drafter's one decoder layer: ``h = residual + attn(x)``, then ``h + MLP(mlp_norm(h))``.

    ``x`` (what q/k/v read, ``d_in`` wide) and ``residual`` (d) come from the layout; with
    ``attn_norm`` the layer norms ``x`` first (a standard pre-norm layer, the eyas-v1 layout).
    """

    def __init__(
        self, d: int, d_in: int, heads: int, kv_heads: int, head_dim: int, ffn: int, eps: float, attn_norm: bool
    ):
        super().__init__()
        self.attn_norm = RMSNorm(d_in, eps) if attn_norm else None
        self.attn = Attention(d, heads, kv_heads, head_dim, d_in=d_in)
        self.mlp_norm = RMSNorm(d, eps)
        self.mlp = MLP(d, ffn)
        self.fused = None  # gguf's fused kernels for this layer (eyas.target.quantized.FusedDraftLayer)

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn_norm(x) if self.attn_norm is not None else x

    def forward(self, x, residual, cos, sin, cache, start, mask):  # x: [B, T, d_in]; residual: [B, T, d]
        h = residual + self.attn(self._pre(x), cos, sin, cache, 0, start, mask)
        return h + self.mlp(self.mlp_norm(h))

    def forward_batch(self, x, residual, cos, sin, kv, plan):  # x: [1, N, d_in]; residual: [1, N, d]
        if self.fused is not None:
            return self.fused.forward_batch(x, residual, cos, sin, kv, plan)
        h = residual + self.attn.forward_batch(self._pre(x), cos, sin, kv, plan, 0)
        return h + self.mlp(self.mlp_norm(h))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.reduce = nn.Linear(cfg.num_taps * d, d, bias=False) if cfg.num_taps > 1 else None
        self.tap_norms = (
            nn.ModuleList([RMSNorm(d, cfg.rms_norm_eps) for _ in range(cfg.num_taps)]) if cfg.fc_norm else None
        )  # reference: fc_norm.{i}
        reference_eagle3 = cfg.layout == REFERENCE and cfg.method == "eagle3"
        if cfg.layout == EYAS_V1 or reference_eagle3:
            # The state and the token embedding are normalised (EAGLE-3's reference does it, and so
            # did eyas-v1 for both methods): on SmolLM2 a tapped state has RMS 2-55 against 0.14 for
            # an embedding, and an unnormalised concatenation drowns the token (design 0x02).
            self.state_norm = RMSNorm(d, cfg.rms_norm_eps)  # reference: hidden_norm
            self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)  # reference: input_layernorm
        else:
            self.state_norm, self.embed_norm = None, None
        # EAGLE-1 (both layouts) and eyas-v1 EAGLE-3 fuse 2d -> d before the layer; reference EAGLE-3 does not
        self.fuse = None if reference_eagle3 else nn.Linear(2 * d, d, bias=cfg.method == "eagle1")
        self.layer = DraftLayer(
            d,
            2 * d if reference_eagle3 else d,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            attn_norm=cfg.layout == EYAS_V1,
        )
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        if cfg.method == "eagle3":
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.head = nn.Linear(d, cfg.out_vocab, bias=False)
            # d2t[i]: target id of draft id i; t2d[v]: whether target id v is in the draft vocabulary
            self.register_buffer("d2t", torch.arange(cfg.out_vocab, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
            self.t2d[self.d2t] = True
        else:
            self.norm, self.head = None, None

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:  # [Vd] int64 target ids, distinct
        assert d2t.shape == self.d2t.shape and d2t.dtype == torch.int64, "d2t: [Vd] int64"
        if d2t.unique().numel() != d2t.numel() or int(d2t.min()) < 0 or int(d2t.max()) >= self.cfg.target_vocab_size:
            raise ValueError("d2t: must map draft ids to distinct target ids inside the vocabulary")
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[d2t] = True

    @property
    def dtype(self) -> torch.dtype:
        """The drafter's activation dtype (read from a norm: its Linears may hold packed fp16 weights)."""
        return self.layer.mlp_norm.weight.dtype

    def allocate_cache(self, max_slots: int) -> KVCache:
        c = self.cfg
        w = self.layer.mlp_norm.weight
        return KVCache.allocate(1, 1, c.num_kv_heads, max_slots, c.head_dim, w.dtype, w.device)

    def target_state(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., num_taps * d] target taps -> [..., d] state (EAGLE-3 reduction W_R)."""
        assert features.shape[-1] == self.cfg.num_taps * self.cfg.hidden_size, "features: [..., num_taps*d]"
        if self.tap_norms is not None:
            features = torch.cat(
                [norm(x) for norm, x in zip(self.tap_norms, features.chunk(self.cfg.num_taps, -1))], -1
            )
        return self.reduce(features) if self.reduce is not None else features

    def layer_input(self, state: torch.Tensor, token_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) of the draft layer for the layout (module docstring): state, token_embeds
        [..., d] -> x [..., d_in], residual [..., d]."""
        if self.fuse is None:  # reference EAGLE-3
            return torch.cat([self.embed_norm(token_embeds), self.state_norm(state)], dim=-1), state
        if self.state_norm is None:  # reference EAGLE-1
            fused = self.fuse(torch.cat([token_embeds, state], dim=-1))
        else:  # eyas-v1
            fused = self.fuse(torch.cat([self.state_norm(state), self.embed_norm(token_embeds)], dim=-1))
        return fused, fused

    def forward(
        self,
        state: torch.Tensor,
        token_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One pass of the draft decoder.

        state: [B, T, d]; token_embeds: [B, T, d] (frozen E(x_{t+1})); positions: [B, T] int64;
        mask: [B, T, start+T] bool. Returns the output state h: [B, T, d].
        """
        assert state.ndim == 3 and state.shape == token_embeds.shape, "state/token_embeds: [B, T, d] each"
        x, residual = self.layer_input(state, token_embeds)
        cos, sin = self.rope(positions)
        return self.layer(x, residual, cos, sin, cache, start, mask)

    def allocate_store(self) -> BatchKV:
        """An empty K/V store for a drafter engine's live requests (one layer; its dtype and device)."""
        c = self.cfg
        w = self.layer.mlp_norm.weight
        return BatchKV(1, c.num_kv_heads, c.head_dim, w.dtype, w.device)

    def forward_batch(
        self, kv: BatchKV, groups: list[tuple[torch.Tensor, torch.Tensor, RowGroup]]
    ) -> list[torch.Tensor]:
        """Several requests' draft rows in one pass over the engine's one K/V store, with one
        attention call for all of them (``eyas.target.batch_kv``: a padded query grid and one mask
        with each request's causal prefix and tree ancestry; no row sees another request's keys).

        groups: (state [T_i, d], token_embeds [T_i, d], RowGroup: KV row, positions, start, mask).
        Returns each group's output state [T_i, d]."""
        for state, embeds, g in groups:
            assert state.ndim == 2 and state.shape == embeds.shape and g.positions.shape == (state.shape[0],)
        plan = BatchRows.build([g for _, _, g in groups], kv.device)
        kv.fit(plan.num_kv_rows, plan.key_len)  # the store grows with what is written, within the budgets
        state = torch.cat([x[0] for x in groups])[None]
        embeds = torch.cat([x[1] for x in groups])[None]
        x, residual = self.layer_input(state, embeds)  # [1, N, d_in], [1, N, d]
        cos, sin = self.rope(plan.positions[None], plan.max_position)  # host-known: no device read
        out = self.layer.forward_batch(x, residual, cos, sin, kv, plan)[0]
        return [out[a:b] for a, b in plan.bounds]

    def logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """hidden: [..., d] -> draft logits [..., out_vocab] (draft-vocabulary ids for EAGLE-3)."""
        if self.head is not None:
            return head_rows(self.head, self.norm(hidden)).float()
        return head_rows(target_lm_head, hidden).float()

    def top_children(
        self, hidden: torch.Tensor, k: int, target_lm_head: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [P, d] -> the top-k draft ids [P, k] and their probabilities, in one kernel call where
        the head is GGUF blocks (``gguf``: ``QLinear.top_k``, the norm fused); None elsewhere (the caller
        takes the logits, ``softmax`` and ``topk``)."""
        from eyas.target.quantized import QLinear

        head = self.head if self.head is not None else target_lm_head
        if type(head) is not QLinear or head.bias is not None or hidden.dtype != torch.float32:
            return None
        return head.top_k(hidden, k, self.norm if self.head is not None else None)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids] if self.head is not None else draft_ids


def init_drafter(cfg: DrafterConfig, seed: int = 0) -> Drafter:
    """A randomly initialised drafter (small normal weights), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    model = Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight") and p.ndim == 1:  # every RMSNorm, tap_norms.{i} too
                p.fill_(1.0)
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()
    return model
