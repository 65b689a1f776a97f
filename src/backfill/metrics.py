"""Prometheus metrics (SPEC §11.5): counts and timings only, never content."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """One registry per process, passed explicitly (no module-level state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.results = Counter(
            "backfill_results", "Request results stored, by outcome.", ["outcome"], registry=r
        )
        self.tokens = Counter(
            "backfill_tokens", "Tokens of stored successful results.", ["kind"], registry=r
        )
        self.notifications = Counter(
            "backfill_notifications",
            "Notification attempts (webhooks, endpoint events, emails), by how they ended.",
            ["channel", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "backfill_engine_retries",
            "Engine attempts retried, by reason.",
            ["engine", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "backfill_engine_latency_seconds",
            "Time of one engine attempt.",
            ["engine"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.given_back = Counter(
            "backfill_engine_given_back",
            "Batch requests given back to people waiting for their slot on a shared engine "
            "(aborted; their lines queued again, uncharged, no attempt counted).",
            ["engine"],
            registry=r,
        )
        self.given_back_seconds = Counter(
            "backfill_engine_given_back_seconds",
            "Engine time the given-back requests had run: the batch work thrown away.",
            ["engine"],
            registry=r,
        )
        self.engine_metrics_unread = Counter(
            "backfill_engine_metrics_unread",
            "Reads of a shared engine's /metrics that failed (timed out, refused, or without "
            "the names followed): while they fail its limit follows latency, and people "
            "waiting there get no slots given back.",
            ["engine"],
            registry=r,
        )
        self.in_flight = Gauge(
            "backfill_engine_in_flight", "Requests in flight per engine.", ["engine"], registry=r
        )
        self.concurrency_limit = Gauge(
            "backfill_engine_concurrency_limit",
            "Batch requests each engine may have in flight now (adaptive on shared engines).",
            ["engine"],
            registry=r,
        )
        self.engine_pressure = Gauge(
            "backfill_engine_pressure",
            "What a shared engine's limit follows: interactive requests on it (signal "
            "metrics) or Backfill's latency over its floor (signal latency).",
            ["engine"],
            registry=r,
        )
        self.engine_step_seconds = Gauge(
            "backfill_engine_step_seconds",
            "A shared engine's step time as Backfill has learnt it, base + per_sequence x n "
            "+ per_sequence_squared x n² for n running sequences (from its inter-token "
            "latency): what people's latency budget caps batch sequences by. Absent until "
            "learnt.",
            ["engine", "part"],
            registry=r,
        )
        self.engine_healthy = Gauge(
            "backfill_engine_healthy",
            "1 while some live worker's health check of the engine passes, 0 while every "
            "worker finds it down (engines stopped until work waits for them are left out).",
            ["engine"],
            registry=r,
        )
        self.batches_waiting_on_engine = Gauge(
            "backfill_batches_waiting_on_engine",
            "Running batches with lines not done whose model no healthy engine serves now.",
            ["model"],
            registry=r,
        )
        self.stored_file_damaged = Counter(
            "backfill_stored_file_damaged",
            "Reads that found a stored file missing or damaged, by kind (missing, truncated, "
            "header, segment, size_mismatch); the log line names the file. Restore from backup.",
            ["kind"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "backfill_queue_depth", "Requests of unfinished batches not yet done.", registry=r
        )
        self.batches = Gauge("backfill_batches", "Batches by status.", ["status"], registry=r)
        self.dispatch_share = Gauge(
            "backfill_dispatch_share",
            "Each org's part (0..1) of the requests its model's engines took during the "
            "planner's last interval.",
            ["model", "org"],
            registry=r,
        )

        # What each model's queue asks of its fleet (docs/deployment.md, "Autoscaling on
        # Backfill's demand"): computed from the database at each scrape, the same in every
        # process.
        self.model_queued_requests = Gauge(
            "backfill_model_queued_requests",
            "Requests of the model's validating and in-progress batches not yet done.",
            ["model"],
            registry=r,
        )
        self.model_queued_tokens_bound = Gauge(
            "backfill_model_queued_tokens_bound",
            "Tokens those requests may take at most: the prompt bound counted at upload plus "
            "the output limits, in proportion to the requests not done.",
            ["model"],
            registry=r,
        )
        self.model_replicas = Gauge(
            "backfill_model_replicas",
            "Replicas of the model up now: engines some live worker's health check finds "
            "answering.",
            ["model"],
            registry=r,
        )
        self.model_replica_requests_per_s = Gauge(
            "backfill_model_replica_requests_per_s",
            "Requests per second one replica of the model serves while it has work, as the "
            "planner measured it. Absent until measured.",
            ["model"],
            registry=r,
        )
        self.model_replicas_needed = Gauge(
            "backfill_model_replicas_needed",
            "Replicas that finish every accepted batch of the model before its deadline less "
            "the planner's margin, at the measured rate per replica: 0 with nothing queued, "
            "at least 1 while anything is (the replicas up until the rate is measured).",
            ["model"],
            registry=r,
        )

    def forget_engine(self, name: str) -> None:
        """Drop the gauges the worker sets for an engine that left the pool (a replica gone);
        its counters stay, as counters do."""
        for gauge in (self.in_flight, self.concurrency_limit, self.engine_pressure):
            with contextlib.suppress(KeyError):
                gauge.remove(name)
        for part in ("base", "per_sequence", "per_sequence_squared"):
            with contextlib.suppress(KeyError):
                self.engine_step_seconds.remove(name, part)

    def count_stored_file_damaged(self, kind: str) -> None:
        """One read found stored content missing or damaged (``kind`` as the counter's)."""
        self.stored_file_damaged.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
