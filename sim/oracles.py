"""Oracles beyond each client's stream: explained outcomes, limits, the router's view, waste.

The stream oracles in sim/streams.py judge what a client saw. A bug that only
costs availability passes them: a stream that ends `worker_lost` or a
request retried on another worker looks like the contract's allowed
behaviour under faults. The oracles here close that gap.

- Explained losses. The simulator records every disturbance it causes, per
  worker, as an interval (Disturbances): a crash until the restart, a stall,
  a partition, a drain until the process exits, a decoder failure or a
  misbehaving decoder, and each packet to or from the worker that was lost,
  held back, duplicated, replayed or delayed past half the shortest router
  timeout. Every attempt the router gives up on (a retry, a resume, the
  attempt behind a final `no_worker`, `worker_lost` or `failed`) must have a
  disturbance of its own worker that overlaps its life, widened by a grace
  period for the consequences to surface (timeouts, heartbeats). A run with
  no fault may retry nothing. A request refused because no worker fits needs
  every worker disturbed (or not yet heard from); `failed` needs a decoder
  fault on that worker; `overloaded` needs a full queue.
- Limits and placement, after every offer: attempts before the first token
  at most `max_attempts`, continuations after it at most `max_resumes`; the
  target is healthy in the router's view at the epoch the offer names; and
  no other worker holds a live hold for the same request (never placed
  twice at once).
- The router's view never moves back: each worker's (epoch, heartbeat
  sequence) only grows.
- Holds and health. A confirmed hold missing from its worker's heartbeats is
  given up within the heartbeat timeout plus an interval and the delays (one
  more timeout if the worker was disturbed: its heartbeats may stop); a hold
  released for a heartbeat's leaving it out is backed by that heartbeat (sent
  after the worker process ended the assignment: WorkerOracles numbers worker
  events to tell); a worker is called stuck only while a hang, a stall, a
  pool out of blocks or the swarm's slowness held its decoder back; and after
  a decline for want of a slot (which spends no attempt) the router offers
  that worker nothing until a heartbeat or a freed hold there says a slot is
  free, which bounds how often one request can be declined.
- Unwanted work is cancelled. A fresh heartbeat or an accepted offer that
  names an assignment the router does not want is answered with a Cancel in
  the same step; and no worker keeps such an assignment longer than a
  heartbeat interval plus two network delays, counted from the last
  disturbance of that worker. The time spent on unwanted assignments is
  reported as waste.
- Resend is answered: a Resend for an assignment a worker is running gets
  the tokens it asks for, and one for an assignment it completed among its
  last `retained_outputs` gets the Finished again.
- Recovery by Resend is prompt, not merely eventual. Every gap the router
  fences (an attempt's token past the next index) is answered in the same
  step by a Resend from the next index, unless the request had one less than
  `resend_interval_s` ago; and the tokens a worker resends reach the client
  within one network delay (plus the checks' cadence) of the worker's answer,
  unless that worker was disturbed meanwhile (the run lost, late, cut) or
  the attempt ended. Between the two, a token the router has found missing
  arrives within the interval, the next sign of the attempt and two delays.
- Fence counters that only a bug can move stay zero: each fence reason is
  listed with the fault kinds (or events) that can cause it; at the end of
  a run a reason counted without any of them is a violation.
- Several routers: each router has its own Oracles, judging its own requests
  exactly as above; worker-side checks (WorkerOracles) ask the router an
  assignment names. A router's crash is no disturbance of any worker, so an
  attempt another router loses when one dies is unexplained: a crash never
  costs another router's streams. With several routers a worker may decline
  an offer for want of a slot (the others' work fills it): such an attempt
  needs no disturbance and spends no attempt or resume, so the limits above
  are counted without it. A worker never holds an assignment of a router it
  has lost its link to, nor more assignments than slots, whoever made them.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from core.protocol import (
    Assignment,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    FromWorkerMessage,
    Heartbeat,
    Offer,
    OfferResult,
    Resend,
    RouterEffect,
    RouterEvent,
    SendToWorker,
    Token,
    TokenRun,
)
from sim.attempts import Attempts
from sim.disturbances import FENCE_CAUSES
from sim.fleet_oracles import FleetOracles

if TYPE_CHECKING:
    from sim.disturbances import Disturbances
    from sim.view import ClusterView, NodeView
    from sim.worker_oracles import Recovered


class Oracles:
    """The router-side checks above for one router, fed by the cluster as it executes
    the machines' effects: each request's attempts (sim/attempts.py), the router's
    view of its workers (sim/fleet_oracles.py), and here recovery by Resend and the
    fence counters. Every check reports into one list, in the order they run."""

    def __init__(
        self, cluster: ClusterView, node: NodeView, disturbances: Disturbances | None
    ) -> None:
        self.cluster = cluster
        self.router = node.router
        self.config = node.router.config
        self.streams = node.streams
        self.disturbances = disturbances
        self.router_id = node.router_id
        self.violations: list[str] = []
        self.attempts = Attempts(cluster, node, disturbances, self._violation)
        self.fleet = FleetOracles(cluster, node, disturbances, self.attempts, self._violation)
        self._last_progress_check = 0.0
        self._gaps_before = 0  # the router's gap fences before the event in hand
        self._resend_at: dict[str, float] = {}  # request -> its last Resend's time
        self._recovering: dict[Assignment, Recovered] = {}  # resent runs not yet delivered
        self._recovered_seen = 0  # how far this router has read WorkerOracles.recovered

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    # --- router side ---

    def before_router(self, event: RouterEvent) -> tuple[int, int, bool] | None:
        if isinstance(event, FromWorkerMessage):
            if isinstance(event.message, Heartbeat):
                self.fleet.before_heartbeat(event.worker_id)
                return self.router.worker_clock(event.worker_id)
            if isinstance(event.message, Token | TokenRun):
                self._gaps_before = self.router.fence_counts().get("gap", 0)
        return None

    def after_router(
        self,
        event: RouterEvent,
        effects: list[RouterEffect],
        before: tuple[int, int, bool] | None,
        now: float,
    ) -> None:
        attempts, fleet = self.attempts, self.fleet
        declined = None
        message = event.message if isinstance(event, FromWorkerMessage) else None
        if isinstance(message, OfferResult) and attempts.note_full(message):
            declined = message.worker_id
        for effect in effects:
            match effect:
                case SendToWorker(worker_id, Offer() as offer):
                    attempts.on_offer(worker_id, offer, now)
                case DeliverToken(request_id):
                    attempts.progressed(request_id, now)
                case DeliverFinished(request_id) | DeliverError(request_id):
                    attempts.on_outcome(request_id, effect, now)
                    self._resend_at.pop(request_id, None)
                case SendToWorker(_, Resend(assignment)):
                    self._resend_at[assignment.request_id] = now
        if isinstance(event, FromWorkerMessage):
            attempts.check_delivered_from_active(event, effects)
            fleet.check_answered(event, effects, before)
            if isinstance(message, Token | TokenRun):
                self._check_gap_asked(message.assignment, effects, now)
            if isinstance(event.message, Heartbeat):
                fleet.note_report(event.worker_id, event.message, before, now)
                fleet.after_heartbeat(event.worker_id, event.message, before, now)
        offers = [
            (e.worker_id, e.message)
            for e in effects
            if isinstance(e, SendToWorker) and isinstance(e.message, Offer)
        ]
        if offers:
            fleet.check_placements(offers, now)
        fleet.check_full(declined, offers)
        fleet.check_stuck(event, now)
        fleet.check_views(event.worker_id if isinstance(event, FromWorkerMessage) else None)
        attempts.check_handoffs(effects, now)
        attempts.find_lost(now)

    # --- recovery by Resend ---

    def _check_gap_asked(
        self, assignment: Assignment, effects: list[RouterEffect], now: float
    ) -> None:
        """A gap the router just fenced is asked again at once, from the next index,
        unless the request's last Resend is younger than the rate limit. (The effects
        loop has already noted this step's Resends, so `last` may be now.)"""
        if self.router.fence_counts().get("gap", 0) == self._gaps_before:
            return
        rid = assignment.request_id
        stream = self.streams.get(rid)
        delivered = len(stream.tokens) if stream is not None else 0
        asked = [
            e.message
            for e in effects
            if isinstance(e, SendToWorker)
            and isinstance(e.message, Resend)
            and e.message.assignment.request_id == rid
        ]
        wrong = [r for r in asked if r.assignment != assignment or r.from_index != delivered]
        if wrong:
            self._violation(f"{rid}: a gap at {delivered} of {assignment} asked as {wrong}")
            return
        last = self._resend_at.get(rid)
        if not asked and (last is None or now - last >= self.config.resend_interval_s):
            ago = "never" if last is None else f"{now - last:.3f}s ago"
            self._violation(
                f"{rid}: router fenced a gap at {delivered} of {assignment} and asked for "
                f"nothing (last Resend {ago}; rate limit {self.config.resend_interval_s}s)"
            )

    def _check_recovered(self, now: float) -> None:
        """Tokens a worker resent reach the client within a network delay of its
        answer (and the cadence of this check), unless that worker was disturbed
        meanwhile, or the attempt or the request ended."""
        runs = self.cluster.worker_oracles.recovered
        for run in runs[self._recovered_seen :]:
            if run.assignment.router == self.router_id:
                self._recovering[run.assignment] = run  # a later answer reaches further
        self._recovered_seen = len(runs)
        if not self._recovering:
            return
        disturbances = self.disturbances
        bound = (disturbances.delay_max_s if disturbances is not None else 0.0) + 0.06
        for assignment, run in list(self._recovering.items()):
            rid = assignment.request_id
            stream = self.streams.get(rid)
            if (
                stream is None
                or stream.outcome is not None
                or len(stream.tokens) >= min(run.end, stream.request.max_new_tokens)
                or self.router.placement(rid) != (run.worker_id, assignment)
            ):
                del self._recovering[assignment]
                continue
            if now - run.sent_at <= bound:
                continue
            del self._recovering[assignment]
            if disturbances is None or not disturbances.explains(run.worker_id, run.sent_at, now):
                self._violation(
                    f"{rid}: {run.worker_id} resent {assignment} up to {run.end} at "
                    f"{run.sent_at:.4f}; the client has {len(stream.tokens)} tokens "
                    f"{now - run.sent_at:.3f}s later (bound {bound:.3f}s)"
                )

    # --- time ---

    def check_progress(self, now: float, slack_s: float) -> None:
        """Every 50 ms of virtual time: no placed request waits past its progress
        deadline plus the slack, no missing hold is kept too long, and resent tokens
        reach their client in time."""
        if now - self._last_progress_check < 0.05:
            return
        self._last_progress_check = now
        self.attempts.check_progress(now, slack_s)
        self.fleet.check_missing(now)
        self._check_recovered(now)

    # --- the end of a run ---

    def check_fences(self, fenced: Counter[str], kinds: set[str]) -> None:
        """Fence counters that moved with none of their causes in the run."""
        causes = set(kinds)
        if self.cluster.attempts_lost():
            causes.add("attempt_lost")
        if self.cluster.resends():
            causes.add("resend")
        if self.cluster.handoffs()[1]:
            causes.add("handoff_back")
        for reason, count in sorted(fenced.items()):
            allowed = FENCE_CAUSES.get(reason)
            if count and allowed is not None and not allowed & causes:
                need = ", ".join(sorted(allowed)) or "nothing: only a bug"
                self._violation(
                    f"fence {reason} counted {count} in a run without its causes ({need})"
                )
