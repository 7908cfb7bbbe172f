"""Eyas's CPU kernels for fp16w (eyas/kernels): equal to a reference, row-invariant, refusing bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eyas import kernels
from eyas.target.precision import quantize_fp16_weights
from tests.testing import assert_verify_rows_equal_decodes, ours_from_hf, tiny_hf


@pytest.mark.parametrize("n, kdim", [(960, 576), (2, 8), (64, 1536)])
def test_linear_equals_a_float64_product_of_the_fp16_weights_for_any_number_of_rows(k, n, kdim):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, kdim, generator=gen) * 0.05
    packed = k.pack_f16w(w.half())
    assert packed.dtype == torch.int16  # fp16 bits, left alone by a module's .to(dtype)
    for rows in (1, 2, 5, 6, 7, 13, 40):
        x = torch.randn(rows, kdim, generator=gen)
        y = k.linear_f16w(x, packed)
        ref = (x.double() @ w.half().double().T).float()
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert (y - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_linear_rows_are_bit_for_bit_their_one_row_calls(k):
    """Row-invariance: each row of a 13-row call (two passes of six and a tail of one) is exactly the
    one-row call of that row; fbgemm's fp16 GEMM, for comparison, is not guaranteed to be."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 576, generator=gen) * 0.05
    packed = k.pack_f16w(w.half())
    x = torch.randn(13, 576, generator=gen)
    y = k.linear_f16w(x, packed)
    for i in range(13):
        assert torch.equal(k.linear_f16w(x[i : i + 1].contiguous(), packed)[0], y[i]), f"row {i}"
        assert torch.equal(k.linear_f16w(x[: i + 1].contiguous(), packed)[i], y[i]), f"row {i} of {i + 1}"


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda k: k.pack_f16w(torch.zeros(3, 8, dtype=torch.float16)), "weight: N must be even"),
        (lambda k: k.pack_f16w(torch.zeros(2, 12, dtype=torch.float16)), "weight: N must be even and K a multiple"),
        (lambda k: k.pack_f16w(torch.zeros(2, 8)), "weight: expected"),
        (lambda k: k.linear_f16w(torch.zeros(1, 16), k.pack_f16w(torch.zeros(2, 8, dtype=torch.float16))), "x: 16"),
        (lambda k: k.linear_f16w(torch.zeros(1, 8, dtype=torch.float64), torch.zeros(1, 1, 2, 8)), "x: expected"),
        (lambda k: k.linear_f16w(torch.zeros(1, 8), torch.zeros(1, 1, 2, 8)), "packed: expected"),
    ],
)
def test_linear_refuses_bad_input_naming_it(k, call, problem):
    with pytest.raises(RuntimeError, match=problem):
        call(k)


def attention_inputs(seed: int, B=2, H=9, Hkv=3, T=5, S=70, D=64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen)
    keys, values = torch.randn(B, Hkv, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen)
    mask = torch.rand(B, T, S, generator=gen) > 0.4
    mask[..., 0] = True
    return q, keys, values, mask


def test_attend_equals_pytorch_attention_with_and_without_a_mask(k):
    q, keys, values, mask = attention_inputs(0)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)
    assert (k.attend(q, keys, values, mask, 64**-0.5) - ref).abs().max().item() < 1e-5
    ref = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    assert (k.attend(q, keys, values, None, 64**-0.5) - ref).abs().max().item() < 1e-5
    store = torch.randn(3, 3, 200, 64)  # keys and values as views into a larger store (strided)
    kv, vv = store[:2, :, :70], store[:2, :, 100:170]
    ref = F.scaled_dot_product_attention(q, kv, vv, attn_mask=mask[:, None], enable_gqa=True)
    assert (k.attend(q, kv, vv, mask, 64**-0.5) - ref).abs().max().item() < 1e-5


def test_attend_rows_are_bit_for_bit_their_one_row_calls_over_their_visible_keys(k):
    """A row attends over the slots its mask shows, in order: the same row alone, over just those
    keys and values (compacted, no mask), gives the same bits, which is what a one-row decode of a
    verified token computes once its ancestors are committed. A row with no visible slot is zeros."""
    q, keys, values, mask = attention_inputs(1)
    mask[1, 2] = False
    out = k.attend(q, keys, values, mask, 64**-0.5)
    for b in range(2):
        for t in range(5):
            idx = mask[b, t].nonzero().squeeze(1)
            if idx.numel() == 0:
                assert out[b, :, t].abs().max().item() == 0
                continue
            alone = k.attend(
                q[b : b + 1, :, t : t + 1].contiguous(),
                keys[b : b + 1, :, idx].contiguous(),
                values[b : b + 1, :, idx].contiguous(),
                None,
                64**-0.5,
            )
            assert torch.equal(alone[0, :, 0], out[b, :, t]), (b, t)


@pytest.mark.parametrize(
    "fields, problem",
    [
        (dict(mask=torch.ones(2, 5, 69, dtype=torch.bool)), "mask: expected"),
        (dict(mask=torch.ones(2, 5, 70)), "mask: expected"),
        (dict(q=torch.zeros(2, 9, 5, 64, dtype=torch.float64)), "expected float32"),
        (dict(q=torch.zeros(2, 8, 5, 64)), "heads a multiple of kv heads"),
        (
            dict(q=torch.zeros(2, 9, 5, 12), keys=torch.zeros(2, 3, 70, 12), values=torch.zeros(2, 3, 70, 12)),
            "head_dim",
        ),
    ],
)
def test_attend_refuses_bad_input_naming_it(k, fields, problem):
    q, keys, values, mask = attention_inputs(2)
    args = dict(q=q, keys=keys, values=values, mask=mask) | fields
    with pytest.raises(RuntimeError, match=problem):
        k.attend(args["q"], args["keys"], args["values"], args["mask"], 0.125)


def test_an_fp16w_verify_is_bit_for_bit_the_one_row_decodes_it_stands_for(k):
    """With the kernels, fp16w is row-invariant end to end: a 6-row chain verified in one forward
    gives, row by row, exactly the logits of decoding the same tokens one at a time (fbgemm's GEMM
    and PyTorch's attention only promise the last bits)."""
    m = quantize_fp16_weights(ours_from_hf(tiny_hf("llama", hidden=64, heads=4, kv_heads=2, seed=5)))
    assert all(a.kernels is not None for a in m.modules() if hasattr(a, "row_stable"))
    assert_verify_rows_equal_decodes(m, [3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9])


def test_a_switched_off_kernel_leaves_fp16w_on_fbgemm(monkeypatch):
    """EYAS_CPU_KERNELS=0 (or a CPU or machine that cannot run them): fp16w is fbgemm's, as before."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    monkeypatch.setenv(kernels.SWITCH_ENV, "0")
    assert kernels.unavailable_reason() == f"{kernels.SWITCH_ENV}=0"
    m = quantize_fp16_weights(ours_from_hf(tiny_hf("llama")), use_kernels=False)
    assert isinstance(m.lm_head, DynamicLinear) and all(
        a.kernels is None for a in m.modules() if hasattr(a, "row_stable")
    )


def test_a_trees_verify_rows_in_one_call_are_flatten_trees_and_the_verify_mask(k):
    """``kernels.flatten_tree`` (the gguf target's verify plan) gives ``flatten_tree``'s FlatTree field
    for field and the verify mask (the committed context, then the ancestor-or-self relation) over
    chains, wide trees, one node and random trees; a node before its parent is refused by name."""
    from eyas.protocol.tree import DraftTree, flatten_tree

    gen = torch.Generator().manual_seed(3)
    shapes = [[-1], [-1, 0, 1, 2, 3], [-1, -1, -1, -1], [-1, 0, -1, 2, 0, 1]]
    for _ in range(20):  # random trees, parents before children
        n = int(torch.randint(1, 14, (1,), generator=gen))
        shapes.append([int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)])
    for parents in shapes:
        depths = []
        for p in parents:
            depths.append(1 if p == -1 else depths[p] + 1)
        n = len(parents)
        tree = DraftTree(
            tokens=torch.randperm(1000, generator=gen)[:n],
            parents=torch.tensor(parents),
            depths=torch.tensor(depths),
            draft_probs=torch.rand(n, generator=gen),
        )
        for context in (0, 1, 37):
            want = flatten_tree(tree, 7, context)
            got = k.flatten_tree(tree.tokens, tree.parents, tree.depths, tree.draft_probs, 7, context, context)
            fields = ("tokens", "positions", "parents", "depths", "tree_mask", "retrieve", "draft_probs")
            for name, value in zip(fields, got):
                assert torch.equal(value, getattr(want, name)), (parents, context, name)
            mask = torch.cat([torch.ones(n + 1, context, dtype=torch.bool), want.tree_mask], dim=1)
            assert torch.equal(got[7], mask), (parents, context)
    with pytest.raises(RuntimeError, match="parents must precede children"):
        k.flatten_tree(torch.tensor([5, 6]), torch.tensor([1, -1]), torch.tensor([2, 1]), torch.rand(2), 7, 0, 0)
