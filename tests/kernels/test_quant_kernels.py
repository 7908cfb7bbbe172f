"""The gguf precision's kernels (eyas/kernels/quant.cpp, eyas/target/quantized.py): GGUF blocks as they
are, llama.cpp's arithmetic (Q8 activations, integer dot products), row-invariant end to end, refusing
bad input by name; the default target's own blocks read exactly as transformers dequantizes them."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from eyas import kernels
from eyas.target.layers import KVCache
from eyas.target.quantized import BLOCK_BYTES, Q4_0, Q4_1, Q8_0, Blocks, QLinear, quantize_gguf
from tests.testing import assert_verify_rows_equal_decodes, ours_from_hf, tiny_hf

QTYPES = (Q4_0, Q4_1, Q8_0)


def q8_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels quantize it (per row, per 32: scale absmax / 127, round half to even), float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # float32 product, as the kernel computes it; round half to even
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [96, 50, 7])
def test_linear_equals_q8_activations_times_the_dequantized_blocks(k, qtype, n):
    """Any number of rows (one pass, several, a tail) and of outputs (whole groups of lanes or not)."""
    gen = torch.Generator().manual_seed(n + qtype)
    w = torch.randn(n, 576, generator=gen) * 0.05
    blocks = Blocks.quantize(w, qtype)
    assert blocks.data.shape == (n, 576 // 32 * BLOCK_BYTES[qtype])
    dense = blocks.dequantize().double()
    layer = QLinear(blocks)
    for rows in (1, 3, 4, 5, 8, 9, 17):
        x = torch.randn(rows, 576, generator=gen)
        y = layer(x)
        ref = q8_reference(x) @ dense.T
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert (y.double() - ref).abs().max().item() < 1e-5, (rows, (y.double() - ref).abs().max().item())


@pytest.mark.parametrize("qtype", QTYPES)
def test_blocks_round_trip_within_their_step(qtype):
    gen = torch.Generator().manual_seed(qtype)
    w = torch.randn(40, 128, generator=gen)
    back = Blocks.quantize(w, qtype).dequantize()
    b = w.reshape(40, 4, 32)
    if qtype == Q8_0:  # 255 levels over [-amax, amax]: half a step
        bound = b.abs().amax(-1) / 127 * 0.5
    elif qtype == Q4_1:  # 16 levels over [min, max]: half a step
        bound = (b.amax(-1) - b.amin(-1)) / 15 * 0.5
    else:  # Q4_0: levels d * (-8..7), d = amax / 8: the far end of the range is clipped by up to a step
        bound = b.abs().amax(-1) / 8
    assert ((back.reshape(40, 4, 32) - b).abs() <= bound[..., None] * 1.01 + 1e-3).all()


def test_linear_rows_are_bit_for_bit_their_one_row_calls(k):
    gen = torch.Generator().manual_seed(3)
    layer = QLinear(Blocks.quantize(torch.randn(3072, 576, generator=gen) * 0.05, Q4_1))
    x = torch.randn(13, 576, generator=gen)
    y = layer(x)
    for i in range(13):
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1]), f"row {i}"
        assert torch.equal(layer(x[: i + 1])[i], y[i]), f"row {i} of {i + 1}"


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda k: k.quantize_weight(torch.zeros(2, 40), Q8_0), "w: 40 inputs, not a multiple of 32"),
        (lambda k: k.quantize_weight(torch.zeros(2, 32), 5), "qtype: 5 is not"),
        (lambda k: k.repack(torch.zeros(2, 33, dtype=torch.uint8), Q8_0, 32), "weight: 33 bytes a row"),
        (
            lambda k: k.linear_q(torch.zeros(1, 64), k.repack(k.quantize_weight(torch.zeros(4, 32), 8), 8, 32), 8, 4),
            "weight: ",
        ),
        (
            lambda k: k.linear_q(torch.zeros(1, 32, dtype=torch.float64), torch.zeros(1, 34, dtype=torch.uint8), 8, 1),
            "x: expected",
        ),
        (
            lambda k: k.linear_q(torch.zeros(1, 32), k.repack(k.quantize_weight(torch.zeros(4, 32), 8), 8, 32), 8, 400),
            "cannot hold 400",
        ),
    ],
)
def test_the_kernels_refuse_bad_input_naming_it(k, call, problem):
    with pytest.raises(RuntimeError, match=problem):
        call(k)


@pytest.mark.parametrize("with_norm", [True, False])
def test_a_heads_top_k_in_one_call_is_softmax_topk_of_its_logits_row_by_row(k, with_norm):
    """QLinear.top_k (the drafter's children at gguf): the norm, the head and each row's top k in one
    kernel call give the ids ``softmax(head(norm(x))).topk(k)`` gives and their probabilities up to float
    rounding (a vocabulary of 1,000, not a multiple of the SIMD width), each row the same alone as
    beside others; a k outside [1, N] is refused naming it."""
    from eyas.target.layers import RMSNorm

    gen = torch.Generator().manual_seed(7)
    head = QLinear(Blocks.quantize(torch.randn(1000, 64, generator=gen) * 0.3, Q8_0))
    norm = RMSNorm(64, 1e-5) if with_norm else None
    if norm is not None:
        norm.weight.data = torch.rand(64, generator=gen) + 0.5
    x = torch.randn(5, 64, generator=gen) * 4
    ids, conf = head.top_k(x, 6, norm)
    logits = head(norm(x) if norm is not None else x)
    want_conf, want_ids = torch.softmax(logits, -1).topk(6, -1)
    assert torch.equal(ids, want_ids) and torch.allclose(conf, want_conf, rtol=1e-5, atol=1e-7)
    for i in range(5):
        one_ids, one_conf = head.top_k(x[i : i + 1], 6, norm)
        assert torch.equal(one_ids, ids[i : i + 1]) and torch.equal(one_conf, conf[i : i + 1])
    with pytest.raises(RuntimeError, match="k: 1001 is not in"):
        head.top_k(x, 1001)


def test_a_heads_top_k_breaks_ties_to_the_lower_id_wherever_they_sit(k):
    """The top k skip 8 logits at a time that cannot enter: equal logits (copies of one head row, early,
    in the middle, at the ragged end; a row of all-equal logits) still come lowest id first, with equal
    probabilities, and the k best are the k largest."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(203, 64, generator=gen) * 0.3
    for copy in (5, 100, 150, 202):
        w[copy] = w[2]
    head = QLinear(Blocks.quantize(w, Q8_0))
    x = torch.randn(3, 64, generator=gen) * 4
    x[2] = 0.0  # every logit equal
    logits = head(x)
    ids, conf = head.top_k(x, 6)
    for r in range(3):
        row = logits[r]
        # the reference order: value descending, then id ascending
        want = sorted(range(row.numel()), key=lambda i: (-row[i].item(), i))[:6]
        assert ids[r].tolist() == want, (r, ids[r].tolist(), want)
        for a, b in zip(want, want[1:]):
            if row[a] == row[b]:
                assert conf[r, want.index(a)] == conf[r, want.index(b)]
    assert ids[2].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_gguf_verify_is_bit_for_bit_the_one_row_decodes_it_stands_for_in_both_fused_paths(k):
    """Per-layer fusion (head_dim 16: attention through the per-row kernel between two fused calls)
    and the whole forward in one call (head_dim 32)."""
    per_layer = ours_from_hf(tiny_hf("llama", hidden=64, heads=4, kv_heads=2, seed=5))
    quantize_gguf(per_layer)
    assert per_layer.fused is None and all(layer.fused is not None for layer in per_layer.layers)
    assert_verify_rows_equal_decodes(per_layer, [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9])
    whole = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, seed=5))
    origin = quantize_gguf(whole)
    assert whole.fused is not None
    assert origin["lm_head"] == "Q8_0 (quantized)" and origin["layers.0.mlp.w_down"] == "Q4_1 (quantized)"
    assert_verify_rows_equal_decodes(whole, [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9])
    # head_dim 64, four query heads a K/V head: a 24-row verify scores its Q8 keys through the transposing
    # gathers (24 units a task), each decode by rows (4 units; the AVX-512 build): the same bits
    wide = ours_from_hf(tiny_hf("llama", hidden=256, heads=4, kv_heads=1, seed=6))
    quantize_gguf(wide)
    assert wide.fused is not None and wide.key_layout == (torch.uint8, 72)
    assert_verify_rows_equal_decodes(wide, [(7 * i + 3) % 64 for i in range(37)], [(5 * i + 1) % 64 for i in range(24)])


def test_the_fused_forward_computes_what_the_quantized_modules_compute(k):
    """The one-call forward (RMSNorm, q/k/v, rotary, K/V write, attention, o, MLP in C++) against the
    same QLinear weights run module by module in PyTorch: the same model up to float rounding."""
    fused = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, seed=7, init_std=0.05))
    quantize_gguf(fused)
    modules = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, seed=7, init_std=0.05))
    quantize_gguf(modules)
    modules.fused = None
    for layer in modules.layers:
        layer.fused = None
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None]

    def logits(m, kv_dtype=None):
        c = m.cfg
        cache = KVCache.allocate(c.num_layers, 1, c.num_kv_heads, 8, c.head_dim, kv_dtype or m.kv_dtype, "cpu")
        return m(tokens, torch.arange(8)[None], cache, 0, mask, (), logits_rows="all").logits

    # the modules keep fp32 K/V; the one-call forward takes an fp32 store too (its own default is fp16)
    a, b = logits(fused, torch.float32), logits(modules)
    assert modules.kv_dtype == torch.float32 and fused.kv_dtype == torch.float16
    assert (a - b).abs().max().item() < 1e-5 * a.abs().max().item() + 1e-6
    # with fp16 keys and values, each rounded once: within fp16's rounding of the fp32 store's
    h = logits(fused)
    assert 0 < (h - a).abs().max().item() < 5e-2 * a.abs().max().item()
    # its own store (TargetModel.key_layout): keys in Q8 blocks, scored in integers, values fp16
    assert fused.key_layout == (torch.uint8, fused.cfg.head_dim * 9 // 8) and modules.key_layout[0] == torch.float32
    cache = fused.allocate_cache(1, 8)
    assert cache.k.dtype == torch.uint8 and cache.v.dtype == torch.float16
    q8 = fused(tokens, torch.arange(8)[None], cache, 0, mask, (), logits_rows="all").logits
    assert 0 < (q8 - a).abs().max().item() < 5e-2 * a.abs().max().item()
    # each first-layer key (the same inputs either way) dequantizes (int8 * its block's scale) to within
    # half a step of the fp32 store's
    fp32 = KVCache.allocate(
        fused.cfg.num_layers, 1, fused.cfg.num_kv_heads, 8, fused.cfg.head_dim, torch.float32, "cpu"
    )
    fused(tokens, torch.arange(8)[None], fp32, 0, mask, (), logits_rows="all")
    hd = fused.cfg.head_dim
    ints = cache.k[0, ..., :hd].view(torch.int8).float().unflatten(-1, (hd // 32, 32))
    scales = cache.k[0, ..., hd:].contiguous().view(torch.float32)[..., None]
    keys = fp32.k[0].unflatten(-1, (hd // 32, 32))
    assert ((ints * scales - keys).abs() <= 0.5 * scales + 1e-6).all() and (scales > 0).all()
    with pytest.raises(RuntimeError, match="kv_k, kv_v: "):  # a Q8 key store of the wrong width is refused
        bad = KVCache.allocate(
            fused.cfg.num_layers, 1, fused.cfg.num_kv_heads, 8, hd, torch.float16, "cpu", torch.uint8, hd + 8
        )
        fused(tokens, torch.arange(8)[None], bad, 0, mask, (), logits_rows="all")


@pytest.mark.real_model
def test_the_default_gguf_blocks_dequantize_bit_for_bit_to_the_served_fp32_weights(k):
    """The GGUF's Q4_1 layers and Q8_0 head, read as they are (q/k rows put back in HF's order), equal
    transformers' dequantized checkpoint exactly: the gguf precision computes with the very weights
    fp32 serves, kept at 4 and 8 bits."""
    from eyas.target.loader import DEFAULT_TARGET, checkpoint_folder, load_target
    from eyas.target.quantized import gguf_source, read_gguf_blocks

    fp32 = load_target(DEFAULT_TARGET, "fp32").model
    source = gguf_source(checkpoint_folder(DEFAULT_TARGET))
    blocks = read_gguf_blocks(source, fp32.cfg)
    assert blocks["lm_head"].qtype == Q8_0 and blocks["layers.0.attn.wqkv"].qtype == Q4_1
    assert len(blocks) == 4 * fp32.cfg.num_layers + 1
    for name in (
        "layers.0.attn.wqkv",
        "layers.7.attn.wo",
        "layers.15.mlp.w_gate_up",
        "layers.29.mlp.w_down",
        "lm_head",
    ):
        assert torch.equal(blocks[name].dequantize(), fp32.get_submodule(name).weight), name


@pytest.mark.skipif("avx512_vnni" not in kernels.cpu_flags(), reason="one build only: the CPU has no AVX-512 VNNI")
def test_a_heads_argmax_in_the_same_call_is_torch_argmax_of_its_logits(k):
    """QLinear.forward_argmax (the target's greedy token at gguf): the logits bit for bit those of
    ``forward``, and each row's index the one ``torch.argmax`` picks from them: the first of tied maxima,
    -0.0 tied with 0.0, the first NaN over any number, a row of -inf its first index; a vocabulary of
    1,001 (not a multiple of the SIMD width), so a maximum in the tail counts too."""
    gen = torch.Generator().manual_seed(11)
    head = QLinear(Blocks.quantize(torch.randn(1001, 64, generator=gen) * 0.3, Q8_0))
    x = torch.randn(6, 64, generator=gen) * 4
    logits, ids = head.forward_argmax(x)
    assert torch.equal(logits, head(x)) and torch.equal(ids, logits.argmax(-1)) and ids.dtype == torch.int64
    assert torch.equal(head.forward_argmax(x[None])[1], ids[None])  # leading dimensions kept
    rows = torch.randn(7, 1001, generator=gen)
    rows[0, [3, 700]] = 50.0  # tied maxima: the first
    rows[1, 1000] = 50.0  # the maximum in the tail past the last whole 8 lanes
    rows[2] = -torch.inf
    rows[3, [5, 9]] = torch.nan  # NaN counts as the maximum: the first NaN
    rows[4, 998] = torch.nan
    rows[5] = torch.zeros(1001)
    rows[5, :4] = -0.0  # -0.0 == 0.0: the first index
    rows[6, 500] = torch.inf
    assert torch.equal(k.argmax_rows(rows), rows.argmax(-1))
    for n in (1, 7, 8, 9, 31, 32, 33, 41):  # shorter than the 8 lanes, 8, past them; around the 32 a pass
        short = torch.randn(5, n, generator=gen)
        short[1, n // 2] = short[1, n - 1] = 9.0  # tied maxima: the first
        short[2, n - 1] = torch.nan
        assert torch.equal(k.argmax_rows(short), short.argmax(-1)), n
    with pytest.raises(RuntimeError, match="y: expected at least one column"):
        k.argmax_rows(torch.zeros(2, 0))


def test_the_kernels_rmsnorm_is_rmsnorm_row_by_row(k):
    """The gguf model's final norm in one call (FusedForward.norm): torch's RMSNorm up to float rounding,
    each row the same alone as beside others; a weight of the wrong width is refused naming it."""
    from eyas.target.layers import RMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(76, 1e-5)
    norm.weight.data = torch.rand(76, generator=gen) + 0.5
    x = torch.randn(9, 76, generator=gen) * 3
    y = k.rms_norm(x, norm.weight.detach(), 1e-5)
    assert torch.allclose(y, norm(x).detach(), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(k.rms_norm(x[i : i + 1], norm.weight.detach(), 1e-5), y[i : i + 1]) for i in range(9))
    with pytest.raises(RuntimeError, match="weight: expected \\[76\\] float32"):
        k.rms_norm(x, torch.ones(75), 1e-5)


def test_the_avx2_and_avx512_builds_compute_the_same_bits(k, tmp_path):
    """quant.cpp sums the same integers either way and scales them in the same order: the baseline
    build (EYAS_CPU_ISA=avx2, built here in a subprocess) gives this build's outputs bit for bit."""
    script = (
        "import sys, torch\n"
        "from eyas.target.quantized import Blocks, QLinear, quantize_gguf\n"
        "from tests.testing import ours_from_hf, tiny_hf\n"
        "g = torch.Generator().manual_seed(0)\n"
        "out = {}\n"
        "for qt in (2, 3, 8):\n"
        "    out[qt] = QLinear(Blocks.quantize(torch.randn(50, 576, generator=g) * 0.05, qt))(torch.randn(9, 576, generator=g))\n"
        "m = ours_from_hf(tiny_hf('llama', hidden=128, heads=4, kv_heads=2, seed=5))\n"
        "quantize_gguf(m)\n"
        "t = torch.tensor([[3, 1, 4, 1, 5, 9]])\n"
        "out['model'] = m(t, torch.arange(6)[None], m.allocate_cache(1, 6), 0, torch.ones(6, 6, dtype=torch.bool).tril()[None], (), logits_rows='all').logits\n"
        "w = ours_from_hf(tiny_hf('llama', hidden=256, heads=4, kv_heads=1, seed=6))\n"
        "quantize_gguf(w)\n"
        "t = torch.arange(40)[None] % 64\n"
        "c = w.allocate_cache(1, 44)\n"
        "w(t, torch.arange(40)[None], c, 0, torch.ones(40, 40, dtype=torch.bool).tril()[None], ())\n"
        "out['wide'] = w(torch.tensor([[5]]), torch.tensor([[40]]), c, 40, None, (), logits_rows='all').logits\n"
        "m3 = torch.ones(3, 44, dtype=torch.bool).tril(41)[None]\n"  # 12 (row, head) units: AVX2 scores by rows
        "out['wide3'] = w(torch.tensor([[6, 7, 8]]), torch.arange(41, 44)[None], c, 41, m3, (), logits_rows='all').logits\n"
        "from eyas import kernels\n"
        "out['isa'] = kernels.isa()\n"
        "torch.save(out, sys.argv[1])\n"
    )
    results = {}
    for isa in ("avx2", "avx512-vnni"):
        path = tmp_path / f"{isa}.pt"
        env = {**__import__("os").environ, kernels.ISA_ENV: isa}
        subprocess.run(
            [sys.executable, "-c", script, str(path)], check=True, env=env, cwd=str(kernels.SOURCES[0].parents[2])
        )
        results[isa] = torch.load(path)
    assert results["avx2"]["isa"] == "avx2" and results["avx512-vnni"]["isa"] == "avx512-vnni"
    for key in (2, 3, 8, "model", "wide", "wide3"):
        assert torch.equal(results["avx2"][key], results["avx512-vnni"][key]), key


@pytest.mark.parametrize("method, layout", [("eagle3", "reference"), ("eagle1", "reference"), ("eagle3", "eyas-v1")])
def test_a_fused_draft_layer_computes_what_its_quantized_modules_compute(k, method, layout):
    """A drafter beside a gguf target (Q4_1 blocks, its layer fused: with its own input norm, or
    reading the reference EAGLE-3 layer's pre-normed [E(x); state]) against the same blocks run
    module by module: the same draft states up to float rounding, over a context and a tree step."""
    from eyas.drafting.model import DrafterConfig, init_drafter
    from eyas.runtime import gguf_drafter
    from eyas.target.batch_kv import RowGroup
    from eyas.target.config import TargetConfig

    target = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, seed=2)).cfg
    assert isinstance(target, TargetConfig)
    outs = []
    for fused in (True, False):
        d = gguf_drafter(init_drafter(DrafterConfig.for_target(method, target, layout=layout), seed=4))
        assert d.layer.fused is not None
        if not fused:
            d.layer.fused = None
        kv = d.allocate_store()
        row = kv.open_row("r", 16)
        gen = torch.Generator().manual_seed(1)
        state, embeds = torch.randn(6, 128, generator=gen), torch.randn(6, 128, generator=gen) * 0.1
        ctx = d.forward_batch(
            kv,
            [
                (
                    state,
                    embeds,
                    RowGroup(row, torch.arange(6), torch.arange(6), 0, torch.ones(6, 6, dtype=torch.bool).tril()),
                )
            ],
        )[0]
        step = d.forward_batch(
            kv,
            [
                (
                    ctx[-2:],
                    embeds[:2],
                    RowGroup(
                        row,
                        torch.arange(2),
                        torch.tensor([6, 6]),
                        6,
                        torch.cat([torch.ones(2, 6, dtype=torch.bool), torch.eye(2, dtype=torch.bool)], 1),
                    ),
                )
            ],
        )[0]
        outs.append(torch.cat([ctx, step]))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4 * outs[1].abs().max().item() + 1e-6


def _gguf_eagle3_engines(head_scale: float, n: int = 2):
    """A tiny llama target and ``n`` drafter engines over one reference EAGLE-3 drafter at gguf, its
    attention scaled to depend on positions and masks and its head by ``head_scale`` (logits spread beyond
    rounding). -> (target, engines)."""
    from eyas.drafting.engine import DrafterEngine
    from eyas.drafting.model import DrafterConfig, init_drafter
    from eyas.runtime import gguf_drafter

    target = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, seed=2))
    drafter = init_drafter(DrafterConfig.for_target("eagle3", target.cfg), seed=4)
    with torch.no_grad():
        drafter.layer.attn.wqkv.weight.mul_(25)
        drafter.head.weight.mul_(head_scale)
    gguf_drafter(drafter)
    return target, [DrafterEngine(drafter, target.embed, target.lm_head) for _ in range(n)]


def _random_seed(gen: torch.Generator, rows: int, start: int, round_: int, vocab: int):
    """A seed of ``rows`` random target features (3 taps of 128) and tokens from position ``start``."""
    from eyas.protocol.messages import Seed

    return Seed(
        torch.randn(rows, 3 * 128, generator=gen) * 3, torch.randint(0, vocab, (rows,), generator=gen), start, round_
    )


def test_a_fused_draft_step_drafts_what_the_python_path_drafts(k, monkeypatch):
    """A reference EAGLE-3 drafter at gguf grows its tree in one kernel call a step
    (``FusedDraftStep``): over a context, then steady rounds of 1 to 3 seed rows (dynamic and static trees), its trees are the
    Python path's (the same kernels called one by one), its draft K/V within float rounding of it,
    and an engine told not to fuse (or a drafter that cannot) takes the Python path, as does a seed of
    more than ``FUSED_SEED_ROWS`` rows (a long backlog; one of fewer, past the attention kernel's 32, fuses)."""
    import eyas.drafting.engine
    from eyas.drafting.engine import TreeSpec
    from eyas.drafting.model import DrafterConfig, init_drafter
    from eyas.runtime import gguf_drafter
    from eyas.target.quantized import FusedDraftStep

    target, (fused, python) = _gguf_eagle3_engines(head_scale=25)
    drafter = fused.drafter
    python.fuse_steps = False
    fused.native_trees = False  # a call a step here (the whole tree in one call: the next test)
    assert isinstance(fused.fused_step, FusedDraftStep) and python.fused_step is None
    calls, call = [], FusedDraftStep.__call__
    monkeypatch.setattr(FusedDraftStep, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a))
    gen = torch.Generator().manual_seed(5)
    dynamic, static = TreeSpec(kind="dynamic", expand_width=3, max_depth=4, verify_budget=8), TreeSpec(kind="static")
    start = 0
    monkeypatch.setattr(eyas.drafting.engine, "FUSED_SEED_ROWS", 40)  # within the tiny model's rotary table
    rounds = ((7, dynamic), (1, dynamic), (3, static), (41, dynamic), (33, dynamic), (2, dynamic), (1, static))
    for rnd, (rows, tree) in enumerate(rounds):
        seed = _random_seed(gen, rows, start, rnd, target.cfg.vocab_size)
        trees = []
        for engine in (fused, python):
            if rnd == 0:
                engine.open_session("r", 160)
            trees.append(engine.propose("r", seed, tree))
            engine.publish("r")
        assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents), rnd
        assert (trees[0].draft_probs - trees[1].draft_probs).abs().max().item() < 1e-3, rnd
        assert trees[0].num_nodes > 3
        start += rows
    # every round's seed in its first call (the context's 7 rows too) but the long one's, which took the Python path
    assert calls[0] == 7 and 41 not in calls and 33 in calls and len(calls) > 6
    # a swapped-in version drafts through a fused step of its own weights
    learned = init_drafter(DrafterConfig.for_target("eagle3", target.cfg), seed=9)
    learned.set_draft_vocab(drafter.d2t.clone())
    gguf_drafter(learned)
    fused.swap_drafter(learned)
    assert fused.fused_step is not None and fused.fused_step.weights[9] is learned.head.packed
    n = fused.sessions["r"].committed_len
    for a, b in ((fused.kv.k, python.kv.k), (fused.kv.v, python.kv.v)):
        a, b = a[0, 0, :, :n], b[0, 0, :, :n]
        assert (a - b).abs().max().item() < 1e-3 * b.abs().max().item()


def test_a_native_tree_is_the_stepwise_fused_trees_bit_for_bit(monkeypatch):
    """A whole EAGLE-2 dynamic tree in one kernel call (``FusedDraftStep.tree``, ``kernels.draft_tree``) is
    the tree the fused step grows a call a step under ``DynamicTreeBuilder``: the same tokens, parents,
    depths and confidences bit for bit, the same provisional rows and draft K/V, over plain trees and
    trees cut by value floors (growth ended early, nodes left out), a budget of 0 and a depth of 1; a
    static tree keeps the stepwise loop."""
    from eyas.drafting.engine import TreeSpec
    from eyas.target.quantized import FusedDraftStep

    target, (native, stepwise) = _gguf_eagle3_engines(head_scale=8)  # confidences of every size: floors bite
    stepwise.native_trees = False
    assert native.native_trees
    calls, tree_call = [], FusedDraftStep.tree
    monkeypatch.setattr(
        FusedDraftStep, "tree", lambda self, *a, **k: calls.append(a[0].shape[0]) or tree_call(self, *a, **k)
    )
    gen = torch.Generator().manual_seed(11)
    specs = [
        TreeSpec(kind="dynamic", expand_width=3, max_depth=4, verify_budget=8),
        TreeSpec(kind="dynamic", expand_width=3, max_depth=4, verify_budget=6, min_value=0.06, expand_min_value=0.35),
        TreeSpec(kind="dynamic", expand_width=4, max_depth=6, verify_budget=16, min_value=0.01, expand_min_value=0.05),
        TreeSpec(kind="dynamic", expand_width=2, max_depth=1, verify_budget=4),
        TreeSpec(kind="dynamic", expand_width=3, max_depth=4, verify_budget=0),
        TreeSpec(kind="static"),
    ]
    start, sizes = 0, []
    for rnd in range(18):
        rows = 9 if rnd == 0 else 1 + rnd % 3
        tree = specs[rnd % len(specs)]
        seed = _random_seed(gen, rows, start, rnd, target.cfg.vocab_size)
        trees = []
        for engine in (native, stepwise):
            if rnd == 0:
                engine.open_session("r", 200)
            trees.append(engine.propose("r", seed, tree))
        a, b = trees
        for field in ("tokens", "parents", "depths", "draft_probs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (rnd, field)
        sn, ss = native.sessions["r"], stepwise.sessions["r"]
        assert (sn.committed_len, sn.provisional_len) == (ss.committed_len, ss.provisional_len), rnd
        end = sn.committed_len + sn.provisional_len
        for x, y in ((native.kv.k, stepwise.kv.k), (native.kv.v, stepwise.kv.v)):
            assert torch.equal(x[0, sn.kv_row, :, :end], y[0, ss.kv_row, :, :end]), rnd
        sizes.append(a.num_nodes)
        for engine in (native, stepwise):
            engine.publish("r")
        start += rows
    assert len(calls) == 15 and calls[0] == 9  # every dynamic round in one call; the static ones stepwise
    assert min(sizes) == 0 and max(sizes) >= 8 and len(set(sizes)) >= 4  # empty, cut and full trees


def test_weights_on_huge_pages_are_copies_in_one_aligned_mapping_and_compute_the_same_bits(k, monkeypatch):
    """eyas.compute.on_huge_pages: equal copies, each 4 KB-aligned, end to end in one mapping whose first
    copy starts on a 2 MB boundary (what the kernel needs to back it with huge pages); a gguf model's
    blocks are moved there at quantize_gguf and compute what blocks left in place compute, bit for bit.
    EYAS_HUGE_PAGES=0 hands the tensors back as they are."""
    from eyas.compute import HUGE_PAGES_ENV, on_huge_pages
    from eyas.target.quantized import QLinear, quantize_gguf

    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 255, (n,), generator=gen, dtype=torch.uint8) for n in (5000, 3, 4096)]
    tensors.append(torch.randn(7, 9, generator=gen))
    copies = on_huge_pages(tensors)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(tensors, copies))
    ptrs = [c.data_ptr() for c in copies]
    assert ptrs[0] % (2 << 20) == 0 and all(p % 4096 == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] == 8192 + 4096 + 4096
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    assert all(a is b for a, b in zip(tensors, on_huge_pages(tensors)))
    t = torch.tensor([[3, 1, 4, 1, 5, 9]])
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(HUGE_PAGES_ENV, setting)
        m = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, seed=5))
        quantize_gguf(m)
        starts = sorted(q.packed.data_ptr() for q in m.modules() if isinstance(q, QLinear))
        assert (starts[0] % (2 << 20) == 0) == (setting == "1")
        mask = torch.ones(6, 6, dtype=torch.bool).tril()[None]
        logits[setting] = m(t, torch.arange(6)[None], m.allocate_cache(1, 6), 0, mask, (), logits_rows="all").logits
    assert torch.equal(logits["0"], logits["1"])


def test_a_build_the_compiler_cannot_make_falls_back_to_the_next():
    """A build that does not compile (here a made-up compiler flag) is said and the next build down
    for this CPU is loaded in its place, rather than the kernels going off (a subprocess: the kernels
    load once a process)."""
    script = (
        "from eyas import kernels\n"
        "expected = kernels.isa()\n"  # this CPU's best build
        "kernels.BUILDS = (('broken', (), ['-mno-such-flag-for-eyas']),) + kernels.BUILDS\n"
        "m = kernels.load()\n"
        "print('LOADED', m is not None, kernels.isa() == expected, kernels.why_not())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != kernels.ISA_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=str(kernels.SOURCES[0].parents[2]),
    )
    shutil.rmtree(kernels.build_directory("broken"), ignore_errors=True)
    loaded = next(line for line in out.stdout.splitlines() if line.startswith("LOADED"))
    assert loaded.split()[1:] == ["True", "True", "None"], out.stdout + out.stderr
    assert "broken kernels did not build" in out.stderr
