"""Drafter networks: EAGLE-1 (seed 0x03) and EAGLE-3 (seed 0x08B).

Terms:
- *state*: the d-wide vector a draft row reads besides its token. For a row whose feature comes
  from the target it is the target feature (EAGLE-1) or the learned reduction of the three tapped
  features ``r_t = W_R [f_low; f_mid; f_high]`` (EAGLE-3). For a row the drafter generated it is
  the drafter's own output for the parent row (predicted feature / draft state).
- *draft row t* reads ``[state_t ; E(x_{t+1})]`` (``2d``), fuses it with ``W_F``/``W_I`` to ``d``, runs
  one decoder layer with its own KV cache and outputs ``h_{t+1}``: EAGLE-1's predicted feature
  ``f^_{t+1}`` (mapped by the frozen target LM head to the distribution of ``x_{t+2}``), or
  EAGLE-3's draft state (normed, then a draft-vocabulary head, mapped by ``d2t`` to target ids).

The frozen target embedding and LM head are passed in; the drafter owns neither (seed 0x03A).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn

from eyas.target.model import DecoderLayer, KVCache, RMSNorm, RotaryTable, Segment, TargetConfig, head_rows

METHODS = ("eagle1", "eagle3")
FULL_VOCAB = 0  # draft_vocab_size value meaning "the target's whole vocabulary"


@dataclass(frozen=True)
class DrafterConfig:
    method: str                 # "eagle1" | "eagle3"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    num_taps: int               # target features per row: 1 (EAGLE-1) or 3 (EAGLE-3)
    draft_vocab_size: int = FULL_VOCAB

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"drafter_config.method: {self.method!r} is not one of {METHODS}")
        if self.method == "eagle1" and (self.num_taps != 1 or self.draft_vocab_size != FULL_VOCAB):
            raise ValueError("drafter_config: eagle1 reads one feature tap and the full target vocabulary")
        if self.method == "eagle3" and self.num_taps != 3:
            raise ValueError("drafter_config.num_taps: eagle3 fuses three feature taps")
        if not 0 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"drafter_config.draft_vocab_size: {self.draft_vocab_size} is outside "
                             f"[0, {self.target_vocab_size}]")

    @classmethod
    def for_target(cls, method: str, target: TargetConfig, draft_vocab_size: int | None = None) -> "DrafterConfig":
        if draft_vocab_size is None:
            draft_vocab_size = min(8192, target.vocab_size) if method == "eagle3" else FULL_VOCAB
        return cls(method=method, hidden_size=target.hidden_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
                   target_vocab_size=target.vocab_size, num_taps=1 if method == "eagle1" else 3,
                   draft_vocab_size=draft_vocab_size)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.target_vocab_size


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.reduce = nn.Linear(cfg.num_taps * d, d, bias=False) if cfg.num_taps > 1 else None
        # The state and the token embedding are normalised before fusion (as EAGLE-3's reference
        # does): on SmolLM2 a tapped state has RMS 2-55 against 0.14 for an embedding, and an
        # unnormalised concatenation drowns the token that disambiguates the branch (seed 0x02).
        self.state_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fuse = nn.Linear(2 * d, d, bias=cfg.method == "eagle1")
        self.layer = DecoderLayer(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                  cfg.rms_norm_eps)
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
        return self.embed_norm.weight.dtype

    def allocate_cache(self, max_slots: int) -> KVCache:
        c = self.cfg
        w = self.embed_norm.weight
        return KVCache.allocate(1, 1, c.num_kv_heads, max_slots, c.head_dim, w.dtype, w.device)

    def target_state(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., num_taps * d] target taps -> [..., d] state (EAGLE-3 reduction W_R)."""
        assert features.shape[-1] == self.cfg.num_taps * self.cfg.hidden_size, "features: [..., num_taps*d]"
        return self.reduce(features) if self.reduce is not None else features

    def forward(self, state: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """One pass of the draft decoder.

        state: [B, T, d]; token_embeds: [B, T, d] (frozen E(x_{t+1})); positions: [B, T] int64;
        mask: [B, T, start+T] bool. Returns the output state h: [B, T, d].
        """
        assert state.ndim == 3 and state.shape == token_embeds.shape, "state/token_embeds: [B, T, d] each"
        fused = self.fuse(torch.cat([self.state_norm(state), self.embed_norm(token_embeds)], dim=-1))  # [B, T, d]
        cos, sin = self.rope(positions)
        return self.layer(fused, cos, sin, cache, 0, start, mask)

    def forward_packed(self, segments: list[tuple[torch.Tensor, torch.Tensor, Segment]]) -> list[torch.Tensor]:
        """Several requests' draft rows in one pass, each against its own draft KV and mask.

        segments: (state [T_i, d], token_embeds [T_i, d], Segment with positions/cache/start/mask;
        its ``tokens`` are unused). Returns each segment's output state [T_i, d].
        """
        placed, lo = [], 0
        for state, embeds, seg in segments:
            t = state.shape[0]
            assert state.ndim == 2 and state.shape == embeds.shape and seg.positions.shape == (t,)
            placed.append(dataclasses.replace(seg, rows=(lo, lo + t)))
            lo += t
        state = torch.cat([x[0] for x in segments])[None]
        embeds = torch.cat([x[1] for x in segments])[None]
        fused = self.fuse(torch.cat([self.state_norm(state), self.embed_norm(embeds)], dim=-1))  # [1, T, d]
        cos, sin = self.rope(torch.cat([s.positions for s in placed])[None])
        out = self.layer.forward_segments(fused, cos, sin, placed, 0)[0]
        return [out[a:b] for a, b in (s.rows for s in placed)]

    def logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """hidden: [..., d] -> draft logits [..., out_vocab] (draft-vocabulary ids for EAGLE-3)."""
        if self.head is not None:
            return head_rows(self.head, self.norm(hidden)).float()
        return head_rows(target_lm_head, hidden).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids] if self.head is not None else draft_ids


def init_drafter(cfg: DrafterConfig, seed: int = 0) -> Drafter:
    """A randomly initialised drafter (small normal weights), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    model = Drafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()
    return model
