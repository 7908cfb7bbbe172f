"""The OpenAI front door's translation (no Ray): requests to Eyas requests, refusals naming the
parameter, per-request speculative statistics, stop strings in a stream, the API key."""

from __future__ import annotations

import pytest

from eyas.serve import openai_api as oai
from eyas.target.loader import encode_prompt, load_tokenizer

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def chat(tok, **body):
    return oai.parse_openai(
        oai.CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], **body}, tok, MODEL
    )


def test_a_chat_request_is_the_templated_conversation(tok):
    parsed = chat(tok, max_completion_tokens=7, temperature=0, seed=3, stop="\n", tree_depth=2, method="eagle1")
    assert parsed.prompt_ids == encode_prompt(tok, "Hi!")  # one user turn: what `eyas generate` sends
    r = parsed.request
    assert (r.max_new_tokens, r.temperature, r.seed, r.stop, r.tree_depth, r.method) == (7, 0.0, 3, ["\n"], 2, "eagle1")
    assert parsed.kind == oai.CHAT and not parsed.stream
    multi = chat(
        tok,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again"},
        ],
    )
    text = tok.decode(multi.prompt_ids)
    assert "Be brief." in text and "Hi!" in text and "Hello." in text and text.endswith("assistant\n")
    done = oai.parse_openai(
        oai.COMPLETION,
        {
            "model": MODEL,
            "prompt": "Once upon",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        tok,
        MODEL,
    )
    assert done.prompt_ids == encode_prompt(tok, "Once upon", raw=True)
    assert done.stream and done.include_usage and done.request.max_new_tokens == 5
    assert chat(tok).request.temperature == 1.0 and chat(tok).request.max_new_tokens == oai.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    "body,param,status",
    [
        ({"n": 17}, "n", 400),
        ({"top_logprobs": 3}, "top_logprobs", 400),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
        ({"tools": [{"type": "function"}]}, "tools", 400),
        ({"frequency_penalty": 2.5}, "frequency_penalty", 400),
        ({"presence_penalty": -3}, "presence_penalty", 400),
        ({"repetition_penalty": 0}, "repetition_penalty", 400),
        ({"min_p": 1.5}, "min_p", 400),
        ({"logit_bias": {"abc": 1}}, "logit_bias", 400),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", 400),
        ({"logit_bias": {"5": 101}}, "logit_bias", 400),
        ({"mystery": 1}, "mystery", 400),
        ({"model": "gpt-4o"}, "model", 404),
        ({"max_tokens": True}, "max_tokens", 400),
        ({"max_tokens": 0}, "max_tokens", 400),
        ({"max_completion_tokens": 3, "max_tokens": 3}, "max_tokens", 400),
        ({"temperature": 3}, "temperature", 400),
        ({"temperature": "0"}, "temperature", 400),
        ({"top_p": 0}, "top_p", 400),
        ({"messages": []}, "messages", 400),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", 400),
        ({"stream_options": {"include_usage": True}}, "stream_options", 400),
        ({"tree_depth": -1}, "tree_depth", 400),
        ({"method": "medusa"}, "method", 400),
        ({"seed": 1.5}, "seed", 400),
    ],
)
def test_bad_parameters_are_refused_naming_them(tok, body, param, status):
    with pytest.raises(oai.OpenAIError) as info:
        chat(tok, **body)
    err = info.value
    assert err.status == status and err.param.split(".")[0] == param, err.body()
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_processors_reach_the_request(tok):
    req = chat(
        tok,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"42": -100, "7": 2.5},
        repetition_penalty=1.1,
        min_p=0.05,
    ).request
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty, req.min_p) == (0.5, -0.25, 1.1, 0.05)
    assert req.logit_bias == {42: -100.0, 7: 2.5}


def test_no_seed_draws_a_fresh_one_as_openai_does_and_the_response_reports_it(tok):
    """At OpenAI's default temperature 1.0 the same prompt used to get the same "sampled" answer every
    time (no seed meant seed 0); now each request without a seed draws its own, reported in eyas.seed."""
    seeds = {chat(tok).request.seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert chat(tok, seed=11).request.seed == 11
    assert (
        oai.spec_stats(
            {
                "method": "target",
                "rounds": [],
                "accept_length_mean": 1.0,
                "target_forwards": 0,
                "drafter_fallback": False,
                "seed": 123,
            }
        )["seed"]
        == 123
    )


def test_no_max_tokens_means_the_rest_of_the_context(tok):
    parsed = oai.parse_openai(
        oai.CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]}, tok, MODEL, 8192
    )
    assert parsed.request.max_new_tokens == 8192 - len(parsed.prompt_ids) - 1
    given = oai.parse_openai(
        oai.CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 9}, tok, MODEL, 8192
    )
    assert given.request.max_new_tokens == 9


def test_a_completion_needs_a_prompt(tok):
    with pytest.raises(oai.OpenAIError) as info:
        oai.parse_openai(oai.COMPLETION, {"model": MODEL, "prompt": "  "}, tok, MODEL)
    assert info.value.param == "prompt"
    with pytest.raises(oai.OpenAIError, match="body must be a JSON object"):
        oai.parse_openai(oai.COMPLETION, [1, 2], tok, MODEL)


def test_spec_stats_follow_the_rounds():
    rounds = [
        {"accept_length": 0, "tree_nodes": 0},  # prefill / target-only round
        {"accept_length": 2, "tree_nodes": 4},
        {"accept_length": 0, "tree_nodes": 4},
        {"accept_length": 3, "tree_nodes": 6},
    ]
    report = {
        "method": "eagle3",
        "rounds": rounds,
        "accept_length_mean": 2.0,
        "target_forwards": 4,
        "drafter_fallback": False,
    }
    s = oai.spec_stats({**report, "drafter_version": 2})
    assert s["drafter_version"] == 2 and oai.spec_stats(report)["drafter_version"] is None
    assert (s["num_spec_steps"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (3, 14, 5)
    assert s["acceptance_histogram"] == [2, 2, 1]  # depth 1: two steps, depth 2: two, depth 3: one
    assert s["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert s["draft_acceptance_rate"] == pytest.approx(5 / 14)
    none = oai.spec_stats({**report, "rounds": rounds[:1]})
    assert none["num_spec_steps"] == 0 and none["draft_acceptance_rate"] == 0.0


def test_api_key():
    oai.check_api_key(None, None)  # no key configured: open
    oai.check_api_key("s3cret", "Bearer s3cret")
    for header in (None, "", "Bearer wrong", "s3cret", "Basic s3cret"):
        with pytest.raises(oai.OpenAIError) as info:
            oai.check_api_key("s3cret", header)
        assert info.value.status == 401 and "s3cret" not in info.value.message
