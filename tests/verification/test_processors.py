"""Logits processors (eyas.verification.processors): equal to the references one row at a time, each
verify row under its own path's history, and exact under speculation (greedy identity, sampled joint)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from eyas.generate import generate
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import DraftTree, flatten_tree
from eyas.target.engine import TargetEngine
from eyas.verification.processors import processed_logits
from eyas.verification.sampling import target_probs
from tests.test_generate import P_THRESHOLD, TREE, chi_square_p, engines, pair_counts

V = 50


def openai_penalized(logits: torch.Tensor, answer: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's documented formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for token in set(answer):
        c = answer.count(token)
        out[..., token] -= c * frequency + (c > 0) * presence
    return out


def paths(flat) -> list[list[int]]:
    """Each flat row's path tokens: the root's (the frontier), its ancestors' and its own."""
    tokens, parents, out = flat.tokens.tolist(), flat.parents.tolist(), []
    for row in range(flat.num_rows):
        path, walk = [tokens[row]], row
        while walk != 0:
            walk = parents[walk]
            path.insert(0, tokens[walk])
        out.append(path)
    return out


# root (frontier 7) -> a (5) -> b (7); root -> c (11)
TREE3 = DraftTree(torch.tensor([5, 7, 11]), torch.tensor([-1, 0, -1]), torch.tensor([1, 2, 1]), torch.ones(3))


def test_repetition_penalty_equals_transformers_processor_per_tree_row():
    """Every verify row: the repetition penalty equals HF's RepetitionPenaltyLogitsProcessor over the
    prompt, the answer so far and the row's path (the tokens vLLM penalizes too), above and below 1;
    a prefill's row over the prompt alone."""
    gen = torch.Generator().manual_seed(0)
    flat = flatten_tree(TREE3, frontier_token=7, base_position=10)
    logits = torch.randn(flat.num_rows, V, generator=gen) * 3
    prompt, answer = [3, 4, 4, 9], [9, 12, 12]
    for r in (1.3, 0.7):
        params = SamplingParams(repetition_penalty=r)
        ours = processed_logits(logits, flat, prompt, answer, params)
        for row, path in enumerate(paths(flat)):
            ref = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([prompt + answer + path]), logits[row : row + 1])
            assert torch.equal(ours[row : row + 1], ref), row
        first = processed_logits(logits[:1], None, prompt, [], params)
        assert torch.equal(first, RepetitionPenaltyLogitsProcessor(r)(torch.tensor([prompt]), logits[:1]))


def test_penalties_and_bias_follow_openai_per_tree_row():
    """Every verify row's processed logits are those of a one-row decode of its own path: the answer so
    far, the frontier (root row) and the row's ancestors and itself; the bias is added to every row."""
    gen = torch.Generator().manual_seed(1)
    flat = flatten_tree(TREE3, frontier_token=7, base_position=10)
    logits = torch.randn(flat.num_rows, V, generator=gen)
    answer = [5, 5, 2]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((2, 3.0), (40, -7.5)))
    ours = processed_logits(logits, flat, [1, 2, 3], answer, params)
    for row, path in enumerate(paths(flat)):
        biased = logits[row].clone()
        biased[2] += 3.0
        biased[40] -= 7.5
        assert torch.allclose(ours[row], openai_penalized(biased, answer + path, 0.5, 0.25)), row


def test_min_p_drops_tokens_below_its_share_of_the_top_and_never_the_argmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    probs = torch.softmax(logits, 1)[0]
    kept = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))[0] > 0
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist() == [True, True, False, False]
    assert target_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_no_processor_is_the_same_tensor():
    logits = torch.randn(2, V)
    assert processed_logits(logits, None, [1], [], SamplingParams(temperature=1.0, min_p=0.5)) is logits


PROCESSED = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=2.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(logit_bias=((1, 4.0), (2, -100.0), (3, 2.5))),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=1.2, logit_bias=((9, 1.0),)),
    SamplingParams(min_tokens=20, min_tokens_stop_ids=tuple(range(0, 40, 2))),
]


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
@pytest.mark.parametrize("sampling", PROCESSED, ids=lambda s: repr(s)[15:60])
def test_greedy_identity_with_processors(tiny_target, method, sampling):
    """Greedy speculative output with processors equals greedy target-only with the same processors,
    and the processors changed the answer (the test could fail)."""
    target, drafter = engines(tiny_target, method)
    changed = False
    for prompt in ([1, 2, 3], [7, 7, 7, 7, 7, 9, 30, 11]):
        plain = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=40, stop_ids=())
        base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=40, sampling=sampling, stop_ids=())
        spec = generate(target, prompt, max_new_tokens=40, sampling=sampling, drafter=drafter, stop_ids=())
        assert spec.token_ids == base.token_ids
        changed |= base.token_ids != plain.token_ids
    assert changed


PROMPT = [1, 2, 3]
SAMPLED = SamplingParams(
    temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5, logit_bias=((4, 1.5),)
)


@pytest.fixture(scope="module")
def small_vocab():
    from tests.testing import ours_from_hf, tiny_hf

    model = ours_from_hf(tiny_hf("llama", vocab=8, init_std=0.3, seed=5))
    target, drafter = engines(model, "eagle1", seed=1)
    return model, target, drafter


def joint(model, processed: bool) -> torch.Tensor:
    """P(x1, x2) of target-only sampling at SAMPLED (its processors by the references, or none), from
    plain forwards: [V, V]."""
    vocab = model.cfg.vocab_size

    def last_probs(ids, answer):
        cache = model.allocate_cache(1, len(ids))
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None]
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, 0, mask, ()).logits[0, -1:]
        return target_probs(_reference(logits, ids, answer) if processed else logits, SAMPLED)[0].double()

    p1 = last_probs(PROMPT, [])
    return torch.stack([p1[x] * last_probs(PROMPT + [x], [x]) for x in range(vocab)])


def _reference(logits: torch.Tensor, ids: list[int], answer: list[int]) -> torch.Tensor:
    """SAMPLED's processors by the references, in vLLM's order: bias, HF's repetition penalty over
    prompt + answer, OpenAI's penalties over the answer."""
    out = logits.clone()
    for token, bias in SAMPLED.logit_bias:
        out[:, token] += bias
    out = RepetitionPenaltyLogitsProcessor(SAMPLED.repetition_penalty)(torch.tensor([ids]), out)
    return openai_penalized(out, answer, SAMPLED.presence_penalty, SAMPLED.frequency_penalty)


def test_sampled_speculation_with_processors_matches_the_processed_target_joint(small_vocab):
    """The whole loop with EAGLE trees and every processor on, 1,500 draws of (x1, x2): chi-square
    against the joint of target-only sampling under the reference processors, p > 1e-3; the same
    draws against the unprocessed joint are refused (the processors matter here)."""
    model, target, drafter = small_vocab
    counts = pair_counts(target, PROMPT, model.cfg.vocab_size, sampling=SAMPLED, drafter=drafter, tree=TREE)
    assert chi_square_p(counts, joint(model, processed=True)) > P_THRESHOLD
    assert chi_square_p(counts, joint(model, processed=False)) < P_THRESHOLD


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_the_drafter_drafts_under_the_requests_processors(tiny_target, method):
    """The draft tree is grown for the processed distribution: a token the plain drafter proposes first
    never appears in a tree drafted under a -100 bias on it, and the greedy output is unchanged."""
    import torch

    from eyas.drafting.engine import TreeSpec
    from eyas.protocol.messages import AcceptDecision
    from eyas.verification.processors import draft_processor

    target, drafter = engines(tiny_target, method)
    prompt = [1, 2, 3, 4, 5]
    target.open_session("t", prompt, 8, 40)
    v = target.prefill("t")
    seed, _ = target.publish("t", v.round, AcceptDecision(torch.arange(len(prompt)), torch.tensor(prompt[1:]), 7))
    target.close_session("t")
    tree = TreeSpec(expand_width=3, max_depth=3, verify_budget=12)
    drafter.open_session("plain", 64)
    plain = drafter.propose("plain", seed, tree)
    drafter.close_session("plain")
    banned = int(plain.tokens[0])
    params = SamplingParams(logit_bias=((banned, -100.0),))
    drafter.open_session("biased", 64, draft_processor(params, prompt, drafter.draft_columns))
    biased = drafter.propose("biased", seed, tree)
    drafter.close_session("biased")
    assert banned in plain.tokens.tolist() and banned not in biased.tokens.tolist()
    base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=30, sampling=params, stop_ids=())
    spec = generate(target, prompt, max_new_tokens=30, sampling=params, drafter=drafter, stop_ids=())
    assert spec.token_ids == base.token_ids


def test_the_drafters_processors_are_the_verifiers_row_by_row():
    """draft_processor (the drafter's histories: the committed tokens from the prompt's second, then
    the path) gives each tree row the logits processed_logits gives it, bias and every penalty on."""
    from eyas.verification.processors import draft_processor

    flat = flatten_tree(TREE3, frontier_token=7, base_position=10)
    logits = torch.randn(flat.num_rows, V, generator=torch.Generator().manual_seed(3)) * 3
    prompt, answer = [3, 4, 4, 9], [9, 12, 12]
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3, logit_bias=((2, 3.0), (40, -7.5))
    )
    histories = [prompt[1:] + answer + path for path in paths(flat)]
    drafted = draft_processor(params, prompt)(logits, histories)
    assert torch.allclose(drafted, processed_logits(logits, flat, prompt, answer, params))


def test_min_tokens_holds_the_stop_ids_back_on_the_rows_whose_answer_is_short():
    """vLLM's min_tokens per verify row: a row's answer before the token it draws is the committed
    answer, the root (the previous frontier) and its path below the root; rows shorter than min_tokens
    have every stop id at -inf, the others are untouched; a prefill's row (an empty answer) is held
    too; the drafter's rows get the verifier's masks (under a penalty as well)."""
    from eyas.verification.processors import draft_processor

    flat = flatten_tree(TREE3, frontier_token=7, base_position=10)  # depths 0, 1, 2, 1
    logits = torch.randn(flat.num_rows, V, generator=torch.Generator().manual_seed(4))
    prompt, answer = [3, 4, 4, 9], [5, 5, 2]  # the rows' answers: 4, 5, 6, 5 tokens
    params = SamplingParams(min_tokens=6, min_tokens_stop_ids=(0, 4))
    out = processed_logits(logits, flat, prompt, answer, params)
    held = out[:, [0, 4]] == float("-inf")
    assert held.tolist() == [[True, True], [True, True], [False, False], [True, True]]
    keep = torch.ones(V, dtype=torch.bool)
    keep[[0, 4]] = False
    assert torch.equal(out[:, keep], logits[:, keep]) and torch.equal(out[2], logits[2])
    assert processed_logits(logits, flat, prompt, answer + [1], params)[:, [0, 4]].isinf().sum() == 2  # the root only
    first = processed_logits(logits[:1], None, prompt, [], SamplingParams(min_tokens=1, min_tokens_stop_ids=(3,)))
    assert first[0, 3] == float("-inf")
    histories = [prompt[1:] + answer + path for path in paths(flat)]
    for p in (params, SamplingParams(frequency_penalty=0.5, min_tokens=6, min_tokens_stop_ids=(0, 4))):
        assert torch.equal(
            draft_processor(p, prompt)(logits, histories), processed_logits(logits, flat, prompt, answer, p)
        )
    assert not SamplingParams(min_tokens=6).processes  # no stop ids: nothing to hold
