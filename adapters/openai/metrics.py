"""Prometheus metrics for the HTTP boundary, in a registry of their own (one per app).

Counters and histograms are counted here as requests pass; every gauge is read from
`controller.statistics()` at scrape time (`render`), so /metrics shows what the
router holds now and nothing has to be kept in step. Per-worker gauges are rebuilt
on each scrape from the router's worker views. deploy/grafana/fencepost.json charts
these series, and tests/deploy/test_grafana.py holds it to them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from adapters.runtime.controller import Controller

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fencepost_requests",
            "Requests by outcome (stop, length, rejected_<status>, error_<kind>, cancelled, "
            "overflow); a legacy completion counts an outcome per prompt once admitted",
            ["outcome"],
            registry=r,
        )
        self.unauthorized = Counter(
            "fencepost_unauthorized_requests",
            "HTTP requests refused with 401 for a missing or unknown API key",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "fencepost_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.completion_tokens = Counter(
            "fencepost_completion_tokens", "Completion tokens delivered to clients", registry=r
        )
        self.reasoning_tokens = Counter(
            "fencepost_reasoning_tokens",
            "Completion tokens of thinking blocks (tags included), of thinking models",
            registry=r,
        )
        self.stored = Counter(
            "fencepost_stored",
            "Responses and chat completions written to the state store, when they ended",
            ["kind"],
            registry=r,
        )
        self.store_errors = Counter(
            "fencepost_store_errors",
            "Times the state store could not be reached (requests refused, writes retried)",
            registry=r,
        )
        self.live_responses = Gauge(
            "fencepost_live_responses",
            "Stored responses this router is generating apart from a connection",
            registry=r,
        )
        self.rejoins = Counter(
            "fencepost_stream_rejoins",
            "Streams of a stored response's events read back (GET ...?stream=true)",
            registry=r,
        )
        self.active_streams = Gauge(
            "fencepost_active_requests", "Requests open at the controller", registry=r
        )
        self.queue_depth = Gauge(
            "fencepost_queue_depth", "Requests waiting for a worker slot", registry=r
        )
        self.healthy_workers = Gauge("fencepost_healthy_workers", "Healthy workers", registry=r)
        self.slots_used = Gauge(
            "fencepost_slots_used", "Worker slots the router counts as taken", registry=r
        )
        self.retries = Gauge(
            "fencepost_attempt_retries",
            "Attempts that failed before the first token and were retried (since start)",
            registry=r,
        )
        self.resumes = Gauge(
            "fencepost_stream_resumes",
            "Started streams continued on another worker from their delivered prefix",
            registry=r,
        )
        self.handoffs = Gauge(
            "fencepost_stream_handoffs",
            "Streams a draining worker handed off, continued on another worker at the "
            "exact token, by outcome (accepted there, or back to the draining worker)",
            ["result"],
            registry=r,
        )
        self.worker_requests = Gauge(
            "fencepost_worker_requests_total",
            "Attempts the router placed on each worker (since the router started)",
            ["worker"],
            registry=r,
        )
        self.prefill_tokens = Gauge(
            "fencepost_prefill_tokens_total",
            "Context tokens submitted for prefill, and of them computed (not found in a "
            "prefix cache), summed over the workers' current processes as they report",
            ["kind"],
            registry=r,
        )
        self.speculative = Gauge(
            "fencepost_speculative_tokens_total",
            "Speculative decoding, summed over the workers' current processes as they "
            "report: tokens proposed, of them accepted (equal to the model's own draw), "
            "and verifications (a sequence's guesses checked in one step)",
            ["kind"],
            registry=r,
        )
        self.fenced = Gauge(
            "fencepost_fenced_messages",
            "Worker messages the router dropped and counted, by reason (duplicate, gap, "
            "stale_attempt, late, wrong_worker, stale_heartbeat, ...), since it started",
            ["reason"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "fencepost_worker_healthy",
            "1 while the router counts the worker healthy (heartbeating, not stuck), else 0",
            ["worker"],
            registry=r,
        )
        self.worker_epoch = Gauge(
            "fencepost_worker_epoch",
            "The epoch the router knows the worker by; it grows when the worker restarts",
            ["worker"],
            registry=r,
        )
        self.worker_capacity = Gauge(
            "fencepost_worker_capacity_slots",
            "Slots the worker has, as its last heartbeat says",
            ["worker"],
            registry=r,
        )
        self.worker_held = Gauge(
            "fencepost_worker_slots_held",
            "Slots on the worker that this router's attempts hold, as the router counts them",
            ["worker"],
            registry=r,
        )
        self.worker_free = Gauge(
            "fencepost_worker_reported_free_slots",
            "Slots the worker's last heartbeat reported free (for any router)",
            ["worker"],
            registry=r,
        )
        self.kv_blocks = Gauge(
            "fencepost_kv_blocks",
            "The worker's KV pool as its last cache report says: blocks held by running "
            "sequences (used), kept for prefix reuse by none (cached), and free",
            ["worker", "state"],
            registry=r,
        )
        self.cache_block_size = Gauge(
            "fencepost_prefix_cache_block_size_tokens",
            "Tokens per KV block in the worker's cache report",
            ["worker"],
            registry=r,
        )
        self.ttft = Histogram(
            "fencepost_time_to_first_token_seconds",
            "From request arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "fencepost_inter_token_latency_seconds",
            "Between consecutive tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        stats = self.controller.statistics()
        self.active_streams.set(stats.open_streams)
        self.queue_depth.set(stats.router.queued)
        self.healthy_workers.set(sum(w.healthy for w in stats.router.workers))
        self.slots_used.set(sum(w.held for w in stats.router.workers))
        self.retries.set(stats.router.retries)
        self.resumes.set(stats.router.resumes)
        back = stats.router.handoffs_back
        self.handoffs.labels("continued").set(stats.router.handoffs - back)
        self.handoffs.labels("back").set(back)
        for reason, count in stats.router.fenced.items():
            self.fenced.labels(reason).set(count)
        per_worker = (
            self.worker_healthy,
            self.worker_epoch,
            self.worker_capacity,
            self.worker_held,
            self.worker_free,
            self.kv_blocks,
            self.cache_block_size,
        )
        for gauge in per_worker:
            gauge.clear()  # only the workers the router knows now, with what it knows now
        submitted = computed = rows = proposed = accepted = 0
        for worker in stats.router.workers:
            wid = worker.worker_id
            self.worker_requests.labels(wid).set(worker.placed)
            self.worker_healthy.labels(wid).set(int(worker.healthy))
            self.worker_epoch.labels(wid).set(worker.epoch)
            self.worker_capacity.labels(wid).set(worker.slots)
            self.worker_held.labels(wid).set(worker.held)
            self.worker_free.labels(wid).set(worker.reported_free_slots)
            if worker.cache is not None:
                cache = worker.cache
                if cache.total_blocks:  # 0: a worker whose report does not say
                    held = cache.total_blocks - cache.free_blocks - cache.cached_blocks
                    self.kv_blocks.labels(wid, "used").set(held)
                    self.kv_blocks.labels(wid, "cached").set(cache.cached_blocks)
                    self.kv_blocks.labels(wid, "free").set(cache.free_blocks)
                self.cache_block_size.labels(wid).set(cache.block_size)
                submitted += worker.cache.prompt_tokens
                computed += worker.cache.computed_tokens
                rows += cache.spec_rows
                proposed += cache.spec_proposed
                accepted += cache.spec_accepted
        self.prefill_tokens.labels("submitted").set(submitted)
        self.prefill_tokens.labels("computed").set(computed)
        self.speculative.labels("proposed").set(proposed)
        self.speculative.labels("accepted").set(accepted)
        self.speculative.labels("verifications").set(rows)
        return generate_latest(self.registry)
