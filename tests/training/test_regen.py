"""Batched regeneration of training answers with the target (a tiny random model, the real tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.training.regen import first_turn_prompts, read_regenerated, regenerate_batched, regenerate_in_chunks
from tests.testing import tiny_hf


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from eyas.target.loader import load_tokenizer

    tok = load_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-target")
    tiny_hf("llama", vocab=len(tok), hidden=32, layers=2, seed=3).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


CONVERSATIONS = [
    ("c0", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]),
    ("c1", [{"role": "user", "content": "What is two plus two? " * 3}, {"role": "assistant", "content": "4"}]),
    ("c2", [{"role": "assistant", "content": "no user turn first"}]),
    ("c3", [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "too long"}]),
    ("c4", [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]),
]


def test_answers_are_the_models_greedy_continuations_and_a_rerun_resumes(model_folder, tmp_path):
    """c2 (no user turn first) and c3 (over 64 prompt tokens) are skipped; the limit of 2 takes c0 and
    c1. Each answer is the model's own greedy continuation of the templated first turn, alone; a
    random model never says <|im_end|> in 5 tokens, so both are cut (``truncated``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "answers.jsonl"
    s = regenerate_batched(
        model_folder,
        iter(CONVERSATIONS),
        out,
        limit=2,
        batch_size=2,
        max_new_tokens=5,
        max_prompt_tokens=64,
        dtype="float32",
    )
    recs = read_regenerated(out)
    assert (s.prompts, s.resumed, s.new_tokens, s.truncated) == (2, 0, 10, 2)
    assert sorted(r["id"] for r in recs) == ["c0", "c1"]
    tok = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    for r in recs:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] and r["truncated"]
        enc = tok.apply_chat_template(
            r["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )  # with its attention mask: <|im_end|> is the pad id
        alone = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        n = enc["input_ids"].shape[1]
        assert r["messages"][1]["content"] == tok.decode(alone[0, n:], skip_special_tokens=True)
    again = regenerate_batched(
        model_folder, iter(CONVERSATIONS), out, limit=3, batch_size=2, max_new_tokens=5, max_prompt_tokens=64
    )  # the default dtype (bfloat16) appends to an fp32 file: records carry no dtype
    assert (again.prompts, again.resumed) == (1, 2)
    assert sorted(r["id"] for r in read_regenerated(out)) == ["c0", "c1", "c4"]
    with out.open("a") as f:  # a run killed mid-write: the partial last line is ignored
        f.write(json.dumps({"id": "c9"})[:5])
    assert len(read_regenerated(out)) == 3


def test_first_turn_prompts_filters_and_limits(model_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_folder)
    got = first_turn_prompts(iter(CONVERSATIONS), tok, max_prompt_tokens=64, limit=10)
    assert [sid for sid, _, _ in got] == ["c0", "c1", "c4"]
    assert all(msgs[0]["role"] == "user" and len(msgs) == 1 and n <= 64 for _, msgs, n in got)
    with pytest.raises(ValueError, match="^batch_size: "):
        regenerate_batched(".", iter(()), "x.jsonl", limit=1, batch_size=0)
    with pytest.raises(ValueError, match="^dtype: "):
        regenerate_batched(".", iter(()), "x.jsonl", limit=1, dtype="float16")


def test_chunks_answer_a_prefix_of_the_conversations_in_order(model_folder, tmp_path):
    """In chunks of 2 the file holds c0 and c1 (the first two usable conversations, sorted by length
    between them) before c4, and a rerun with a larger limit only appends."""
    out = tmp_path / "answers.jsonl"
    kw = dict(batch_size=4, max_new_tokens=3, max_prompt_tokens=64)
    first = regenerate_in_chunks(model_folder, lambda: iter(CONVERSATIONS), out, limit=2, chunk=2, **kw)
    assert first.prompts == 2 and sorted(r["id"] for r in read_regenerated(out)) == ["c0", "c1"]
    more = regenerate_in_chunks(model_folder, lambda: iter(CONVERSATIONS), out, limit=3, chunk=2, **kw)
    assert (more.prompts, more.resumed) == (1, 2)
    assert [r["id"] for r in read_regenerated(out)][2:] == ["c4"]
    with pytest.raises(ValueError, match="^chunk: "):
        regenerate_in_chunks(model_folder, lambda: iter(()), out, limit=1, chunk=0)


def test_answers_come_with_the_features_of_their_own_decoding(model_folder, tmp_path):
    """``features_dir``: each answered sample is written to a feature cache as its prompt and answer
    ids exactly as fed (the answer supervised), with the trainer's taps as the batched decode
    recorded them: equal to one full forward over the same ids. A shard whose answers never reached
    the JSONL (a run killed between the two) is dropped on resume and its answers made again."""
    from eyas.target.loader import load_target
    from eyas.training.features import FeatureCache, training_taps

    out, feats = tmp_path / "answers.jsonl", tmp_path / "features"
    kw = dict(batch_size=2, max_new_tokens=6, max_prompt_tokens=64, dtype="float32", features_dir=feats)
    s = regenerate_batched(model_folder, iter(CONVERSATIONS), out, limit=3, **kw)
    assert (s.prompts, s.new_tokens) == (3, 18)
    cache = FeatureCache(feats)
    loaded = load_target(model_folder)
    taps = training_taps(loaded.model)
    manifest = cache.check(loaded.fingerprint.to_dict(), taps)
    assert manifest["complete"] and [sh["num_samples"] for sh in manifest["shards"]] == [2, 1]
    samples = {fb.sample_id: fb for fb in cache.samples()}
    tok = loaded.tokenizer
    for rec in read_regenerated(out):
        fb = samples[rec["id"]]
        prompt = tok.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        n = len(prompt)
        assert fb.input_ids[:n].tolist() == prompt and fb.loss_mask.tolist() == [False] * n + [True] * 6
        assert tok.decode(fb.input_ids[n:], skip_special_tokens=True) == rec["messages"][1]["content"]
        S = fb.input_ids.numel()
        full = loaded.model(
            fb.input_ids[None],
            torch.arange(S)[None],
            loaded.model.allocate_cache(1, S),
            0,
            torch.ones(S, S, dtype=torch.bool).tril()[None],
            taps,
            logits_rows="none",
        ).features[0]
        torch.testing.assert_close(fb.features.float(), full.to(torch.float16).float(), atol=2e-3, rtol=2e-3)
    # killed after the second shard was written but before its answer was appended
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")
    again = regenerate_batched(model_folder, iter(CONVERSATIONS), out, limit=3, **kw)
    assert (again.prompts, again.resumed) == (1, 2)
    manifest = cache.manifest()
    assert [sh["num_samples"] for sh in manifest["shards"]] == [2, 1] and manifest["complete"]
    assert sorted(fb.sample_id for fb in cache.samples()) == sorted(r["id"] for r in read_regenerated(out))
    assert len(list(feats.glob("shard_*"))) == 2


def test_bfloat16_answers_attend_over_a_float32_cache(model_folder):
    """The default bfloat16 regeneration keeps K/V in float32 (the attention runs there) and picks
    each token among the bfloat16 head's best candidates rescored in float32: the prompt's features stay
    within 2 % (relative norm, each row) of the float32 model's, and every answer has max_new_tokens or ends."""
    from eyas.target.loader import load_target
    from eyas.training.features import training_taps
    from eyas.training.regen import answer_batch

    loaded = load_target(model_folder)
    taps = training_taps(loaded.model)
    prompts = [[5, 9, 11, 3], [7, 2]]
    exact = answer_batch(loaded.model, prompts, 4, end_id=1, taps=taps)
    head = loaded.model.lm_head.weight.detach().clone()
    half = answer_batch(loaded.model.to(torch.bfloat16), prompts, 4, end_id=1, taps=taps, head_weight=head)
    for e, h, p in zip(exact, half, prompts):
        assert h.features.dtype == torch.bfloat16 and h.features.shape == (len(p) + len(h.ids), e.features.shape[1])
        assert len(h.ids) == 4 or h.ended
        n = len(p)  # the prompt's rows: the same tokens in both
        err = (h.features[:n].float() - e.features[:n]).norm(dim=-1) / e.features[:n].norm(dim=-1)
        assert float(err.max()) < 0.02, err


def test_a_batch_drops_its_ended_rows_and_each_answer_is_its_prompts_alone(model_folder):
    """Answers that end at different steps: the batch drops a row once its last token is fed, and
    every answer (tokens and features) is what its prompt gives decoded alone, at float32."""
    from eyas.target.loader import load_target
    from eyas.training.features import training_taps
    from eyas.training.regen import answer_batch

    model = load_target(model_folder).model
    taps = training_taps(model)
    prompts = [[5, 9, 11, 3], [7, 2], [4, 4, 8], [12, 30, 6, 1, 2]]
    never = model.cfg.vocab_size + 1  # an end id no answer says
    free = answer_batch(model, prompts, 8, end_id=never, taps=taps)
    end_id = free[0].ids[2]  # the first answer ends at its third token, the others wherever they say it
    batch = answer_batch(model, prompts, 8, end_id=end_id, taps=taps)
    assert batch[0].ended and len(batch[0].ids) <= 3
    assert sorted({len(a.ids) for a in batch}) != [8], "some answers must end early for the test to mean anything"
    for p, a in zip(prompts, batch):
        alone = answer_batch(model, [p], 8, end_id=end_id, taps=taps)[0]
        assert a.ids == alone.ids and a.ended == alone.ended
        assert a.ended == (end_id in a.ids) and (not a.ended or a.ids.index(end_id) == len(a.ids) - 1)
        assert a.features.shape[0] == len(p) + len(a.ids)
        torch.testing.assert_close(a.features, alone.features, atol=1e-4, rtol=1e-4)


def test_sampled_answers_follow_the_targets_distribution_at_the_temperature(model_folder, tmp_path):
    """temperature > 0: each first token is drawn from softmax(logits / T). 4,000 draws of the first
    answer token of one prompt are held to the float32 model's own distribution by a chi-square test
    (cells of expected count >= 5, the rest pooled; refused below p = 1e-3, a false alarm once in a
    thousand runs). Each sampling pass has its own record ids, so a pass beside the greedy answers
    in one file resumes and counts only its own."""
    from scipy.stats import chisquare

    from eyas.target.loader import load_target
    from eyas.training.regen import answer_batch, record_id

    model = load_target(model_folder).model
    prompt, T, n = [5, 9, 11, 3], 0.8, 4000
    gen = torch.Generator().manual_seed(0)
    got = answer_batch(model, [prompt] * n, 1, end_id=-5, temperature=T, generator=gen)
    counts = torch.bincount(torch.tensor([a.ids[0] for a in got]), minlength=model.cfg.vocab_size).double()
    S = len(prompt)
    logits = model(
        torch.tensor([prompt]),
        torch.arange(S)[None],
        model.allocate_cache(1, S),
        0,
        torch.ones(S, S, dtype=torch.bool).tril()[None],
        (),
        logits_rows="last",
    ).logits[0, -1]
    expected = torch.softmax(logits.double() / T, dim=-1) * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert int(big.sum()) >= 5 and chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
    out = tmp_path / "answers.jsonl"
    kw = dict(batch_size=2, max_new_tokens=3, max_prompt_tokens=64, dtype="float32")
    regenerate_batched(model_folder, iter(CONVERSATIONS), out, limit=2, **kw)
    s = regenerate_batched(model_folder, iter(CONVERSATIONS), out, limit=2, temperature=T, sample=1, **kw)
    assert (s.prompts, s.resumed) == (2, 0)
    again = regenerate_batched(model_folder, iter(CONVERSATIONS), out, limit=3, temperature=T, sample=1, **kw)
    assert (again.prompts, again.resumed) == (1, 2)
    recs = read_regenerated(out)
    assert [r["id"] for r in recs[2:]] == [record_id(c, T, 1) for c in ("c0", "c1", "c4")][: len(recs) - 2]
    assert all(r["temperature"] == T and r["sample"] == 1 for r in recs[2:])


def test_sample_rows_draws_each_row_from_its_own_distribution():
    """The regen sampler (inverse CDF, one uniform a row): a token of probability 0 is never drawn, a
    one-hot row always gives its token, and 6,000 draws of a 3-way row pass a chi-square test against
    it (refused below p = 1e-3); the same generator seed gives the same draws."""
    from scipy.stats import chisquare

    from eyas.training.regen import sample_rows

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5], [0.0, 0.0, 1.0, 0.0, 0.0]])  # [2, 5]
    draws = torch.stack([sample_rows(probs, torch.Generator().manual_seed(i)) for i in range(6000)])  # [6000, 2]
    assert (draws[:, 1] == 2).all()
    counts = torch.bincount(draws[:, 0], minlength=5)
    assert counts[0] == 0 and counts[2] == 0
    assert chisquare(counts[[1, 3, 4]].numpy(), [1200, 1800, 3000]).pvalue > 1e-3
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(sample_rows(probs.repeat(8, 1), g1), sample_rows(probs.repeat(8, 1), g2))
