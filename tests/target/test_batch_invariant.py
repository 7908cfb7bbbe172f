"""Half precision made batch-invariant: a verify row computes bit for bit what a one-row decode of
the same token computes (make_batch_invariant), so greedy speculative output equals target-only."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from eyas.target.layers import RowInvariantLinear, row_invariant_linear
from eyas.target.precision import make_batch_invariant
from tests.testing import ours_from_hf, tiny_hf


def test_a_row_invariant_linear_is_the_linear_and_one_row_runs_as_two():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).bfloat16()
    x = torch.randn(5, 40, generator=g).bfloat16()
    assert torch.equal(row_invariant_linear(x, w), nn.functional.linear(x, w))
    one = x[2:3]
    assert torch.equal(row_invariant_linear(one, w), nn.functional.linear(torch.cat([one, one]), w)[:1])
    assert row_invariant_linear(one[0], w).shape == (24,)


def chain_logits(model, prompt: list[int], chain: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a verify of ``chain`` in one call, the same tokens decoded one at a time): logits [T, V] each."""
    n, T = len(prompt), len(chain)
    cache = model.allocate_cache(1, n + T)
    with torch.no_grad():
        model(
            torch.tensor([prompt]), torch.arange(n)[None], cache, 0, torch.ones(n, n, dtype=torch.bool).tril()[None], ()
        )
        alone = copy.deepcopy(cache)
        mask = torch.ones(1, T, n + T, dtype=torch.bool)
        mask[0, :, n:] = torch.ones(T, T, dtype=torch.bool).tril()
        verify = model(torch.tensor([chain]), torch.arange(n, n + T)[None], cache, n, mask, ()).logits[0]
        decode = torch.stack(
            [
                model(torch.tensor([[t]]), torch.tensor([[n + i]]), alone, n + i, None, ()).logits[0, 0]
                for i, t in enumerate(chain)
            ]
        )
    return verify, decode


def test_every_verify_row_equals_its_one_row_decode_at_bfloat16():
    for hf in (tiny_hf("llama", hidden=64, layers=3, seed=4), tiny_hf("qwen3_moe", seed=2)):
        model = make_batch_invariant(ours_from_hf(hf).to(torch.bfloat16))
        assert all(type(m) is not nn.Linear for m in model.modules())
        assert any(isinstance(m, RowInvariantLinear) for m in model.modules())
        prompt = list(range(3, 40))
        chain = [5, 9, 2, 33, 17, 8, 41, 12, 6, 30, 1, 22]
        verify, decode = chain_logits(model, prompt, chain)
        assert torch.equal(verify, decode)


def test_load_target_makes_a_half_precision_target_batch_invariant_and_leaves_float32_alone(tmp_path):
    from eyas.target.loader import load_target, load_tokenizer

    tiny_hf("llama", seed=3).save_pretrained(tmp_path)
    load_tokenizer().save_pretrained(tmp_path)
    half = load_target(tmp_path, dtype="bfloat16").model
    assert all(layer.attn.row_stable for layer in half.layers)
    assert isinstance(half.lm_head, RowInvariantLinear)
    full = load_target(tmp_path).model
    assert not any(layer.attn.row_stable for layer in full.layers)
    assert type(full.lm_head) is nn.Linear
