"""An answer's text (eyas/protocol/text.py): streamed deltas add up to the whole answer's text, for
any token sequence and any chunking, with multi-byte characters and stop strings split across
rounds; and the whole answer's text is the tokenizer's own decode (cut before a stop string)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eyas.protocol.text import REPLACEMENT_CHAR, AnswerText, Detokenizer, token_bytes
from eyas.target.loader import load_tokenizer

MIXED = "Hi 😀 ok 日本語です, café (cafe\u0301) 👩‍💻 done"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _stream(tokenizer, chunks, stop=(), min_tokens=0) -> tuple[list[str], AnswerText]:
    text = AnswerText(tokenizer, stop, min_tokens)
    deltas = [text.push(c) for c in chunks]
    deltas.append(text.finish())
    return deltas, text


def test_one_token_a_round_streams_every_character_of_emoji_cjk_and_combining_accents(tokenizer):
    """The old stream sent "Hi \ufffd" for this text and then nothing more."""
    ids = tokenizer.encode(MIXED)
    deltas, text = _stream(tokenizer, [[t] for t in ids])
    assert "".join(deltas) == MIXED == text.text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)  # a partial character is never sent
    assert "" in deltas  # some tokens end inside a character: held back, not sent as U+FFFD


def test_a_stop_string_split_across_rounds_is_never_sent(tokenizer):
    ids = tokenizer.encode("Hello\nworld END and more")
    deltas, text = _stream(tokenizer, [[t] for t in ids], stop=["\n\n", "END"])
    assert "".join(deltas) == "Hello\nworld " == text.text and text.stopped
    assert all("E" not in d for d in deltas)  # "E", "EN" held back until "END" or something else came


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_min_tokens_lets_a_stop_string_end_the_answer_only_in_its_min_tokens_th_token_or_later(tokenizer, chunk):
    """vLLM's min_tokens: a stop string ending in the text of the first min_tokens - 1 tokens does not
    count (streamed or whole, however the tokens arrive); one ending in token number min_tokens does."""
    ids = tokenizer.encode("a END b END c END d")
    ends = [k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("END")]
    assert len(ends) == 3
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    for min_tokens, kept in [
        (0, "a "),
        (ends[0], "a "),
        (ends[0] + 1, "a END b "),
        (ends[2] + 1, "a END b END c END d"),
    ]:
        deltas, text = _stream(tokenizer, chunks, stop=["END"], min_tokens=min_tokens)
        assert "".join(deltas) == kept == text.text == AnswerText.of(tokenizer, ids, ["END"], min_tokens), min_tokens
        assert text.stopped == (kept != "a END b END c END d")


def test_a_stop_string_prefix_that_does_not_complete_is_sent_at_the_end(tokenizer):
    ids = tokenizer.encode("the END")
    deltas, text = _stream(tokenizer, [ids[:-1], ids[-1:]], stop=["ENDING"])
    assert "".join(deltas) == "the END" and not text.stopped
    assert deltas[-1] == " END" or "END" in deltas[-1]  # held back while it could still become "ENDING"


def test_a_partial_character_at_the_very_end_is_sent_as_the_tokenizer_decodes_it(tokenizer):
    ids = tokenizer.encode("ok 😀")
    cut = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    deltas, _ = _stream(tokenizer, [[t] for t in ids[:cut]])
    assert "".join(deltas) == tokenizer.decode(ids[:cut]) and deltas[-1].endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped_as_the_report_skips_them(tokenizer):
    ids = tokenizer.encode("Sure.") + [tokenizer.eos_token_id]
    assert AnswerText.of(tokenizer, ids) == "Sure." == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    ids=st.lists(
        st.one_of(st.integers(0, 300), st.integers(0, 49151)), min_size=0, max_size=40
    ),  # byte-level tokens (partial characters) as often as whole words
    stop=st.lists(st.text(alphabet="ab \n😀日", min_size=1, max_size=3), max_size=2),
)
def test_any_token_sequence_in_any_chunks_streams_exactly_the_whole_answer(tokenizer, data, ids, stop):
    """The property: for random ids, random chunk boundaries and random stop strings, the deltas add
    up to the whole answer's text, which is the tokenizer's decode cut before the first stop string."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    deltas, text = _stream(tokenizer, chunks, stop)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    found = [whole.index(s) for s in stop if s in whole]
    assert "".join(deltas) == text.text == AnswerText.of(tokenizer, ids, stop)
    if not any(REPLACEMENT_CHAR in s for s in stop):
        assert text.text == (whole[: min(found)] if found else whole)


def test_the_detokenizer_is_independent_of_the_chunking(tokenizer):
    ids = tokenizer.encode(MIXED)
    one, all_at_once = Detokenizer(tokenizer), Detokenizer(tokenizer)
    for t in ids:
        one.push([t])
    all_at_once.push(ids)
    assert one.text == all_at_once.text == MIXED


def test_each_tokens_bytes_add_up_to_the_texts_even_inside_a_character(tokenizer):
    """The logprobs' ``bytes``: a token that ends inside an emoji has the emoji's first bytes."""
    ids = tokenizer.encode(MIXED)
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == MIXED.encode("utf-8")
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()
