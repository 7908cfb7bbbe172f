"""The registry's named-cancel book and the rule that decides which in-flight requests a cancel stops."""

from __future__ import annotations

from eyas.serve.registry import CancelBook, cancels_due


def test_cancel_book_hands_out_each_cancel_for_its_ttl_then_forgets_it():
    """ttl 10 s: a cancel issued at t=100 is handed out at t=105 and t=110, gone at t=110.5;
    cancelling again refreshes the time."""
    book = CancelBook(ttl_s=10.0)
    assert book.recent(now=0.0) == {}
    book.cancel("a", now=100.0)
    book.cancel("b", now=104.0)
    assert book.recent(now=105.0) == {"a": 100.0, "b": 104.0}
    assert book.recent(now=110.0) == {"a": 100.0, "b": 104.0}
    assert book.recent(now=110.5) == {"b": 104.0}
    book.cancel("b", now=112.0)
    assert book.recent(now=120.0) == {"b": 112.0}
    assert book.recent(now=122.5) == {}


def test_a_cancel_stops_only_requests_received_no_later_than_it():
    """inflight {"a": 10, "b": 12, "d": 11.5}, cancels {"a": 11, "b": 11.5, "c": 1, "d": 11.5}:
    a (received before its cancel) and d (the same instant) stop; b is a newer request that reuses a
    cancelled name, c is not here."""
    inflight = {"a": 10.0, "b": 12.0, "d": 11.5}
    cancels = {"a": 11.0, "b": 11.5, "c": 1.0, "d": 11.5}
    assert sorted(cancels_due(inflight, cancels)) == ["a", "d"]
    assert cancels_due({}, cancels) == []
    assert cancels_due(inflight, {}) == []


def test_a_cancel_of_a_name_stops_every_choice_of_it():
    """An OpenAI request with n > 1 runs its choices as <id>, <id>#1, <id>#2: cancelling <id> stops
    them all, and no other request whose name merely starts alike."""
    inflight = {"q": 10.0, "q#1": 10.5, "q#2": 10.5, "qq": 10.0, "q#1x": 10.0, "late#1": 20.0}
    assert sorted(cancels_due(inflight, {"q": 11.0, "late": 11.0})) == ["q", "q#1", "q#2"]


def test_a_registry_outage_is_one_warning_not_one_a_period(monkeypatch, caplog):
    """Reports that fail (the registry restarting, or gone) are a WARNING once an outage, at its
    second failure in a row, then quiet; stopping says that the registry could not be told."""
    import time

    from eyas.serve import registry

    def unreachable(app_name):
        raise RuntimeError("registry unreachable")

    monkeypatch.setattr(registry, "get_registry", unreachable)
    with caplog.at_level("DEBUG", logger="eyas.registry"):
        reporter = registry.Reporter("app", "replica-1", "target", lambda: {}, period_s=0.01)
        time.sleep(0.3)
        reporter.stop()
    assert reporter.failures > registry.OUTAGE_FAILURES
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("report to the replica registry failed (RuntimeError: registry unreachable)" in m for m in warned) == 1
    assert any(m.startswith("registry forget(replica-1) failed (RuntimeError") for m in warned)
