"""The oracles of one router's view of its workers: holds, health, declines, cache reports.

Each router-side Oracles (sim/oracles.py) holds one FleetOracles, which
checks what the router believes of each worker against what the worker did:

- a confirmed hold missing from the worker's heartbeats is given up in time,
  and a hold released for a heartbeat's leaving it out is backed by that
  heartbeat (sent after the worker process ended the assignment);
- a worker is called stuck only while its decoder was held back (a hang, a
  stall, a pool out of blocks, the swarm's slowness) or its link was cut all
  through the missed deadline;
- after a decline for want of a slot the worker is offered nothing until
  news of a free slot there;
- the router's (epoch, heartbeat sequence) of a worker never moves back;
- a fresh heartbeat or an accepted offer naming an assignment the router
  does not want is answered with a Cancel in the same step;
- the cached tokens an offer counts are backed by a recent accepted cache
  report, and cache-aware routing floods no worker.

Which disturbances excuse what is sim/disturbances.py's tables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from core.blocks import chain_hashes
from core.protocol import (
    Assignment,
    CacheReport,
    Cancel,
    FromWorkerMessage,
    Heartbeat,
    Offer,
    OfferResult,
    ProgressTimer,
    RouterEffect,
    RouterEvent,
    SendToWorker,
    TimerFired,
)
from core.states import Hold
from sim.disturbances import HEARTBEAT_STOPS, LINK_CUTS, PROGRESS_STOPS

if TYPE_CHECKING:
    from sim.attempts import Attempts
    from sim.disturbances import Disturbances
    from sim.view import ClusterView, NodeView


class FleetOracles:
    """The checks above for one router, reading its requests' attempts (sim/attempts.py)."""

    def __init__(
        self,
        cluster: ClusterView,
        node: NodeView,
        disturbances: Disturbances | None,
        attempts: Attempts,
        violation: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.router = node.router
        self.config = node.router.config
        self.router_id = node.router_id
        self.disturbances = disturbances
        self.attempts = attempts
        self._violation = violation
        self._views: dict[str, tuple[int, int]] = {}
        # The last cache report the router accepted from each worker: (epoch, when, report).
        self._reports: dict[str, tuple[int, float, CacheReport | None]] = {}
        self._holds_before: dict[Assignment, Hold] = {}  # a heartbeat's worker, before it
        self._missing: dict[tuple[str, Assignment], float] = {}  # missing hold -> since
        self._stuck: frozenset[str] = frozenset()  # workers the router holds stuck
        # Workers that declined an offer for want of a slot since their last heartbeat:
        # the holds the router may count there until news of a free slot.
        self._full: dict[str, int] = {}

    def holds(self, worker_id: str) -> dict[Assignment, Hold]:
        """The router's holds on a worker, by state (read from its slot accounting)."""
        record = self.router.fleet.workers.get(worker_id)
        return {} if record is None else {a: h.state for a, h in record.holds.items()}

    def before_heartbeat(self, worker_id: str) -> None:
        """A heartbeat from the worker is about to be handled: its holds before it."""
        self._holds_before = self.holds(worker_id)

    def check_full(self, declined: str | None, offers: list[tuple[str, Offer]]) -> None:
        """A decline for want of a slot spends no attempt, so nothing but this bounds
        how often one request is declined: after a worker declines, the router offers
        it nothing more until it has news of a free slot there (a fresh heartbeat, or
        one of its own holds there released). Each further decline of a request then
        needs such news, at most one per heartbeat of each worker and per slot freed."""
        if declined is None and not self._full:
            return
        sent: Counter[str] = Counter(worker_id for worker_id, _ in offers)
        if declined is not None:
            self._full[declined] = len(self.holds(declined)) - sent[declined]
        for worker_id, count in self._full.items():
            if sent[worker_id] and len(self.holds(worker_id)) > count:
                self._violation(
                    f"offered {worker_id} {sent[worker_id]} more after it declined for want "
                    f"of a slot with {count} held, with no heartbeat or slot freed since"
                )

    def after_heartbeat(
        self, worker_id: str, beat: Heartbeat, before: tuple[int, int, bool] | None, now: float
    ) -> None:
        """A fresh heartbeat: a hold it released for leaving it out must be backed by a
        heartbeat sent after the worker ended that assignment; track the holds it left
        missing; a worker that declined for want of a slot has news of its slots."""
        after = self.router.worker_clock(worker_id)
        if after is None or after[:2] != (beat.epoch, beat.seq):
            return  # fenced
        if before is not None and before[:2] == after[:2]:
            return
        self._full.pop(worker_id, None)
        holds = self.holds(worker_id)
        if before is not None and before[0] == beat.epoch:  # a new epoch loses every hold
            listed = set(beat.active)
            for assignment in self._holds_before:
                if assignment in holds or assignment in listed:
                    continue
                backed = self.cluster.worker_oracles.ended_before(
                    worker_id, self.router_id, beat, assignment
                )
                if backed is False:
                    self._violation(
                        f"router released {assignment} on {worker_id} for its absence from "
                        f"heartbeat {beat.seq} (epoch {beat.epoch}), sent before the worker "
                        "ended it"
                    )
        for key in [k for k in self._missing if k[0] == worker_id]:
            if holds.get(key[1]) is not Hold.MISSING:
                del self._missing[key]
        for assignment, state in holds.items():
            if state is Hold.MISSING:
                self._missing.setdefault((worker_id, assignment), now)

    def check_stuck(self, event: RouterEvent, now: float) -> None:
        """After each router step: each worker the router newly holds stuck is judged."""
        stuck = self.router.fleet.stuck
        if stuck != self._stuck:
            for worker_id in stuck - self._stuck:
                self._check_stuck(worker_id, event, now)
            self._stuck = frozenset(stuck)

    def _check_stuck(self, worker_id: str, event: RouterEvent, now: float) -> None:
        """The router calls a worker stuck only when its decoder really stopped (or was
        slowed) while the attempt's deadline ran: a hang, a stall, a pool out of
        blocks, or a worker the swarm made slow; or when its link was cut all that
        while, so that what went missing could not be asked for again."""
        disturbances = self.disturbances
        if disturbances is None or worker_id in disturbances.slow:
            return
        config = self.config
        since = now - max(config.token_timeout_s, config.first_token_timeout_s)
        if isinstance(event, TimerFired) and isinstance(event.key, ProgressTimer):
            assignment = event.key.assignment
            tally = self.attempts.tallies.get(assignment.request_id)
            for attempt in tally.attempts if tally else ():
                if attempt.assignment == assignment:
                    since = attempt.progress_at
        if disturbances.explains(worker_id, since, now, PROGRESS_STOPS):
            return
        if not disturbances.covers(worker_id, since + disturbances.delay_max_s, now, LINK_CUTS):
            self._violation(
                f"router moved {worker_id} to stuck at {now:.4f}, and its decoder was "
                f"neither hung, stalled, short of blocks nor slow since {since:.4f}"
            )

    def check_missing(self, now: float) -> None:
        """A confirmed hold missing from the worker's heartbeats is given up (released,
        or its attempt failed over) within the heartbeat timeout plus one heartbeat
        interval and the network's delays, whatever else ends it first. A disturbed
        worker's next heartbeat may be lost or late (one interval more); one whose
        heartbeats stop (a stall, a cut, a crash) is ended by the liveness deadline
        instead, one more heartbeat timeout later."""
        if not self._missing:
            return
        config, disturbances = self.config, self.disturbances
        interval = self.cluster.heartbeat_interval_s
        delays = 2 * (disturbances.delay_max_s if disturbances is not None else 0.0)
        bound = config.heartbeat_timeout_s + interval + delays + 0.06
        for (worker_id, assignment), since in list(self._missing.items()):
            if self.holds(worker_id).get(assignment) is not Hold.MISSING:
                del self._missing[worker_id, assignment]
                continue
            allowed = bound
            if disturbances is not None and disturbances.explains(worker_id, since, now):
                allowed += interval
                if disturbances.explains(worker_id, since, now, HEARTBEAT_STOPS):
                    allowed += config.heartbeat_timeout_s
            if now - since > allowed:
                self._violation(
                    f"router kept {assignment} on {worker_id} missing from its heartbeats "
                    f"for {now - since:.3f}s (since {since:.4f}; bound {allowed:.3f}s)"
                )
                del self._missing[worker_id, assignment]

    def check_views(self, only: str | None) -> None:
        """The router's (epoch, heartbeat sequence) of a worker never goes back: after a
        worker's message, that worker's; after any other event, every worker's."""
        for worker_id in self.cluster.workers if only is None else (only,):
            clock = self.router.worker_clock(worker_id)
            if clock is None:
                continue
            seen = self._views.get(worker_id)
            if seen is not None and clock[:2] < seen:
                self._violation(
                    f"router's view of {worker_id} went back from (epoch, seq) {seen} "
                    f"to {clock[:2]}"
                )
            self._views[worker_id] = clock[:2]

    def check_answered(
        self,
        event: FromWorkerMessage,
        effects: list[RouterEffect],
        before: tuple[int, int, bool] | None,
    ) -> None:
        """A report of an unwanted assignment is answered with Cancel at once."""
        worker_id, message = event.worker_id, event.message
        named: tuple[Assignment, ...] = ()
        if isinstance(message, OfferResult) and message.accepted:
            named = (message.assignment,)
        elif isinstance(message, Heartbeat):
            after = self.router.worker_clock(worker_id)
            if (
                after is not None
                and after[:2] == (message.epoch, message.seq)
                and (before is None or before[:2] != after[:2])
            ):
                named = message.active  # a fresh heartbeat, reconciled in this step
        for assignment in named:
            if self.router.wants(worker_id, assignment):
                continue
            cancelled = any(
                isinstance(e, SendToWorker)
                and e.worker_id == worker_id
                and isinstance(e.message, Cancel)
                and e.message.assignment == assignment
                for e in effects
            )
            if not cancelled:
                self._violation(
                    f"{worker_id} reported {assignment} ({type(message).__name__}), which "
                    "the router does not want, and got no Cancel"
                )

    # --- cache-aware placement ---

    def note_report(
        self, worker_id: str, beat: Heartbeat, before: tuple[int, int, bool] | None, now: float
    ) -> None:
        after = self.router.worker_clock(worker_id)
        if after is not None and after[:2] == (beat.epoch, beat.seq) and after != before:
            self._reports[worker_id] = (beat.epoch, now, beat.cache)

    def check_placements(self, offers: list[tuple[str, Offer]], now: float) -> None:
        """Each offer of one router step, in order. What the router claimed a worker's
        cache offers must be backed by a report it accepted from that worker's current
        epoch within cache_report_max_age_s. And no worker is flooded: cache-aware
        routing picks the least predicted time to first token, so (every worker
        reporting the same rate, as here) the chosen worker's queued prefill before
        the offer exceeds no other eligible worker's by more than the request's
        context."""
        router, config = self.router, self.config
        views = router.views()
        queued = {v.worker_id: router.queued_prefill(v.worker_id) for v in views}
        # Back to the state before each offer: take off the offers at and after it.
        later: dict[str, tuple[int, int]] = {}  # worker -> (prefill, offers) from here on
        staged = []
        for worker_id, offer in reversed(offers):
            prefill = router.predicted_prefill(worker_id, offer.assignment)
            tokens, count = later.get(worker_id, (0, 0))
            later[worker_id] = (tokens + (prefill or 0), count + 1)
            staged.append((worker_id, offer, prefill, dict(later)))
        for worker_id, offer, prefill, after in reversed(staged):
            if prefill is None:
                continue  # already let go of within this step
            request = offer.request
            context = request.prompt_token_ids + request.output_prefix
            claimed = len(context) - prefill
            if claimed > 0:
                self._check_claim(worker_id, offer, context, claimed, now)
            if config.routing != "cache-aware":
                continue
            tally = self.attempts.tallies.get(offer.assignment.request_id)
            tried = {a.worker_id for a in tally.attempts[:-1]} if tally else set()
            if worker_id in tried:
                continue
            mine = queued[worker_id] - after[worker_id][0]
            for view in views:
                other = view.worker_id
                if other == worker_id or other in tried or not view.healthy:
                    continue
                if view.max_context < request.context_tokens:
                    continue
                ahead, count = after.get(other, (0, 0))
                if view.held - count >= view.slots - view.others:
                    continue
                if mine > queued[other] - ahead + len(context):
                    self._violation(
                        f"{offer.assignment}: placed on {worker_id} with {mine} prefill tokens "
                        f"queued while {other} had {queued[other] - ahead} and a free slot "
                        f"(context {len(context)})"
                    )

    def _check_claim(
        self, worker_id: str, offer: Offer, context: tuple[int, ...], claimed: int, now: float
    ) -> None:
        seen = self._reports.get(worker_id)
        max_age = self.config.cache_report_max_age_s
        backed = 0
        if seen is not None:
            epoch, at, report = seen
            if report is not None and epoch == offer.epoch and now - at <= max_age:
                keys = set(report.keys)
                for key in chain_hashes(context, report.block_size):
                    if key not in keys:
                        break
                    backed += report.block_size
        if claimed > backed:
            self._violation(
                f"{offer.assignment}: router counted {claimed} cached tokens on {worker_id}, "
                f"its last accepted report (epoch, time) {seen[:2] if seen else None} "
                f"backs {backed} at t={now:.3f}"
            )
