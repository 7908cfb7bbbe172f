"""Structured output (eyas.verification.grammar): a response format is checked and canonical, each
verify row's mask is the one a one-row decode of its path gets, the drafter's rows are masked as
the verifier's, and greedy speculation under a grammar equals target-only constrained decoding."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.generate import generate
from eyas.protocol.response_format import GRAMMAR_OFF, canonical_response_format, grammar_key
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import DraftTree, flatten_tree
from eyas.target.engine import TargetEngine
from eyas.verification.grammar import GrammarCompiler, _child_sibling, allowed_rows, apply_bitmask
from eyas.verification.processors import draft_processor, processed_logits
from tests.test_generate import engines, pair_counts
from tests.testing import ours_from_hf, tiny_hf

V = 49152  # the shipped tokenizer's vocabulary: the tiny model below has it, so that the grammar fits
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def tokenizer():
    from eyas.target.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, V, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def big_vocab():
    """A tiny random target with the shipped tokenizer's vocabulary (49,152 x 32 embeddings)."""
    return ours_from_hf(tiny_hf("llama", vocab=V, hidden=32, layers=2))


def test_the_first_child_next_sibling_layout_worked_example():
    first, sibling = _child_sibling([-1, 0, 0, 1])
    assert first.tolist() == [1, 3, -1, -1] and sibling.tolist() == [-1, 2, -1, -1]


@pytest.mark.parametrize(
    "value, want",
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "json_object"}),
        (FORMAT, {"type": "json_schema", "schema": SCHEMA}),
        ({"type": "json_schema", "schema": SCHEMA}, {"type": "json_schema", "schema": SCHEMA}),
    ],
)
def test_a_response_format_in_openais_shapes_is_made_canonical(value, want):
    assert canonical_response_format(value) == want
    key = grammar_key(want)
    assert (key == GRAMMAR_OFF) == (want is None)
    if want and want["type"] == "json_schema":  # the schema's property order is kept: it is the answer's
        assert key.index('"name"') < key.index('"age"') and json.loads(key) == want


@pytest.mark.parametrize(
    "value, message",
    [
        ("json", "response_format: expected an object"),
        ({"type": "xml"}, "response_format.type: expected 'text', 'json_object' or 'json_schema'"),
        ({"type": "json_schema"}, "response_format.json_schema: expected an object with a 'schema'"),
        ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema: expected"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
            "response_format.json_schema.schema: xgrammar cannot compile it (Unsupported type",
        ),
        ({"type": "json_object", "strict": True}, "response_format: unknown field 'strict'"),
        ({"type": "json_schema", "schema": {"enum": ["x" * 70_000]}}, "response_format.json_schema.schema: at most"),
    ],
)
def test_a_bad_response_format_is_refused_naming_the_field_without_internals(value, message):
    with pytest.raises(ValueError) as info:
        canonical_response_format(value)
    assert str(info.value).startswith(message), info.value
    assert ".cc:" not in str(info.value) and "/project/" not in str(info.value)


def _reference_mask(compiler, answer: list[int]) -> torch.Tensor:  # [V] bool: a one-row decode's mask
    cursor = compiler.cursor(grammar_key(canonical_response_format(FORMAT)))
    assert cursor.advance(answer)
    bitmask = cursor._xgr.allocate_token_bitmask(1, V)
    cursor.matcher.fill_next_token_bitmask(bitmask, 0)
    return allowed_rows(bitmask, V)[0]


def test_every_verify_row_gets_the_mask_of_a_one_row_decode_of_its_path(compiler, tokenizer):
    """A tree below the frontier '{"' with a good branch (name ... ) and a branch the grammar refuses:
    each live row's mask equals a fresh matcher's after the answer, the frontier and the row's path;
    the refused row and its child are left unmasked (never read: the refused row's parent gives it 0)."""
    key = grammar_key(canonical_response_format(FORMAT))
    ids = tokenizer.encode('{"name": "Bo", "age": 3}', add_special_tokens=False)
    answer, frontier = [], ids[0]
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    # root (frontier) -> ids[1] -> ids[2]; root -> bad -> ids[2]
    tree = DraftTree(
        torch.tensor([ids[1], ids[2], bad, ids[2]]),
        torch.tensor([-1, 0, -1, 2]),
        torch.tensor([1, 2, 1, 2]),
        torch.ones(4),
    )
    flat = flatten_tree(tree, frontier, base_position=5)
    cursor = compiler.cursor(key)
    bitmask = cursor.tree_bitmask(answer, flat)
    rows = allowed_rows(bitmask, V)
    path_of = {0: [frontier], 1: [frontier, ids[1]], 2: [frontier, ids[1], ids[2]]}
    for row, path in path_of.items():
        assert torch.equal(rows[row], _reference_mask(compiler, answer + path)), row
    assert not rows[3].any()  # refused; its child is never visited (xgrammar leaves it all allowed)
    logits = torch.randn(flat.num_rows, V)
    masked = processed_logits(logits, flat, [1, 2], answer, SamplingParams(grammar=key), bitmask)
    assert torch.isinf(masked[0]).sum() == V - rows[0].sum()
    assert torch.equal(masked[3], logits[3]) and torch.equal(masked[4], logits[4])
    # the cursor stays at the committed answer: the next round's answer extends it
    again = cursor.tree_bitmask([frontier], flatten_tree(DraftTree.empty(), ids[1], base_position=6))
    assert torch.equal(allowed_rows(again, V)[0], _reference_mask(compiler, [frontier, ids[1]]))


def test_the_cursor_rolls_back_to_an_answer_it_shares_and_refuses_what_leaves_the_grammar(compiler, tokenizer):
    key = grammar_key(canonical_response_format(FORMAT))
    ids = tokenizer.encode('{"name": "Bo", "age": 3}', add_special_tokens=False)
    cursor = compiler.cursor(key)
    assert cursor.advance(ids[:5]) and cursor.tokens == ids[:5]
    assert cursor.advance(ids[:3]) and cursor.tokens == ids[:3]  # rolled back
    assert not cursor.advance([*ids[:3], tokenizer.encode("x", add_special_tokens=False)[0]]) and cursor.refused
    assert cursor.advance(ids) and not cursor.advance([*ids, tokenizer.eos_token_id])  # complete: the end
    assert cursor.tree_bitmask([*ids, tokenizer.eos_token_id], None) is None  # nothing left to enforce


def test_the_drafters_rows_are_masked_as_the_verifiers(compiler, tokenizer):
    """draft_processor with its own cursor (histories: the prompt from its second token, the answer,
    the frontier, the path) masks each row as processed_logits masks the same path's verify row;
    through a draft vocabulary too (columns: target id -> logit column)."""
    key = grammar_key(canonical_response_format(FORMAT))
    ids = tokenizer.encode('{"name": "Bo", "age": 3}', add_special_tokens=False)
    prompt = [5, 6, 7]
    params = SamplingParams(grammar=key)
    histories = [prompt[1:] + ids[:1], prompt[1:] + ids[:2], prompt[1:] + ids[:3]]
    logits = torch.randn(3, V)
    drafted = draft_processor(params, prompt, None, compiler.cursor(key))(logits, histories)
    for i, h in enumerate(histories):
        want = _reference_mask(compiler, h[len(prompt) - 1 :])
        assert torch.equal(~torch.isinf(drafted[i]), want), i
    keep = torch.arange(0, V, 3)  # a draft vocabulary of every third token
    columns = {int(t): c for c, t in enumerate(keep)}
    narrow = draft_processor(params, prompt, columns, compiler.cursor(key))(logits[:, keep], histories)
    for i, h in enumerate(histories):
        want = _reference_mask(compiler, h[len(prompt) - 1 :])[keep]
        assert torch.equal(~torch.isinf(narrow[i]), want) or not want.any(), i


def test_a_row_with_no_allowed_token_is_left_unmasked():
    logits = torch.randn(2, 40)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    out = apply_bitmask(logits.clone(), bitmask)
    assert (~torch.isinf(out[0])).nonzero().flatten().tolist() == [0, 2] and torch.equal(out[1], logits[1])


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_greedy_speculation_under_a_grammar_is_target_only_constrained_decoding(big_vocab, compiler, method):
    """Token for token, with the drafter masked too; the answer is the grammar's (a fresh matcher
    accepts every token), and the grammar changed it (the test could fail)."""
    key = grammar_key(canonical_response_format(FORMAT))
    params = SamplingParams(grammar=key)
    target, drafter = engines(big_vocab, method)
    prompt = [1, 2, 3, 400, 5000]
    plain = generate(TargetEngine(big_vocab, ()), prompt, max_new_tokens=24, stop_ids=(2,))
    base = generate(
        TargetEngine(big_vocab, ()),
        prompt,
        max_new_tokens=24,
        sampling=params,
        stop_ids=(2,),
        grammar=compiler.cursor(key),
    )
    spec = generate(
        target, prompt, max_new_tokens=24, sampling=params, drafter=drafter, stop_ids=(2,), grammar=compiler.cursor(key)
    )
    assert spec.token_ids == base.token_ids != plain.token_ids
    check = compiler.cursor(key)
    assert check.advance(base.token_ids) or check.matcher.is_terminated()


def test_a_grammar_goes_with_its_cursor(big_vocab, compiler):
    with pytest.raises(ValueError, match="grammar: a cursor goes with sampling.grammar"):
        generate(
            TargetEngine(big_vocab, ()),
            [1, 2],
            max_new_tokens=2,
            sampling=SamplingParams(grammar='{"type":"json_object"}'),
        )


def test_json_object_allows_an_object_and_nothing_else_at_the_top(tokenizer, compiler):
    """OpenAI's json_object promises an object: a top-level array, string or number is refused
    (xgrammar's builtin JSON grammar admits them, and a gguf answer once began with '[')."""
    key = grammar_key(canonical_response_format({"type": "json_object"}))
    for text, allowed in (('{"a": [1, 2]}', True), ("[1, 2]", False), ('"a"', False), ("12", False)):
        cursor = compiler.cursor(key)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert (cursor.advance(ids) or cursor.matcher.is_terminated()) == allowed, text


def test_sampled_speculation_under_a_grammar_only_emits_what_the_grammar_allows(big_vocab, compiler):
    """At temperature 1 every emitted token, speculative or not, is one the grammar allows after the
    answer before it (each verify row's distribution is masked under its own path)."""
    key = grammar_key(canonical_response_format({"type": "json_object"}))
    params = SamplingParams(temperature=1.0, grammar=key)
    target, drafter = engines(big_vocab, "eagle3")
    for seed in range(4):
        out = generate(
            target,
            [1, 2, 3],
            max_new_tokens=20,
            sampling=params,
            drafter=drafter,
            stop_ids=(2,),
            seed=seed,
            grammar=compiler.cursor(key),
        )
        check = compiler.cursor(key)
        assert check.advance(out.token_ids) or check.matcher.is_terminated(), (seed, out.token_ids)
        assert out.token_ids and out.token_ids[0] != 2


def test_sampled_speculation_under_a_grammar_matches_the_masked_target_joint():
    """An 8-token vocabulary and the grammar root ::= ("a" | "b" | "x") ("1" | "2" | "a" | "y"): the
    whole loop with EAGLE trees, 1,500 draws of (x1, x2) at temperature 1: chi-square against the
    joint of target-only sampling with each step's distribution renormalised over what the grammar
    allows, p > 1e-3; the same draws against the unmasked joint are refused (the mask matters)."""
    import xgrammar as xgr

    from eyas.verification.grammar import GrammarCursor
    from eyas.verification.sampling import target_probs
    from tests.test_generate import P_THRESHOLD, TREE, chi_square_p

    vocab = ["a", "b", "x", "1", "2", "y", "z", "</s>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=8, stop_token_ids=[7])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(
        'root ::= ("a" | "b" | "x") ("1" | "2" | "a" | "y")'
    )
    model = ours_from_hf(tiny_hf("llama", vocab=8, init_std=0.3, seed=5))
    target, drafter = engines(model, "eagle1", seed=1)
    params = SamplingParams(temperature=1.0, grammar="test")  # the key is carried; the cursor is the grammar
    prompt = [1, 2, 3]
    first, second = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0, 5])

    def last_probs(ids, allowed):
        cache = model.allocate_cache(1, len(ids))
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None]
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, 0, mask, ()).logits[0, -1:]
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[:, allowed] = 0
            logits = logits + keep
        return target_probs(logits, params)[0].double()

    def joint(masked: bool) -> torch.Tensor:
        p1 = last_probs(prompt, first if masked else None)
        return torch.stack([p1[x] * last_probs(prompt + [x], second if masked else None) for x in range(8)])

    counts = pair_counts(
        target,
        prompt,
        8,
        sampling=params,
        drafter=drafter,
        tree=TREE,
        per_draw=lambda: {"grammar": GrammarCursor(compiled, 8)},
    )
    assert chi_square_p(counts, joint(masked=True)) > P_THRESHOLD
    assert chi_square_p(counts, joint(masked=False)) < P_THRESHOLD
