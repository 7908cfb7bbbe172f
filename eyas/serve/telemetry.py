"""Observability with opentelemetry-sdk (design 0x0C): per-round spans and speculation metrics.

No collector is needed. Spans go to an in-memory exporter (the newest ``max_spans`` are kept) and
metrics to an ``InMemoryMetricReader``; :meth:`Telemetry.snapshot` turns both into the JSON that the
``Stats`` RPC returns and ``eyas stats`` prints. ``console=True`` also prints spans; an OTLP
endpoint can be added with ``otlp_endpoint`` when ``opentelemetry-exporter-otlp`` is installed.

Spans, one tree per round: ``eyas.round`` with children ``draft``, ``pack``, ``verify``, ``accept``
(inside verify: the target's decision) and ``publish``, built from the loop's
:class:`~eyas.generate.RoundRecord` after the round (so the loop imports no OTel).

Metrics (instrument names):

- ``eyas.accept_length`` (histogram): candidate tokens accepted per round.
- ``eyas.draft.proposed`` / ``eyas.draft.accepted`` (counters, attribute ``depth``): tree nodes
  verified and accepted at each depth, so acceptance by depth = accepted / proposed.
- ``eyas.draft.confidence.proposed`` / ``.accepted`` (counters, attribute ``bucket``, 10 buckets of
  the drafter's path confidence): calibration of draft confidence against observed acceptance.
- ``eyas.tree_nodes``, ``eyas.verify_rows`` (histograms per round).
- ``eyas.kv_bytes`` (observable gauge, attribute ``side`` = target | draft): bytes held by live sessions.
- ``eyas.requests`` (counter, attributes ``method``, ``finish_reason``) and ``eyas.drafter_fallbacks``.
- ``eyas.drafter_version`` (observable gauge, attribute ``method``): the version of the drafter that
  drafted this replica's last finished answer of the method (0: the one served at start; a learned
  version's number after the learner promoted it, ``eyas.learning``).
- vLLM's spec-decode counters, same meaning: ``eyas.spec_decode.num_drafts`` (rounds that verified a
  drafted token), ``.num_draft_tokens`` (drafted tokens verified), ``.num_accepted_tokens``,
  ``.num_accepted_tokens_per_pos`` (attribute ``position``, 0-based depth).
- ``eyas.draft.duration``, ``eyas.verify.duration`` (histograms per round, seconds).
- The series vLLM's dashboards chart, under Eyas's prefix with vLLM's suffixes (``eyas_`` where vLLM
  writes ``vllm:``), same meaning: ``eyas.time_to_first_token``, ``eyas.inter_token_latency`` (each
  token's share of the gap since the previous streamed chunk: a round emits several at once),
  ``eyas.e2e_request_latency`` and ``eyas.request_queue_time`` (histograms, seconds, from the
  ingress's receipt; attribute ``method``), ``eyas.prompt_tokens`` / ``eyas.generation_tokens``
  (counters), ``eyas.num_requests_running`` / ``eyas.num_requests_waiting`` and
  ``eyas.kv_cache_usage_perc`` (observable gauges; the last a fraction, 0 to 1, of the replica's K/V
  capacity: ``max_batch`` rows of the whole context), ``eyas.prefix_cache.queries`` /
  ``.hits`` (observable counters, prompt tokens).

Every series carries a ``model_name`` label (the served target's name), as vLLM's do, so a dashboard
written for vLLM reads Eyas with its metric prefix changed (``docs/grafana/eyas.json`` is one).

The same instruments also feed an OpenTelemetry ``PrometheusMetricReader`` over a registry of this
object's own (:meth:`Telemetry.prometheus_text`); the app's ``GET /metrics`` merges the target
replicas' texts with a ``replica`` label (:func:`merge_prometheus`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter, SpanExportResult

from eyas.generate import RoundRecord

log = logging.getLogger("eyas.telemetry")

# seconds: rounds on a CPU take tens to hundreds of ms, requests up to minutes
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONFIDENCE_BUCKETS = 10
ROUND_STEPS = ("draft", "pack", "verify", "accept", "publish")


def confidence_bucket(p: float) -> str:
    """'0.0-0.1' ... '0.9-1.0' (1.0 falls in the last)."""
    i = min(int(p * CONFIDENCE_BUCKETS), CONFIDENCE_BUCKETS - 1)
    return f"{i / CONFIDENCE_BUCKETS:.1f}-{(i + 1) / CONFIDENCE_BUCKETS:.1f}"


class _RingExporter(SpanExporter):
    """Keeps the newest ``maxlen`` finished spans."""

    def __init__(self, maxlen: int):
        self.spans: deque[ReadableSpan] = deque(maxlen=maxlen)
        self.lock = threading.Lock()

    def export(self, spans):
        with self.lock:
            self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def snapshot(self) -> list[ReadableSpan]:
        with self.lock:
            return list(self.spans)


class Telemetry:
    def __init__(
        self,
        service_name: str = "eyas",
        *,
        model_name: str = "",
        max_spans: int = 512,
        console: bool = False,
        otlp_endpoint: str | None = None,
    ):
        resource = Resource.create({"service.name": service_name})
        self.labels = {"model_name": model_name}  # on every series
        self.spans = _RingExporter(max_spans)
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        if console:
            self.tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
        self.tracer = self.tracer_provider.get_tracer("eyas")
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from prometheus_client import CollectorRegistry

        self.reader = InMemoryMetricReader()
        self.prometheus_registry = CollectorRegistry(auto_describe=False)  # this object's own, not the global one
        self.prometheus_reader = PrometheusMetricReader(
            registry=self.prometheus_registry, disable_target_info=True, scope_info_enabled=False
        )
        seconds = View(instrument_unit="s", aggregation=ExplicitBucketHistogramAggregation(DURATION_BUCKETS))
        self.meter_provider = MeterProvider(
            metric_readers=[self.reader, self.prometheus_reader], resource=resource, views=[seconds]
        )
        meter = self.meter_provider.get_meter("eyas")
        self.accept_length = meter.create_histogram("eyas.accept_length", unit="{token}")
        self.tree_nodes = meter.create_histogram("eyas.tree_nodes", unit="{node}")
        self.verify_rows = meter.create_histogram("eyas.verify_rows", unit="{row}")
        # MoE targets (design 0x09A): expert weights a request's own verify rows read (the batch's union is a
        # round span attribute and the loop's ``work()["expert_bytes"]``)
        self.expert_bytes = meter.create_histogram("eyas.verify_expert_bytes", unit="By")
        self.proposed = meter.create_counter("eyas.draft.proposed", unit="{node}")
        self.accepted = meter.create_counter("eyas.draft.accepted", unit="{node}")
        self.conf_proposed = meter.create_counter("eyas.draft.confidence.proposed", unit="{node}")
        self.conf_accepted = meter.create_counter("eyas.draft.confidence.accepted", unit="{node}")
        self.requests = meter.create_counter("eyas.requests", unit="{request}")
        self.fallbacks = meter.create_counter("eyas.drafter_fallbacks", unit="{request}")
        self.num_drafts = meter.create_counter("eyas.spec_decode.num_drafts", unit="{draft}")
        self.num_draft_tokens = meter.create_counter("eyas.spec_decode.num_draft_tokens", unit="{token}")
        self.num_accepted_tokens = meter.create_counter("eyas.spec_decode.num_accepted_tokens", unit="{token}")
        self.num_accepted_per_pos = meter.create_counter("eyas.spec_decode.num_accepted_tokens_per_pos", unit="{token}")
        self.draft_duration = meter.create_histogram("eyas.draft.duration", unit="s")
        self.verify_duration = meter.create_histogram("eyas.verify.duration", unit="s")
        self.request_duration = meter.create_histogram("eyas.e2e_request_latency", unit="s")
        self.ttft = meter.create_histogram("eyas.time_to_first_token", unit="s")
        self.itl = meter.create_histogram("eyas.inter_token_latency", unit="s")
        self.queue_time = meter.create_histogram("eyas.request_queue_time", unit="s")
        self.prompt_tokens = meter.create_counter("eyas.prompt_tokens", unit="{token}")
        self.generation_tokens = meter.create_counter("eyas.generation_tokens", unit="{token}")
        self._kv_sources: list[Callable[[], dict[str, int]]] = []
        self._load_sources: list[Callable[[], dict[str, float]]] = []
        meter.create_observable_gauge("eyas.kv_bytes", callbacks=[self._observe_kv], unit="By")
        for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            meter.create_observable_gauge(f"eyas.{key}", callbacks=[lambda o, key=key: self._observe_load(key)])
        # vLLM's prefix-cache counters, same meaning: prompt tokens looked up, and of them found cached
        self._prefix_sources: list[Callable[[], dict[str, int]]] = []
        meter.create_observable_counter(
            "eyas.prefix_cache.queries", callbacks=[lambda o: self._observe_prefix("queries")], unit="{token}"
        )
        meter.create_observable_counter(
            "eyas.prefix_cache.hits", callbacks=[lambda o: self._observe_prefix("hits")], unit="{token}"
        )
        meter.create_observable_gauge(
            "eyas.prefix_cache.bytes", callbacks=[lambda o: self._observe_prefix("bytes")], unit="By"
        )
        self._drafter_versions: dict[str, int] = {}  # method -> the version that drafted its last answer
        meter.create_observable_gauge("eyas.drafter_version", callbacks=[self._observe_versions])

    # --- recording --------------------------------------------------------------------------------
    def add_kv_source(self, source: Callable[[], dict[str, int]]) -> None:
        """``source() -> {"target": bytes, "draft": bytes}``, read at each metrics collection."""
        self._kv_sources.append(source)

    def add_prefix_cache_source(self, source: Callable[[], dict[str, int]]) -> None:
        """``source() -> {"queries", "hits", "bytes", ...}`` (``TargetWorker.prefix_cache_stats``)."""
        self._prefix_sources.append(source)

    def _observe_prefix(self, key: str):
        total = 0
        for source in self._prefix_sources:
            try:
                total += int(source()[key])
            except Exception as err:  # noqa: BLE001 - logged; an unreachable worker must not break metric collection
                log.warning("prefix-cache metric source failed (%s): the series is left out of this scrape", err)
                return []
        return [Observation(total, self.labels)]

    def add_load_source(self, source: Callable[[], dict[str, float]]) -> None:
        """``source() -> {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}``, read
        at each metrics collection."""
        self._load_sources.append(source)

    def _observe_load(self, key: str):
        total = 0.0
        for source in self._load_sources:
            try:
                total += float(source()[key])
            except Exception as err:  # noqa: BLE001 - logged; an unreachable loop must not break metric collection
                log.warning("load metric source failed (%s): %s is left out of this scrape", err, key)
                return []
        return [Observation(total, self.labels)]

    def _observe_kv(self, _options):
        totals: dict[str, int] = {}
        for source in self._kv_sources:
            try:
                for side, n in source().items():
                    totals[side] = totals.get(side, 0) + int(n)
            except Exception as err:  # noqa: BLE001 - logged; an unreachable worker must not break metric collection
                log.warning("kv metric source failed (%s): the series is left out of this scrape", err)
                return []
        return [Observation(n, {"side": side, **self.labels}) for side, n in totals.items()]

    def record_round(self, rec: RoundRecord) -> None:
        """Spans and metrics of one round (design 0x0C)."""
        d = rec.decision
        attrs = {
            "eyas.request_id": rec.request_id,
            "eyas.round": rec.round,
            "eyas.accept_length": d.accept_length,
            "eyas.tree_nodes": 0 if rec.flat is None else rec.flat.num_rows - 1,
            "eyas.fallback": rec.fallback,
        }
        if rec.batch_expert_bytes:
            attrs.update({"eyas.expert_bytes": rec.expert_bytes, "eyas.batch_expert_bytes": rec.batch_expert_bytes})
        root = self.tracer.start_span("eyas.round", start_time=rec.start_ns, attributes=attrs)
        ctx = trace.set_span_in_context(root)
        t = rec.start_ns
        steps = (("draft", rec.draft_s), ("pack", rec.pack_s), ("verify", rec.verify_s))
        for name, seconds in steps:
            end = t + int(seconds * 1e9)
            self.tracer.start_span(name, context=ctx, start_time=t).end(end_time=end)
            if name == "verify":  # the decision closes the verify call, on the target
                self.tracer.start_span("accept", context=ctx, start_time=end - int(rec.accept_s * 1e9)).end(
                    end_time=end
                )
            t = end
        end = t + int(rec.publish_s * 1e9)
        self.tracer.start_span("publish", context=ctx, start_time=t).end(end_time=end)
        root.end(end_time=end)

        self.accept_length.record(d.accept_length, self.labels)
        self.verify_duration.record(rec.verify_s, self.labels)
        rows = 1 if rec.flat is None else rec.flat.num_rows
        self.verify_rows.record(rows, self.labels)
        self.tree_nodes.record(rows - 1, self.labels)
        if rec.batch_expert_bytes:
            self.expert_bytes.record(rec.expert_bytes, self.labels)
        if rec.flat is None or rows == 1:
            return
        self.draft_duration.record(rec.draft_s, self.labels)
        self.num_drafts.add(1, self.labels)
        self.num_draft_tokens.add(rows - 1, self.labels)
        self.num_accepted_tokens.add(d.accept_length, self.labels)
        for position in range(d.accept_length):
            self.num_accepted_per_pos.add(1, {"position": position, **self.labels})
        accepted = set(d.accepted_rows.tolist())
        depths = rec.flat.depths.tolist()
        probs = rec.flat.draft_probs.tolist()
        for row in range(1, rows):
            depth = {"depth": int(depths[row]), **self.labels}
            bucket = {"bucket": confidence_bucket(float(probs[row])), **self.labels}
            self.proposed.add(1, depth)
            self.conf_proposed.add(1, bucket)
            if row in accepted:
                self.accepted.add(1, depth)
                self.conf_accepted.add(1, bucket)

    def record_request(
        self, method: str, finish_reason: str, fallback: bool, drafter_version: int | None = None
    ) -> None:
        """A finished answer; ``drafter_version``: the drafter version that drafted its last tree (None: none)."""
        self.requests.add(1, {"method": method, "finish_reason": finish_reason, **self.labels})
        if fallback:
            self.fallbacks.add(1, {"method": method, **self.labels})
        if drafter_version is not None:
            self._drafter_versions[method] = drafter_version

    def _observe_versions(self, _options):
        return [Observation(v, {"method": m, **self.labels}) for m, v in list(self._drafter_versions.items())]

    def record_latency(
        self,
        method: str,
        duration_s: float,
        ttft_s: float | None,
        queue_s: float = 0.0,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
    ) -> None:
        """A finished request: its time from the ingress's receipt to its end, to its first token and
        to its admission to the batch, and its prompt and generated tokens."""
        attrs = {"method": method, **self.labels}
        self.request_duration.record(max(duration_s, 0.0), attrs)
        if ttft_s is not None:
            self.ttft.record(max(ttft_s, 0.0), attrs)
        self.queue_time.record(max(queue_s, 0.0), attrs)
        self.prompt_tokens.add(prompt_tokens, self.labels)
        self.generation_tokens.add(generation_tokens, self.labels)

    def record_gap(self, method: str, gap_s: float, tokens: int) -> None:
        """A streamed chunk of ``tokens`` tokens ``gap_s`` after the previous one: each token's share
        of the gap is one inter-token latency (a round emits its accepted tokens at once)."""
        attrs = {"method": method, **self.labels}
        for _ in range(tokens):
            self.itl.record(max(gap_s, 0.0) / tokens, attrs)

    def prometheus_text(self) -> str:
        """This object's metrics in Prometheus's text format, as the OTel Prometheus exporter renders them."""
        from prometheus_client import generate_latest

        return generate_latest(self.prometheus_registry).decode()

    # --- reading ----------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """{instrument: [{"attributes": {...}, "value"|"count"/"sum"/"buckets": ...}]}."""
        out: dict[str, list] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    points = []
                    for p in metric.data.data_points:
                        point = {"attributes": dict(p.attributes or {})}
                        if hasattr(p, "bucket_counts"):
                            point.update(
                                count=p.count,
                                sum=p.sum,
                                min=p.min,
                                max=p.max,
                                bounds=list(p.explicit_bounds),
                                buckets=list(p.bucket_counts),
                            )
                        else:
                            point["value"] = p.value
                        points.append(point)
                    out[metric.name] = points
        return out

    def recent_spans(self, limit: int = 60) -> list[dict]:
        spans = self.spans.snapshot()[-limit:]
        return [
            {
                "name": s.name,
                "trace_id": f"{s.context.trace_id:032x}",
                "parent": f"{s.parent.span_id:016x}" if s.parent else None,
                "span_id": f"{s.context.span_id:016x}",
                "duration_ms": (s.end_time - s.start_time) / 1e6,
                "attributes": dict(s.attributes or {}),
            }
            for s in spans
        ]

    def snapshot(self, **extra) -> dict:
        return {"metrics": self.metrics(), "spans": self.recent_spans(), **extra}

    def snapshot_json(self, **extra) -> str:
        return json.dumps(self.snapshot(**extra), default=str)


def acceptance_by(metrics: dict, proposed: str, accepted: str, key: str) -> dict[str, float]:
    """accepted / proposed per attribute value ``key`` (depth or bucket), from :meth:`Telemetry.metrics`."""
    tot = {str(p["attributes"][key]): p["value"] for p in metrics.get(proposed, [])}
    acc = {str(p["attributes"][key]): p["value"] for p in metrics.get(accepted, [])}
    return {k: acc.get(k, 0) / n for k, n in sorted(tot.items()) if n}


def merge_prometheus(texts: dict[str, str]) -> str:
    """Several replicas' Prometheus texts (replica id -> text) as one exposition: each family once,
    every sample labelled with its ``replica``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            merged.samples.extend(
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar) for s in fam.samples
            )

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry).decode()
