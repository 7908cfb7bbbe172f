"""The target engine's publish transaction (design 0x05D)."""

from __future__ import annotations

import pytest
import torch

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree
from eyas.target.config import eagle1_feature_address
from eyas.target.engine import TargetEngine

PROMPT = [5, 9, 2, 33, 17]


def tree(tokens, parents, depths):
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.full((len(tokens),), 0.5))


def prefilled(model, rid="r"):
    eng = TargetEngine(model, eagle1_feature_address(model.cfg))
    eng.open_session(rid, PROMPT, max_new_tokens=8, max_tree_rows=8)
    v = eng.prefill(rid)
    frontier = int(v.logits[-1].argmax())
    seed, ack = eng.publish(rid, v.round, AcceptDecision(torch.arange(len(PROMPT)), torch.tensor(PROMPT[1:]), frontier))
    return eng, seed, ack


def snapshot(eng, rid="r"):
    s = eng.sessions[rid]
    k, v = eng.committed_kv(rid)
    return (s.committed_len, list(s.tokens), s.frontier_token, k.clone(), v.clone())


def same(a, b):
    return a[:3] == b[:3] and torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])


def test_prefill_seed_and_frontier(tiny_target):
    eng, seed, ack = prefilled(tiny_target)
    s = eng.sessions["r"]
    assert s.committed_len == len(PROMPT) and ack.output_tokens == (s.frontier_token,)
    assert seed.advanced_tokens.tolist() == PROMPT[1:] + [s.frontier_token]
    assert seed.features.shape == (len(PROMPT), tiny_target.cfg.hidden_size) and seed.start_position == 0


def test_publication_fixture_rows_0_and_2(tiny_target):
    """Seed 0x09 publication fixture: accepted flat rows [0, 2] -> target KV rows [0, 2].

    Tree: root (frontier) at row 0; A (row 1) and B (row 2) both children of the root. Accepting
    B commits provisional slots n+0 and n+2 onto n, n+1; the frontier token is emitted separately
    and becomes the root row of the next round (append required), not a committed row.
    """
    eng, _, _ = prefilled(tiny_target)
    s = eng.sessions["r"]
    n, root = s.committed_len, s.frontier_token
    v = eng.verify("r", tree([20, 21], [PARENT_IS_ROOT, PARENT_IS_ROOT], [1, 1]))
    row_k = eng.kv.k[:, s.kv_row]  # [L, H_kv, slots, hd]: this request's KV row
    prov_k = row_k[:, :, n : n + 3].clone()
    features = v.features.clone()
    decision = AcceptDecision(torch.tensor([0, 2]), torch.tensor([21]), frontier_token=7)
    seed, ack = eng.publish("r", v.round, decision)
    assert torch.equal(row_k[:, :, n], prov_k[:, :, 0])
    assert torch.equal(row_k[:, :, n + 1], prov_k[:, :, 2])
    assert torch.equal(seed.features, features[[0, 2]])
    assert ack.output_tokens == (21, 7) and s.committed_len == n + 2 and s.frontier_token == 7
    assert s.tokens[-2:] == [root, 21]  # the frontier 7 is emitted, not committed
    assert seed.advanced_tokens.tolist() == [21, 7] and seed.start_position == n


def test_duplicate_publish_is_a_noop(tiny_target):
    eng, _, _ = prefilled(tiny_target)
    v = eng.verify("r", tree([20], [PARENT_IS_ROOT], [1]))
    d = AcceptDecision(torch.tensor([0, 1]), torch.tensor([20]), 3)
    _, ack1 = eng.publish("r", v.round, d)
    before = snapshot(eng)
    _, ack2 = eng.publish("r", v.round, d)
    assert ack1 == ack2 and same(before, snapshot(eng))


@pytest.mark.parametrize("round_delta", [-1, 1])
def test_stale_or_future_round_is_refused(tiny_target, round_delta):
    eng, _, _ = prefilled(tiny_target)
    eng.publish("r", 0, AcceptDecision(torch.arange(len(PROMPT)), torch.tensor(PROMPT[1:]), 1))  # dup: no-op
    v = eng.verify("r", tree([20], [PARENT_IS_ROOT], [1]))
    before = snapshot(eng)
    stale = v.round + round_delta if round_delta > 0 else v.round - 2
    with pytest.raises(ValueError, match="round"):
        eng.publish("r", stale, AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 3))
    assert same(before, snapshot(eng))


@pytest.mark.parametrize("bad", ["rows_past_tree", "tokens_mismatch", "frontier_oov"])
def test_bad_decision_leaves_committed_state_unchanged(tiny_target, bad):
    eng, _, _ = prefilled(tiny_target)
    v = eng.verify("r", tree([20, 21], [PARENT_IS_ROOT, 0], [1, 2]))
    before = snapshot(eng)
    d = {
        "rows_past_tree": AcceptDecision(torch.tensor([0, 1, 5]), torch.tensor([20, 21]), 3),
        "tokens_mismatch": AcceptDecision(torch.tensor([0, 1]), torch.tensor([99]), 3),
        "frontier_oov": AcceptDecision(torch.tensor([0, 1]), torch.tensor([20]), 10**6),
    }[bad]
    with pytest.raises(ValueError):
        eng.publish("r", v.round, d)
    assert same(before, snapshot(eng))
    # the round is still pending and a correct decision still publishes
    _, ack = eng.publish("r", v.round, AcceptDecision(torch.tensor([0, 1]), torch.tensor([20]), 3))
    assert ack.committed_len == before[0] + 2


def test_session_input_validation(tiny_target):
    eng = TargetEngine(tiny_target, ())
    with pytest.raises(ValueError, match="prompt"):
        eng.open_session("a", [], 4, 1)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.open_session("a", [1, 10**6], 4, 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.open_session("a", [1], 0, 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.open_session("a", [1], 10**6, 1)
    assert eng.sessions == {}


def test_verify_before_publish_is_refused(tiny_target):
    eng, _, _ = prefilled(tiny_target)
    eng.verify("r", DraftTree.empty())
    with pytest.raises(ValueError, match="round"):
        eng.verify("r", DraftTree.empty())
