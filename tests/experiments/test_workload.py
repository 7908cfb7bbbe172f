"""Autoscaling-experiment building blocks (eyas.experiments.workload): workloads, arrivals, timelines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eyas.experiments.workload import (
    Arrival,
    Phase,
    Sample,
    Timeline,
    Workload,
    arrivals,
    load_window,
    load_workload,
    percentile,
    plot_timeline,
    rate_at,
    scaling_events,
    scaling_report,
    summary,
    total_duration,
)

WORKLOADS = Path(__file__).resolve().parents[2] / "ray_configs" / "workloads"
SHIPPED = ("step_burst.yaml", "diurnal.yaml", "short_to_long.yaml")


def mix(*kinds: tuple[str, float], max_new_tokens: int = 8) -> dict:
    """A mix dict with one prompt kind per ``(name, weight)``."""
    return {
        "prompts": [
            {"name": n, "weight": w, "prompt": f"Question {n}?", "max_new_tokens": max_new_tokens} for n, w in kinds
        ]
    }


def workload(phases: list[dict], seed: int = 0, mixes: dict | None = None, **kw) -> Workload:
    mixes = mixes or {"chat": mix(("a", 1.0))}
    return Workload(name="t", seed=seed, phases=phases, mixes=mixes, default_mix=next(iter(mixes)), **kw)


# ---- arrivals ----------------------------------------------------------------------------------------


def test_arrivals_deterministic_per_seed():
    """The same seed gives the identical list; another seed a different one. Both sorted, in range."""
    phases = [{"duration_s": 20, "rate_start": 1.0}, {"duration_s": 20, "rate_start": 3.0, "rate_end": 0.5}]
    first, again = arrivals(workload(phases, seed=7)), arrivals(workload(phases, seed=7))
    other = arrivals(workload(phases, seed=8))
    assert first == again and len(first) > 10
    assert [a.t for a in first] != [a.t for a in other]
    for arr in (first, other):
        assert [a.t for a in arr] == sorted(a.t for a in arr)
        assert all(0 <= a.t < 40 for a in arr)
        assert all(a.phase == (0 if a.t < 20 else 1) for a in arr)
    assert isinstance(first[0], Arrival) and first[0].prompt == "Question a?" and first[0].max_new_tokens == 8


def test_constant_phase_count_within_4_sd():
    """Poisson counts: over 5 seeds of one 500 s phase at 2 req/s the expected count is 1000 per run
    and its standard deviation sqrt(1000) ~ 31.6, so the mean of the 5 counts has sd sqrt(1000 / 5)
    ~ 14.1. Threshold: |mean - 1000| < 4 sd (56.6); each single run also within 4 sd (126.5)."""
    rate, duration, seeds = 2.0, 500.0, range(5)
    counts = [len(arrivals(workload([{"duration_s": duration, "rate_start": rate}], seed=s))) for s in seeds]
    expected = rate * duration
    assert all(abs(c - expected) < 4 * math.sqrt(expected) for c in counts), counts
    assert abs(sum(counts) / len(counts) - expected) < 4 * math.sqrt(expected / len(counts)), counts


def test_ramp_count_within_4_sd():
    """Thinning on a linear ramp 0 -> 2 req/s over 300 s: the expected count is the area under the
    rate, 300 (the mean rate 1.0 x 300 s). Threshold: 4 sd = 4 sqrt(300) ~ 69.3. The first half
    (mean rate 0.5) expects 75 and the second 225: the later half must hold clearly more."""
    arr = arrivals(workload([{"duration_s": 300, "rate_start": 0.0, "rate_end": 2.0}], seed=3))
    assert abs(len(arr) - 300) < 4 * math.sqrt(300)
    early = sum(1 for a in arr if a.t < 150)
    assert abs(early - 75) < 4 * math.sqrt(75)
    assert len(arr) - early > 2 * early


def test_zero_rate_phase_has_no_arrivals():
    arr = arrivals(workload([{"duration_s": 10, "rate_start": 0.0}, {"duration_s": 10, "rate_start": 5.0}]))
    assert arr and all(a.phase == 1 and a.t >= 10 for a in arr)


def test_rate_at_ramps():
    """Linear 1 -> 3 over 10 s, then cosine 0 -> 2 over 10 s, then constant 0.5 for 5 s.

    Cosine at fraction f is ``start + (end - start) * (1 - cos(pi f)) / 2``: at f = 0.25 that is
    2 * (1 - cos(pi/4)) / 2 = 0.2929, at f = 0.5 the midpoint 1.0. Phases are half-open
    ``[start, end)``: at t = 10 the second phase's start (0.0) applies; outside [0, 25) the rate is 0.
    """
    w = workload(
        [
            {"duration_s": 10, "rate_start": 1.0, "rate_end": 3.0},
            {"duration_s": 10, "rate_start": 0.0, "rate_end": 2.0, "shape": "cosine"},
            {"duration_s": 5, "rate_start": 0.5},
        ]
    )
    assert total_duration(w) == 25.0
    expected = {
        0.0: 1.0,
        2.5: 1.5,
        5.0: 2.0,
        9.999: 2.9998,
        10.0: 0.0,
        12.5: 1 - math.cos(math.pi / 4),
        15.0: 1.0,
        17.5: 1 + math.cos(math.pi / 4),
        20.0: 0.5,
        24.9: 0.5,
        25.0: 0.0,
        -1.0: 0.0,
    }
    for t, rate in expected.items():
        assert rate_at(w, t) == pytest.approx(rate, abs=1e-9), t


def test_phase_rate_end_defaults_to_start():
    phase = Phase(duration_s=4, rate_start=0.7)
    assert phase.end_rate == 0.7 and phase.rate(0) == phase.rate(2) == phase.rate(4) == 0.7


def test_mix_weights_respected():
    """Kinds are drawn by weight from the phase's mix. Weights 3 : 1 over ~4000 arrivals (10 req/s for
    400 s): chi-square goodness of fit with 1 degree of freedom must stay below 10.83 (p = 0.001).
    A second phase naming mix "other" draws only its own kind."""
    mixes = {"main": mix(("common", 3.0), ("rare", 1.0)), "other": mix(("only", 1.0))}
    w = workload(
        [{"duration_s": 400, "rate_start": 10.0}, {"duration_s": 20, "rate_start": 1.0, "mix": "other"}],
        mixes=mixes,
        seed=11,
    )
    arr = arrivals(w)
    first = [a.kind for a in arr if a.phase == 0]
    n = len(first)
    observed = {"common": first.count("common"), "rare": first.count("rare")}
    expected = {"common": 0.75 * n, "rare": 0.25 * n}
    chi2 = sum((observed[k] - expected[k]) ** 2 / expected[k] for k in observed)
    assert chi2 < 10.83, (observed, expected)
    assert {a.kind for a in arr if a.phase == 1} == {"only"}


# ---- workload files ----------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
name: ok
phases:
  - {duration_s: 5, rate_start: 1}
  - {duration_s: 5, rate_start: 1, mix: short}
  - {duration_s: 5, rate_start: 1, mix: MIXNAME}
default_mix: short
mixes:
  short:
    prompts:
      - {name: a, weight: 1, prompt: "Hi?", max_new_tokens: 4}
"""


def test_good_yaml_loads(tmp_path):
    w = load_workload(write(tmp_path, "ok.yaml", GOOD.replace("MIXNAME", "short")))
    assert w.name == "ok" and len(w.phases) == 3 and w.method == "eagle3" and w.drain_s == 30


@pytest.mark.parametrize(
    "name, text, field",
    [
        ("mix.yaml", GOOD.replace("MIXNAME", "long"), "phases.2.mix: unknown mix 'long'; known: ['short']"),
        (
            "default.yaml",
            GOOD.replace("MIXNAME", "short").replace("default_mix: short", "default_mix: nope"),
            "default_mix: unknown mix 'nope'",
        ),
        (
            "negative.yaml",
            GOOD.replace("MIXNAME", "short").replace(
                "{duration_s: 5, rate_start: 1}", "{duration_s: -5, rate_start: 1}"
            ),
            "phases.0.duration_s: ",
        ),
        ("extra.yaml", GOOD.replace("MIXNAME", "short") + "colour: blue\n", "colour: "),
        (
            "tokens.yaml",
            GOOD.replace("MIXNAME", "short").replace("max_new_tokens: 4", "max_new_tokens: 0"),
            "mixes.short.prompts.0.max_new_tokens: ",
        ),
        (
            "shape.yaml",
            GOOD.replace("MIXNAME", "short").replace(
                "rate_start: 1, mix: short}", "rate_start: 1, mix: short, shape: square}"
            ),
            "phases.1.shape: ",
        ),
    ],
)
def test_bad_yaml_names_file_and_field(tmp_path, name, text, field):
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError) as info:
        load_workload(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}"), message


@pytest.mark.parametrize("text", ["name: [unclosed\n", "- just\n- a list\n"])
def test_unreadable_yaml_names_file(tmp_path, text):
    path = write(tmp_path, "broken.yaml", text)
    with pytest.raises(ValueError, match=r"broken\.yaml: "):
        load_workload(path)


@pytest.mark.parametrize("filename", SHIPPED)
def test_shipped_workloads_load(filename):
    path = WORKLOADS / filename
    assert path.read_text().startswith("#"), "each workload file opens with a comment saying what it tests"
    w = load_workload(path)
    assert w.relative, "the shipped workloads are written in units of the calibrated capacity"
    arr = arrivals(w.at_capacity(2.0))
    assert w.name == path.stem and arr and all(a.t < total_duration(w) for a in arr)


def test_shipped_step_burst_shape():
    w = load_workload(WORKLOADS / "step_burst.yaml").at_capacity(2.0)
    assert total_duration(w) == 100
    assert [rate_at(w, t) for t in (5, 40, 80)] == [0.6, 4.0, 0.1]  # 0.3x, 2x, 0.05x of 2 req/s
    assert load_window(w) == (30.0, 70.0)
    tokens = {k.max_new_tokens for m in w.mixes.values() for k in m.prompts}
    assert min(tokens) >= 16 and max(tokens) <= 24


# ---- rates in units of capacity -------------------------------------------------------------------------


def test_a_rate_in_capacity_units_resolves_against_the_measured_capacity():
    """'3x' is three times the capacity; a number stays requests/s; the same file at twice the capacity
    sends about twice the requests (a faster machine gets a proportionally heavier load)."""
    w = workload([{"duration_s": 60, "rate_start": "0.5x"}, {"duration_s": 60, "rate_start": "3x", "rate_end": 1.5}])
    assert w.relative and not w.at_capacity(2.0).relative
    fast = w.at_capacity(4.0)
    assert (fast.phases[0].rate_start, fast.phases[1].rate_start, fast.phases[1].rate_end) == (2.0, 12.0, 1.5)
    slow_n = sum(a.phase == 0 for a in arrivals(w.at_capacity(2.0)))
    fast_n = sum(a.phase == 0 for a in arrivals(fast))
    assert 60 - 4 * 60**0.5 < slow_n < 60 + 4 * 60**0.5 and 1.5 < fast_n / slow_n < 2.6
    with pytest.raises(ValueError, match="multiple of the calibrated capacity"):
        arrivals(w)  # not resolved yet: no silent guess of the capacity
    with pytest.raises(ValueError, match="capacity_per_s"):
        w.at_capacity(0.0)


@pytest.mark.parametrize("bad", ["3", "x3", "3y", "-1x"])
def test_a_bad_rate_names_its_field(tmp_path, bad):
    text = GOOD.replace("MIXNAME", "short").replace(
        "{duration_s: 5, rate_start: 1}", f"{{duration_s: 5, rate_start: '{bad}'}}"
    )
    path = write(tmp_path, "rate.yaml", text)
    with pytest.raises(ValueError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}: phases.0.rate_start: ") and "'3x'" in str(info.value)


def test_the_calibration_mix_must_exist():
    with pytest.raises(ValueError, match="calibration.mix: unknown mix 'long'"):
        workload([{"duration_s": 5, "rate_start": "1x"}], calibration={"mix": "long"})
    assert workload([{"duration_s": 5, "rate_start": "1x"}]).calibration_mix().prompts[0].name == "a"


# ---- the scaling report ---------------------------------------------------------------------------------


def test_scaling_events_worked_example():
    """initial 1; asked 2 at t=5, running 2 at t=9, back to 1 at t=20; the window ends at 12."""
    ev = scaling_events([(0, 1, 1), (5, 2, 1), (9, 2, 2), (20, 1, 1)], initial=1, end=12)
    assert (ev.asked_at, ev.running_at, ev.back_at, ev.peak) == (5, 9, 20, 2)
    never = scaling_events([(0, 1, 1), (5, 1, 1)], initial=1, end=3)
    assert (never.asked_at, never.running_at, never.back_at, never.peak) == (None, None, None, 1)


def scaled(asked: list[int], running: list[int], rows: list[float]) -> Timeline:
    """One sample a second; target replicas asked / running and pending verify rows per second."""
    timeline = Timeline("t")
    for t, (a, r, w) in enumerate(zip(asked, running, rows)):
        timeline.add(
            Sample(
                t=float(t),
                request_rate=1.0,
                in_flight=1,
                completed=t,
                pending_verify_rows=w,
                draft_rows=0.0,
                kv_bytes_used=0.0,
                replicas={"EyasTarget": r},
                nodes={"target_host": r},
                p50_latency_s=None,
                p99_latency_s=None,
                tokens_per_s=1.0,
                asked_replicas={"EyasTarget": a},
                asked_nodes={"target_host": a},
            )
        )
    return timeline


BURST = workload(
    [
        {"duration_s": 4, "rate_start": 0.1},
        {"duration_s": 4, "rate_start": 2, "label": "burst_start"},
        {"duration_s": 4, "rate_start": 0},
    ]
)  # the load window is [4, 8)


@pytest.mark.parametrize(
    "asked, running, rows, why",
    [
        (
            [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 1, 1],
            [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1],
            [0, 0, 0, 0, 90, 90, 90, 0, 0, 0, 0, 0],
            None,
        ),
        (
            [1] * 12,
            [1] * 12,
            [10] * 12,
            "thresholds not crossed: pending verify rows per target replica peaked at 10, under the policy's 64",
        ),
        (
            [1] * 12,
            [1] * 12,
            [0, 0, 0, 0, 0, 90, 0, 0, 0, 0, 0, 0],
            "crossed the threshold at 5.0 s but no replica was asked for",
        ),
        (
            [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2],
            [1] * 12,
            [90] * 12,
            "capacity unavailable: a replica was asked for at 5.0 s",
        ),
        (
            [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 1, 1],
            [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 1, 1],
            [0, 0, 0, 0, 90, 90, 90, 90, 0, 0, 0, 0],
            "too slow: the replica asked for at 5.0 s ran at 8.0 s, after the load ended at 8.0 s",
        ),
        (
            [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2],
            [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2],
            [0, 0, 0, 0, 90, 90, 90, 0, 0, 0, 0, 0],
            "the added capacity was not given back",
        ),
        (
            [1, 1, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1],
            [1, 1, 1, 2, 2, 2, 2, 2, 1, 1, 1, 1],
            [90] * 12,
            "scaled before the load window: a replica was asked for at 2.0 s",
        ),
    ],
)
def test_the_report_calls_a_run_a_success_only_when_it_scaled_in_the_window_and_back_and_says_why_not(
    asked, running, rows, why
):
    rep = scaling_report(
        scaled(asked, running, rows), BURST, deployment="EyasTarget", node_type="target_host", rows_per_replica=64
    )
    assert rep["window"] == [4.0, 8.0] and rep["success"] is (why is None)
    if why is None:
        assert rep["time_to_added_capacity_s"] == 2.0 and rep["replica"]["back_at"] == 10 and rep["scale_down_s"] == 2.0
        assert rep["node"]["running_at"] == 6 and rep["threshold"]["crossed_at"] == 4.0
    else:
        assert rep["why"].startswith(why), rep["why"]


def test_errors_fail_the_report_and_a_steady_workload_is_not_judged():
    ok = (
        [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 1, 1],
        [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1],
        [0, 0, 0, 0, 90, 90, 90, 0, 0, 0, 0, 0],
    )
    rep = scaling_report(scaled(*ok), BURST, deployment="EyasTarget", node_type=None, rows_per_replica=64, incorrect=1)
    assert not rep["success"] and rep["why"] == "0 errors and 1 incorrect answers" and rep["node"] is None
    steady = BURST.model_copy(update={"expect_scaling": False})
    rep = scaling_report(
        scaled([1] * 12, [1] * 12, [0] * 12), steady, deployment="EyasTarget", node_type=None, rows_per_replica=64
    )
    assert not rep["success"] and not rep["expected"] and "expect_scaling: false" in rep["why"]


# ---- timeline ----------------------------------------------------------------------------------------


def sample(t: float, replicas: int = 1, nodes: int = 1, p99: float | None = None, completed: int = 0) -> Sample:
    return Sample(
        t=t,
        request_rate=0.5,
        in_flight=2,
        completed=completed,
        pending_verify_rows=10.0,
        draft_rows=4.0,
        kv_bytes_used=1e6,
        replicas={"EyasServer": 1, "TargetWorker": replicas},
        nodes={"head": 1, "cpu_worker": nodes},
        p50_latency_s=None if p99 is None else p99 / 2,
        p99_latency_s=p99,
        tokens_per_s=12.5,
    )


def hand_built() -> Timeline:
    """11 samples, t = 0..10 s, burst at t = 5.

    TargetWorker replicas: 1 until t = 6, 2 from t = 7, 3 from t = 9. Worker nodes: 1 until t = 7,
    2 from t = 8 (total nodes 2 -> 3). p99: none at t = 0, then 1.0, 1.2, 1.1, 1.4 (t = 1..4, before
    the burst), 3.0 at t = 5, 4.5 at t = 6, 2.0 after. Completed: t, cumulative.
    """
    timeline = Timeline("step_burst", meta={"seed": 0})
    p99s = [None, 1.0, 1.2, 1.1, 1.4, 3.0, 4.5, 2.0, 2.0, 2.0, 2.0]
    for t in range(11):
        replicas = 1 if t < 7 else (2 if t < 9 else 3)
        timeline.add(sample(float(t), replicas=replicas, nodes=1 if t < 8 else 2, p99=p99s[t], completed=t))
    timeline.mark(5.0, "burst_start", rate=2.0)
    timeline.mark(7.0, "replica_added", deployment="TargetWorker")
    return timeline


def test_summary_worked_example():
    """With the burst at t = 5 (from the "burst_start" event):

    * TargetWorker replicas in force at 5 are 1; the first sample at/after 5 with more is t = 7, so
      time_to_added_capacity 7 - 5 = 2.0. EyasServer stays at 1: None.
    * total nodes in force at 5 are 2; the first sample with more is t = 8: 3.0.
    * p99_burst = max p99 over t in [5, 65] = 4.5; p99_steady = median(1.0, 1.2, 1.1, 1.4) = 1.15
      (t = 0 has no p99 and is skipped).
    * peaks / finals: TargetWorker 3, nodes cpu_worker 2, total 3; completed 10.
    """
    s = summary(hand_built())
    assert s["burst_t"] == 5.0
    assert s["time_to_added_capacity_s"] == {"replicas": {"EyasServer": None, "TargetWorker": 2.0}, "nodes": 3.0}
    assert s["p99_burst_s"] == 4.5
    assert s["p99_steady_s"] == pytest.approx(1.15)
    assert s["peak_replicas"] == {"EyasServer": 1, "TargetWorker": 3}
    assert s["peak_nodes"] == {"cpu_worker": 2, "head": 1} and s["peak_nodes_total"] == 3
    assert s["final_replicas"] == {"EyasServer": 1, "TargetWorker": 3}
    assert s["final_nodes"] == {"cpu_worker": 2, "head": 1}
    assert s["completed"] == 10


def test_summary_explicit_burst_and_none():
    """An explicit burst_t overrides the event: at t = 7 the 2 replicas are the baseline, the rise to 3
    comes at t = 9 (2.0 s). Without any burst, capacity times and the burst p99 are None and the
    steady p99 is the median over every sample with one. An empty timeline gives zeros / empties."""
    late = summary(hand_built(), burst_t=7.0)
    assert late["time_to_added_capacity_s"]["replicas"]["TargetWorker"] == 2.0
    assert late["time_to_added_capacity_s"]["nodes"] == 1.0
    no_burst = hand_built()
    no_burst.events = []
    s = summary(no_burst)
    assert s["burst_t"] is None and s["p99_burst_s"] is None
    assert s["time_to_added_capacity_s"] == {"replicas": {"EyasServer": None, "TargetWorker": None}, "nodes": None}
    assert s["p99_steady_s"] == 2.0
    empty = summary(Timeline("empty"))
    assert empty["completed"] == 0 and empty["peak_replicas"] == {} and empty["p99_steady_s"] is None


def test_timeline_json_round_trip(tmp_path):
    timeline = hand_built()
    path = tmp_path / "out" / "timeline.json"
    timeline.write_json(path)
    data = json.loads(path.read_text())
    assert set(data) == {"workload", "meta", "samples", "events", "summary"}
    assert data["summary"]["time_to_added_capacity_s"]["replicas"]["TargetWorker"] == 2.0
    back = Timeline.from_json(data)
    assert back.workload_name == "step_burst" and back.meta == {"seed": 0}
    assert back.samples == timeline.samples and back.events == timeline.events
    assert back.events[0] == {"t": 5.0, "kind": "burst_start", "rate": 2.0}
    assert back.to_json() == data


def test_percentile():
    """Linear interpolation between closest ranks (numpy's default)."""
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_plot_writes_png(tmp_path):
    path = tmp_path / "timeline.png"
    w = load_workload(WORKLOADS / "step_burst.yaml").at_capacity(2.0)
    plot_timeline(hand_built(), path, workload=w)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    plain = tmp_path / "plain.png"
    plot_timeline(hand_built(), plain)
    assert plain.read_bytes().startswith(b"\x89PNG")
