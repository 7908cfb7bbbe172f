"""Telemetry: per-round spans and the speculation metrics, from one hand-built round."""

from __future__ import annotations

import torch
from prometheus_client.parser import text_string_to_metric_families

from eyas.generate import RoundRecord
from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree, flatten_tree
from eyas.serve.telemetry import Telemetry, acceptance_by, confidence_bucket


def one_round() -> RoundRecord:
    """Tree: A (depth 1, p .95) -> A1 (depth 2, p .45); B (depth 1, p .05). Flat rows [root, A, A1, B].
    The target accepts A only: accepted_rows [0, 1], frontier 42."""
    tree = DraftTree(
        torch.tensor([10, 11, 20]),
        torch.tensor([PARENT_IS_ROOT, 0, PARENT_IS_ROOT]),
        torch.tensor([1, 2, 1]),
        torch.tensor([0.95, 0.45, 0.05]),
    )
    flat = flatten_tree(tree, 5, 100)
    assert flat.tokens.tolist() == [5, 10, 11, 20]
    decision = AcceptDecision(torch.tensor([0, 1]), torch.tensor([10]), 42)
    return RoundRecord(
        request_id="r1",
        round=3,
        flat=flat,
        decision=decision,
        start_ns=1_000_000_000,
        draft_s=0.010,
        pack_s=0.001,
        verify_s=0.030,
        accept_s=0.002,
        publish_s=0.003,
        fallback=False,
    )


def test_confidence_buckets():
    assert [confidence_bucket(p) for p in (0.0, 0.05, 0.45, 0.95, 1.0)] == [
        "0.0-0.1",
        "0.0-0.1",
        "0.4-0.5",
        "0.9-1.0",
        "0.9-1.0",
    ]


def test_one_round_gives_acceptance_by_depth_and_by_confidence():
    t = Telemetry()
    t.add_kv_source(lambda: {"target": 1000, "draft": 10})
    t.add_kv_source(lambda: {"target": 24})
    t.record_round(one_round())
    t.record_request("eagle3", "length", fallback=False)
    m = t.metrics()
    assert acceptance_by(m, "eyas.draft.proposed", "eyas.draft.accepted", "depth") == {"1": 0.5, "2": 0.0}
    assert acceptance_by(m, "eyas.draft.confidence.proposed", "eyas.draft.confidence.accepted", "bucket") == {
        "0.0-0.1": 0.0,
        "0.4-0.5": 0.0,
        "0.9-1.0": 1.0,
    }
    (rows,) = m["eyas.verify_rows"]
    assert rows["count"] == 1 and rows["sum"] == 4
    assert m["eyas.accept_length"][0]["sum"] == 1
    assert {p["attributes"]["side"]: p["value"] for p in m["eyas.kv_bytes"]} == {"target": 1024, "draft": 10}
    assert m["eyas.requests"][0] == {
        "attributes": {"method": "eagle3", "finish_reason": "length", "model_name": ""},
        "value": 1,
    }


def test_one_round_gives_a_span_tree_with_every_step():
    t = Telemetry()
    t.record_round(one_round())
    spans = {s["name"]: s for s in t.recent_spans()}
    assert set(spans) == {"eyas.round", "draft", "pack", "verify", "accept", "publish"}
    root = spans["eyas.round"]
    assert root["parent"] is None and root["attributes"]["eyas.accept_length"] == 1
    assert all(spans[n]["parent"] == root["span_id"] for n in ("draft", "pack", "verify", "accept", "publish"))
    assert abs(root["duration_ms"] - 44.0) < 1e-6  # draft + pack + verify + publish; accept lies inside verify
    assert abs(spans["accept"]["duration_ms"] - 2.0) < 1e-6


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_text_has_vllms_spec_decode_counters_and_latencies():
    """The OTel Prometheus exporter's text, parsed by prometheus_client: the round above is one draft
    of 3 tokens with 1 accepted (at position 0); a request's duration and time to first token."""
    t = Telemetry()
    t.add_load_source(lambda: {"num_requests_running": 1, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.25})
    t.record_round(one_round())
    t.record_latency("eagle3", 1.5, 0.2)
    fam = _families(t.prometheus_text())
    value = {
        name: fam[name].samples[0].value
        for name in (
            "eyas_spec_decode_num_drafts",
            "eyas_spec_decode_num_draft_tokens",
            "eyas_spec_decode_num_accepted_tokens",
        )
    }
    assert value == {
        "eyas_spec_decode_num_drafts": 1,
        "eyas_spec_decode_num_draft_tokens": 3,
        "eyas_spec_decode_num_accepted_tokens": 1,
    }
    per_pos = {s.labels["position"]: s.value for s in fam["eyas_spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"0": 1}
    assert fam["eyas_num_requests_waiting"].samples[0].value == 2
    hist = {s.name: s.value for s in fam["eyas_time_to_first_token_seconds"].samples if not s.labels.get("le")}
    assert hist["eyas_time_to_first_token_seconds_count"] == 1
    assert hist["eyas_time_to_first_token_seconds_sum"] == 0.2
    assert fam["eyas_verify_duration_seconds"].type == "histogram"


def test_merged_replicas_keep_every_sample_with_its_replica():
    from eyas.serve.telemetry import merge_prometheus

    a, b = Telemetry(), Telemetry()
    a.record_round(one_round())
    b.record_round(one_round())
    b.record_round(one_round())
    fam = _families(merge_prometheus({"A": a.prometheus_text(), "B": b.prometheus_text()}))
    drafts = {s.labels["replica"]: s.value for s in fam["eyas_spec_decode_num_drafts"].samples}
    assert drafts == {"A": 1, "B": 2}
    assert merge_prometheus({}) == ""


def test_every_series_the_grafana_dashboard_charts_is_in_the_scrape_with_model_name():
    """docs/grafana/eyas.json (vLLM's dashboard under Eyas's prefix) loads, and each series one of its
    queries names is in a replica's scrape, parsed by prometheus_client, labelled with model_name."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "eyas.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\beyas_[a-z0-9_]+", e)}
    assert len(wanted) >= 15, wanted

    t = Telemetry(model_name="smollm2-135m")
    t.add_load_source(lambda: {"num_requests_running": 1, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.1})
    t.add_prefix_cache_source(lambda: {"queries": 40, "hits": 32, "bytes": 1024})
    t.record_round(one_round())
    t.record_latency("eagle3", 1.5, 0.2, 0.01, 12, 30)
    t.record_gap("eagle3", 0.06, 3)
    t.record_request("eagle3", "stop", False)
    samples = [s for f in text_string_to_metric_families(t.prometheus_text()) for s in f.samples]
    names = {s.name for s in samples}
    assert wanted <= names, sorted(wanted - names)
    assert all(s.labels.get("model_name") == "smollm2-135m" for s in samples if s.name in wanted)
    itl = {s.name: s.value for s in samples if s.name.startswith("eyas_inter_token_latency_seconds_")}
    assert (
        itl["eyas_inter_token_latency_seconds_count"] == 3
        and abs(itl["eyas_inter_token_latency_seconds_sum"] - 0.06) < 1e-9
    )
    usage = [s.value for s in samples if s.name == "eyas_kv_cache_usage_perc"]
    assert usage == [0.1]
    assert not [s for s in samples if s.name == "eyas_drafter_version"]  # no drafter version known yet
    t.record_request("eagle3", "stop", False, drafter_version=4)  # a learned version drafted it
    t.record_request("target", "stop", False, drafter_version=None)
    samples = [s for f in text_string_to_metric_families(t.prometheus_text()) for s in f.samples]
    versions = [(s.labels["method"], s.value) for s in samples if s.name == "eyas_drafter_version"]
    assert versions == [("eagle3", 4.0)]


def test_a_broken_metric_source_leaves_its_series_out_and_says_so(caplog):
    """A source that raises is a WARNING naming the failure, and its series is absent (never a zero)."""

    def broken():
        raise RuntimeError("worker unreachable")

    t = Telemetry(model_name="m")
    t.add_load_source(broken)
    with caplog.at_level("WARNING", logger="eyas.telemetry"):
        names = {f.name for f in text_string_to_metric_families(t.prometheus_text())}
    assert "eyas_num_requests_running" not in names
    assert any("worker unreachable" in r.getMessage() for r in caplog.records)
