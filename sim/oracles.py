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

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.blocks import chain_hashes
from core.protocol import (
    Assignment,
    CacheReport,
    Cancel,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    Finished,
    FromRouterMessage,
    FromWorkerMessage,
    HandOff,
    Heartbeat,
    Offer,
    OfferResult,
    ProgressTimer,
    Resend,
    RouterEffect,
    RouterEvent,
    SendToRouter,
    SendToWorker,
    StartDecode,
    StopDecode,
    TimerFired,
    Token,
    TokenRun,
    WorkerEffect,
    WorkerEvent,
)
from core.states import Hold

if TYPE_CHECKING:
    from sim.view import ClusterView, NodeView

DECODER_FAULTS = frozenset({"decoder_failure", "decoder_misbehaves"})
# What stops or slows a decoder's progress, so that the router may rightly call its worker
# stuck (besides a worker the swarm made slow): a hung decoder, a stalled process, a pool
# out of blocks (a preemption, or a sequence waiting for blocks with a row free).
PROGRESS_STOPS = frozenset({"decoder_hang", "stall", "kv_pressure"})
# What cuts a worker's link to the router (one way or both): while it lasts, a token that
# was lost or dropped after a gap cannot be asked for again, so an attempt may miss its
# deadline with the decoder running. It calls the worker stuck rightly only when the cut
# lasted through the whole missed deadline (bar one network delay).
LINK_CUTS = frozenset({"partition", "blackout"})
# What stops a worker's heartbeats from reaching the router for a while (a lost or late
# one only costs an interval: the next one comes).
HEARTBEAT_STOPS = frozenset({"stall", "partition", "blackout", "crash", "drain", "impostor"})

# Which fault kinds (or run events: "attempt_lost", "resend", "overtake", "handoff_back")
# can move each fence counter. A counter above zero in a run that had none of them is a
# bug; an empty set means only a bug can move it. Counters not listed (router.late,
# router.duplicate_result) also move in a run without faults. REORDERING: the faults
# that deliver a message after later ones, or twice (a stalled worker's inbox is
# delivered when it resumes, and a heal that ends the stall early can reorder it), and
# the run event "overtake": a control message that landed after one sent later on its
# link, which the small per-message delays of a quiet network also cause now and then
# (sim/simulator.py _note_overtake).
REORDERING = frozenset({"late", "delay_spread", "duplicate", "replay", "stall", "overtake"})
FENCE_CAUSES: dict[str, frozenset[str]] = {
    "router.wrong_worker": frozenset(),
    "router.over_budget": frozenset(),
    # Also the draining worker's tokens for an attempt it handed off, until the
    # router's Cancel reaches it.
    "router.stale_attempt": frozenset({"attempt_lost", "drain"}),
    # A HandOff that reaches the router after it let the worker's epoch go; only a
    # draining worker sends one.
    "router.stale_handoff": frozenset({"drain"}),
    "router.duplicate": frozenset({"duplicate", "replay", "resend"}),
    # Also a handoff gone back: while the continuation was offered, the draining worker's
    # tokens were stale and dropped, so its next one after the stream comes back lies
    # past them (the Resend the router sends on taking it back asks for them again).
    "router.gap": frozenset(
        {"loss", "late", "partition", "blackout", "delay_spread", "handoff_back"}
    ),
    "router.stale_heartbeat": REORDERING | {"crash", "drain"},
    "router.orphan": REORDERING | {"attempt_lost", "client_cancel"},
    "router.unknown_epoch": frozenset({"future_epoch"}),
    "worker.late_token": frozenset({"decoder_misbehaves"}),
    "worker.duplicate": frozenset({"decoder_misbehaves"}),
    "worker.gap": frozenset({"decoder_misbehaves"}),
    "worker.over_budget": frozenset({"decoder_misbehaves"}),
    "worker.late_finish": frozenset({"decoder_misbehaves"}),
    "worker.missing_logprob": frozenset(),  # the fake decoder always sends a record
    # A Resend crossing the end of an output it cannot keep (cancelled, failed, a lost
    # process); one for a completed output is judged exactly, by _check_resend.
    "worker.resend_unknown": DECODER_FAULTS | {"crash", "drain", "client_cancel", "attempt_lost"},
    # The router sends each assignment's offer once: a second copy needs the network.
    "worker.duplicate_offer": frozenset({"duplicate", "replay"}),
    # An offer landing after its own cancel: the Cancel overtook it (or a stall held both).
    "worker.offer_after_cancel": REORDERING,
    "worker.late_cancel": REORDERING | {"attempt_lost", "client_cancel"},
    # Each router's messages travel on its own link and name its own assignments.
    "worker.foreign_assignment": frozenset(),
}


class Disturbances:
    """Every disturbance the run caused, per worker, as [start, end] intervals.

    An interval may be opened before its end is known (a drain lasts until the
    process exits); `close` sets the end. `grace_s` is how long after an
    interval its consequences may still surface.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.kinds: set[str] = set()  # every kind that struck anywhere in the run
        self._intervals: dict[str, list[list[float | str]]] = {}
        self._quiet_after: dict[str, float] = {}  # latest end of an interval begun so far
        self.delay_max_s = 0.0  # the seed's largest network delay (the simulator sets it)
        self.slow: frozenset[str] = frozenset()  # workers the swarm made decode slower

    def add(self, worker_id: str, kind: str, start: float, end: float) -> list[float | str]:
        interval: list[float | str] = [start, end, kind]
        self._intervals.setdefault(worker_id, []).append(interval)
        self.kinds.add(kind)
        self._quiet_after[worker_id] = max(self._quiet_after.get(worker_id, -math.inf), end)
        return interval

    def extend(self, worker_id: str, interval: list[float | str], end: float) -> None:
        """A disturbance still going on: its interval now lasts until `end`."""
        interval[1] = max(float(interval[1]), end)
        self._quiet_after[worker_id] = max(self._quiet_after.get(worker_id, -math.inf), end)

    def close(self, worker_id: str, interval: list[float | str], end: float) -> None:
        interval[1] = end
        ends = (float(i[1]) for i in self._intervals[worker_id])
        self._quiet_after[worker_id] = max(ends, default=-math.inf)

    def intervals(self) -> dict[str, list[tuple[float, float, str]]]:
        """Every interval so far, per worker: (start, end, kind)."""
        return {
            w: [(float(s), float(e), str(k)) for s, e, k in intervals]
            for w, intervals in self._intervals.items()
        }

    def note(self, kind: str) -> None:
        """A kind that struck the whole network rather than one worker (delay spread)."""
        self.kinds.add(kind)

    def explains(
        self, worker_id: str, since: float, until: float, kinds: Iterable[str] | None = None
    ) -> bool:
        """Did a disturbance of this worker (of these kinds) overlap [since, until]?"""
        wanted = None if kinds is None else frozenset(kinds)
        for start, end, kind in self._intervals.get(worker_id, ()):
            if wanted is not None and kind not in wanted:
                continue
            if float(start) <= until and float(end) + self.grace_s >= since:
                return True
        return False

    def covers(self, worker_id: str, since: float, until: float, kinds: Iterable[str]) -> bool:
        """Did disturbances of this worker of these kinds last through all of [since, until]
        (one after another, overlapping or touching)?"""
        wanted = frozenset(kinds)
        reached = since
        for start, end, kind in sorted(
            (float(i[0]), float(i[1]), i[2]) for i in self._intervals.get(worker_id, ())
        ):
            if kind in wanted and start <= reached:
                reached = max(reached, end)
        return reached >= until

    def quiet_since(self, worker_id: str) -> float:
        """When the worker's last disturbance so far ended (-inf: never disturbed)."""
        return self._quiet_after.get(worker_id, -math.inf)


@dataclass(frozen=True, slots=True)
class Recovered:
    """A TokenRun a worker sent in answer to a Resend: up to `end`, at `sent_at`."""

    worker_id: str
    assignment: Assignment
    end: int
    sent_at: float


@dataclass(slots=True)
class _Attempt:
    assignment: Assignment
    worker_id: str
    offered_at: float
    context: int  # prompt plus output prefix: what its first token waits for
    open: bool = True
    progress_at: float = 0.0  # the offer, then each token it delivered
    streaming: bool = False  # delivered a token
    full: bool = False  # declined for want of a slot (several routers): spends nothing


@dataclass(slots=True)
class _Tally:
    """Per request: the attempts offered, split by whether the client had tokens."""

    attempts: list[_Attempt] = field(default_factory=list)
    before_first_token: int = 0
    resumes: int = 0
    full_retries: int = 0  # of those, declined for want of a slot (several routers)
    full_resumes: int = 0


class Oracles:
    """The router-side checks above for one router, fed by the cluster as it executes
    the machines' effects."""

    def __init__(
        self, cluster: ClusterView, node: NodeView, disturbances: Disturbances | None
    ) -> None:
        self.cluster = cluster
        self.router = node.router
        self.config = node.router.config
        self.streams = node.streams
        self.disturbances = disturbances
        self.violations: list[str] = []
        self.attempts_lost = 0
        self.full_declines = 0  # attempts declined for want of a slot
        self._tallies: dict[str, _Tally] = {}
        self._views: dict[str, tuple[int, int]] = {}
        self._lost_mark = 0
        self._handoffs_back = 0
        # request -> (worker, attempt handed off, its continuation) until that is settled
        self._handing_off: dict[str, tuple[str, Assignment, Assignment]] = {}
        self._last_progress_check = 0.0
        # The last cache report the router accepted from each worker: (epoch, when, report).
        self._reports: dict[str, tuple[int, float, CacheReport | None]] = {}
        self.router_id = node.router_id
        self._holds_before: dict[Assignment, Hold] = {}  # a heartbeat's worker, before it
        self._missing: dict[tuple[str, Assignment], float] = {}  # missing hold -> since
        self._stuck: frozenset[str] = frozenset()  # workers the router holds stuck
        # Workers that declined an offer for want of a slot since their last heartbeat:
        # the holds the router may count there until news of a free slot.
        self._full: dict[str, int] = {}
        self._gaps_before = 0  # the router's gap fences before the event in hand
        self._resend_at: dict[str, float] = {}  # request -> its last Resend's time
        self._recovering: dict[Assignment, Recovered] = {}  # resent runs not yet delivered
        self._recovered_seen = 0  # how far this router has read WorkerOracles.recovered

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    def _holds(self, worker_id: str) -> dict[Assignment, Hold]:
        """The router's holds on a worker, by state (read from its slot accounting)."""
        record = self.router.fleet.workers.get(worker_id)
        return {} if record is None else {a: h.state for a, h in record.holds.items()}

    # --- router side ---

    def before_router(self, event: RouterEvent) -> tuple[int, int, bool] | None:
        if isinstance(event, FromWorkerMessage):
            if isinstance(event.message, Heartbeat):
                self._holds_before = self._holds(event.worker_id)
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
        declined = None
        message = event.message if isinstance(event, FromWorkerMessage) else None
        if isinstance(message, OfferResult) and self._note_full(message):
            declined = message.worker_id
        for effect in effects:
            match effect:
                case SendToWorker(worker_id, Offer() as offer):
                    self._on_offer(worker_id, offer, now)
                case DeliverToken(request_id):
                    tally = self._tallies.get(request_id)
                    if tally is not None and tally.attempts:
                        attempt = tally.attempts[-1]
                        attempt.progress_at, attempt.streaming = now, True
                case DeliverFinished(request_id) | DeliverError(request_id):
                    self._on_outcome(request_id, effect, now)
                    self._resend_at.pop(request_id, None)
                case SendToWorker(_, Resend(assignment)):
                    self._resend_at[assignment.request_id] = now
        if isinstance(event, FromWorkerMessage):
            self._check_delivered_from_active(event, effects)
            self._check_answered(event, effects, before)
            if isinstance(message, Token | TokenRun):
                self._check_gap_asked(message.assignment, effects, now)
            if isinstance(event.message, Heartbeat):
                self._note_report(event.worker_id, event.message, before, now)
                self._after_heartbeat(event.worker_id, event.message, before, now)
        offers = [
            (e.worker_id, e.message)
            for e in effects
            if isinstance(e, SendToWorker) and isinstance(e.message, Offer)
        ]
        if offers:
            self._check_placements(offers, now)
        if declined is not None or self._full:
            self._check_full(declined, offers)
        stuck = self.router.fleet.stuck
        if stuck != self._stuck:
            for worker_id in stuck - self._stuck:
                self._check_stuck(worker_id, event, now)
            self._stuck = frozenset(stuck)
        self._check_views(event.worker_id if isinstance(event, FromWorkerMessage) else None)
        if self._handing_off:
            self._check_handoffs(effects, now)
        mark = self.router.attempts_lost()
        if mark != self._lost_mark:
            self._lost_mark = mark
            self._find_lost_attempts(now)

    def _note_full(self, result: OfferResult) -> bool:
        """A decline for want of a slot, of the request's open attempt: it spends no
        attempt or resume (the router must agree). With several routers it is the
        others' work; with one, the router's view was off, which a fault explains.
        True if this decline is news (the router marks the worker full)."""
        if result.accepted or result.reason != "no_slot":
            return False
        tally = self._tallies.get(result.assignment.request_id)
        last = tally.attempts[-1] if tally and tally.attempts else None
        if tally is None or last is None or not last.open or last.assignment != result.assignment:
            return False
        if last.full:
            return False
        last.full = True
        self.full_declines += 1
        if self.streams[result.assignment.request_id].tokens:
            tally.full_resumes += 1
        else:
            tally.full_retries += 1
        clock = self.router.worker_clock(last.worker_id)
        return clock is not None and clock[0] == result.epoch

    def _check_full(self, declined: str | None, offers: list[tuple[str, Offer]]) -> None:
        """A decline for want of a slot spends no attempt, so nothing but this bounds
        how often one request is declined: after a worker declines, the router offers
        it nothing more until it has news of a free slot there (a fresh heartbeat, or
        one of its own holds there released). Each further decline of a request then
        needs such news, at most one per heartbeat of each worker and per slot freed."""
        sent: Counter[str] = Counter(worker_id for worker_id, _ in offers)
        if declined is not None:
            self._full[declined] = len(self._holds(declined)) - sent[declined]
        for worker_id, count in self._full.items():
            if sent[worker_id] and len(self._holds(worker_id)) > count:
                self._violation(
                    f"offered {worker_id} {sent[worker_id]} more after it declined for want "
                    f"of a slot with {count} held, with no heartbeat or slot freed since"
                )

    def _after_heartbeat(
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
        holds = self._holds(worker_id)
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
            tally = self._tallies.get(assignment.request_id)
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

    # --- cache-aware placement ---

    def _note_report(
        self, worker_id: str, beat: Heartbeat, before: tuple[int, int, bool] | None, now: float
    ) -> None:
        after = self.router.worker_clock(worker_id)
        if after is not None and after[:2] == (beat.epoch, beat.seq) and after != before:
            self._reports[worker_id] = (beat.epoch, now, beat.cache)

    def _check_placements(self, offers: list[tuple[str, Offer]], now: float) -> None:
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
            tally = self._tallies.get(offer.assignment.request_id)
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

    def _on_offer(self, worker_id: str, offer: Offer, now: float) -> None:
        rid = offer.assignment.request_id
        config = self.config
        clock = self.router.worker_clock(worker_id)
        if clock is None or not clock[2] or clock[0] != offer.epoch:
            self._violation(
                f"{rid}: offered to {worker_id} at epoch {offer.epoch}, which the router "
                f"sees as {clock} (epoch, sequence, healthy)"
            )
        tally = self._tallies.setdefault(rid, _Tally())
        if tally.attempts and tally.attempts[-1].open:
            self._lose(rid, tally.attempts[-1], now)
        context = len(offer.request.prompt_token_ids) + len(offer.request.output_prefix)
        tally.attempts.append(_Attempt(offer.assignment, worker_id, now, context, progress_at=now))
        handed = self.router.handed_off(rid)
        if handed is not None:  # a handoff spends no resume; the old attempt runs on
            self._handing_off[rid] = (*handed, offer.assignment)
        elif self.streams[rid].tokens:
            tally.resumes += 1
            if tally.resumes - tally.full_resumes > config.max_resumes:
                self._violation(f"{rid}: resume {tally.resumes} > max_resumes {config.max_resumes}")
        else:
            tally.before_first_token += 1
            if tally.before_first_token - tally.full_retries > config.max_attempts:
                self._violation(
                    f"{rid}: attempt {tally.before_first_token} before the first token "
                    f"> max_attempts {config.max_attempts} (and {tally.full_retries} "
                    "declined for want of a slot)"
                )
        holders = self.router.holders(rid)
        expected = [worker_id] if handed is None else sorted({worker_id, handed[0]})
        if sorted(holders) != expected:
            self._violation(
                f"{rid}: placed on {holders} at once (offer to {worker_id}"
                + (")" if handed is None else f", handed off by {handed[0]})")
            )

    def _on_outcome(
        self, request_id: str, outcome: DeliverFinished | DeliverError, now: float
    ) -> None:
        tally = self._tallies.pop(request_id, None)
        last = tally.attempts[-1] if tally and tally.attempts else None
        kind = outcome.kind if isinstance(outcome, DeliverError) else "finished"
        if kind in ("finished", "cancelled"):
            return
        if kind == "overloaded":
            return  # judged at submit, where the queue's length is known
        if last is not None and last.open:
            self._lose(request_id, last, now)
        if kind == "failed" and self.disturbances is not None:
            if last is None or not self.disturbances.explains(
                last.worker_id, last.offered_at, now, DECODER_FAULTS
            ):
                where = last.worker_id if last else "no worker"
                self._violation(f"{request_id}: failed on {where} without a decoder fault there")
            return
        spent = tally is not None and (
            tally.resumes - tally.full_resumes >= self.config.max_resumes
            if self.streams[request_id].tokens
            else tally.before_first_token - tally.full_retries >= self.config.max_attempts
        )
        if not spent:
            self._check_none_fit(request_id, kind, now)

    def _check_none_fit(self, request_id: str, kind: str, now: float) -> None:
        """Given up with attempts left: allowed only if no worker could take it."""
        if self.disturbances is None:
            return
        for worker_id in self.cluster.workers:
            known = self.router.worker_clock(worker_id) is not None
            if known and not self.disturbances.explains(worker_id, now, now):
                self._violation(
                    f"{request_id}: {kind} with attempts left while {worker_id} was "
                    "undisturbed and known to the router"
                )
                return

    def check_overloaded(self, request_id: str, queued_before: int) -> None:
        if queued_before < self.config.queue_limit:
            self._violation(
                f"{request_id}: overloaded with {queued_before} queued, under the "
                f"queue limit {self.config.queue_limit}"
            )

    def _find_lost_attempts(self, now: float) -> None:
        """The router counted a retry or resume: find the attempts it let go of."""
        for rid, tally in self._tallies.items():
            last = tally.attempts[-1] if tally.attempts else None
            if (
                last is not None
                and last.open
                and self.router.placement(rid) != (last.worker_id, last.assignment)
            ):
                self._lose(rid, last, now)

    def _lose(self, request_id: str, attempt: _Attempt, now: float) -> None:
        attempt.open = False
        self.attempts_lost += 1
        disturbances = self.disturbances
        if attempt.full and self.cluster.shared:
            return  # the worker was full of other routers' work: no fault needed
        if disturbances is not None and not disturbances.explains(
            attempt.worker_id, attempt.offered_at, now
        ):
            self._violation(
                f"{request_id}: attempt {attempt.assignment.attempt} on {attempt.worker_id} "
                f"(offered at {attempt.offered_at:.4f}) lost at {now:.4f}, and no fault "
                f"touched {attempt.worker_id} to explain it"
            )

    def _check_delivered_from_active(
        self, event: FromWorkerMessage, effects: list[RouterEffect]
    ) -> None:
        """Output reaches the client only from the attempt that is active (after the
        step), on the worker it was placed on: never the other of a handoff's two."""
        message = event.message
        if not isinstance(message, Token | TokenRun):
            return
        if not any(isinstance(e, DeliverToken) for e in effects):
            return
        placed = self.router.placement(message.assignment.request_id)
        if placed is not None and placed != (event.worker_id, message.assignment):
            self._violation(
                f"{message.assignment} from {event.worker_id} reached the client while "
                f"{placed} is the active attempt"
            )

    def _check_handoffs(self, effects: list[RouterEffect], now: float) -> None:
        """A handed-off attempt is cancelled only once its continuation is accepted
        (or the request is over); a continuation that fails before that goes back to it,
        which reopens it here."""
        for effect in effects:
            if not (isinstance(effect, SendToWorker) and isinstance(effect.message, Cancel)):
                continue
            rid = effect.message.assignment.request_id
            pending = self._handing_off.get(rid)
            if pending is None or (effect.worker_id, effect.message.assignment) != pending[:2]:
                continue
            del self._handing_off[rid]
            placed = self.router.placement(rid)
            settled = placed is None or (placed[1] == pending[2] and self.router.accepted(rid))
            if not settled:
                self._violation(
                    f"{pending[1]} on {pending[0]}, handed off, was cancelled before its "
                    f"continuation {pending[2]} was accepted"
                )
        back = self.router.handoffs_back()
        went_back, self._handoffs_back = back != self._handoffs_back, back
        for rid, (worker_id, assignment, _) in list(self._handing_off.items()):
            if self.router.handed_off(rid) == (worker_id, assignment):
                continue  # still pending
            if not went_back or self.router.placement(rid) != (worker_id, assignment):
                # settled without a Cancel of ours: the router lost that worker's hold
                # (the worker was lost), or the request ended
                del self._handing_off[rid]
                continue
            del self._handing_off[rid]  # back on the worker that handed it off
            tally = self._tallies.get(rid)
            if tally is None or not tally.attempts:
                continue
            last = tally.attempts[-1]
            if last.open:
                self._lose(rid, last, now)  # the continuation that failed
            again = _Attempt(assignment, worker_id, now, last.context, progress_at=now)
            again.streaming = True
            tally.attempts.append(again)

    def _check_answered(
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

    def _check_views(self, only: str | None) -> None:
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
        """No placed request waits longer than its progress deadline plus the slack
        (during the faults too): the router gives up on a worker that stopped."""
        if now - self._last_progress_check < 0.05:
            return
        self._last_progress_check = now
        config = self.config
        for rid, tally in self._tallies.items():
            attempt = tally.attempts[-1] if tally.attempts else None
            if attempt is None or not attempt.open:
                continue
            if attempt.streaming:
                deadline = config.token_timeout_s
            else:
                per_token = config.prefill_timeout_per_token_s
                deadline = config.first_token_timeout_s + attempt.context * per_token
            waited = now - attempt.progress_at
            if waited > deadline + slack_s:
                self._violation(
                    f"{rid}: attempt {attempt.assignment.attempt} on {attempt.worker_id} "
                    f"made no progress for {waited:.2f}s (deadline {deadline:.2f}s + "
                    f"{slack_s:.2f}s), and the router still waits"
                )
        if self._missing:
            self._check_missing(now)
        self._check_recovered(now)

    def _check_missing(self, now: float) -> None:
        """A confirmed hold missing from the worker's heartbeats is given up (released,
        or its attempt failed over) within the heartbeat timeout plus one heartbeat
        interval and the network's delays, whatever else ends it first. A disturbed
        worker's next heartbeat may be lost or late (one interval more); one whose
        heartbeats stop (a stall, a cut, a crash) is ended by the liveness deadline
        instead, one more heartbeat timeout later."""
        config, disturbances = self.config, self.disturbances
        interval = self.cluster.heartbeat_interval_s
        delays = 2 * (disturbances.delay_max_s if disturbances is not None else 0.0)
        bound = config.heartbeat_timeout_s + interval + delays + 0.06
        for (worker_id, assignment), since in list(self._missing.items()):
            if self._holds(worker_id).get(assignment) is not Hold.MISSING:
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


class WorkerOracles:
    """The worker-side checks above (answered Resends, waste), for every worker. Keys
    name the worker process (its start count), since its epochs are per router."""

    def __init__(self, cluster: ClusterView, disturbances: Disturbances | None) -> None:
        self.cluster = cluster
        self.disturbances = disturbances
        self.violations: list[str] = []
        self.waste_s = 0.0  # assignment-seconds workers held work the router did not want
        self._unwanted: dict[tuple[str, int, Assignment], float] = {}
        self._last_waste_check = 0.0
        self._sent: dict[tuple[str, int, Assignment], int] = {}  # tokens a worker sent
        self._completed: dict[tuple[str, int], deque[Assignment]] = {}
        self.completions: Counter[tuple[str, int]] = Counter()  # per worker process
        # When each worker process took and ended each assignment, and sent each
        # heartbeat, in worker events handled (ticks), to tell which came first.
        self._tick = 0
        self._took: dict[tuple[str, int, Assignment], int] = {}
        self._ended: dict[tuple[str, int, Assignment], int] = {}
        self._beats: dict[tuple[str, str, int, int], tuple[int, int]] = {}
        # Every TokenRun a worker sent in answer to a Resend, in order: each router's
        # Oracles read their own from here to time the run's delivery.
        self.recovered: list[Recovered] = []

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    def after_worker(self, worker_id: str, event: WorkerEvent, effects: list[WorkerEffect]) -> None:
        process = self.cluster.process(worker_id)
        self._tick += 1
        tick = self._tick
        for effect in effects:
            if not isinstance(effect, SendToRouter):
                if isinstance(effect, StartDecode):
                    self._took[worker_id, process, effect.assignment] = tick
                elif isinstance(effect, StopDecode):
                    self._ended.setdefault((worker_id, process, effect.assignment), tick)
                continue
            match effect.message:
                case Token(assignment, index):
                    key = (worker_id, process, assignment)
                    self._sent[key] = max(self._sent.get(key, 0), index + 1)
                case Heartbeat(epoch=epoch, seq=seq):
                    self._beats[worker_id, effect.router_id, epoch, seq] = (process, tick)
                case Finished(assignment, reason) if reason in ("eos", "length"):
                    retained = self.cluster.workers[worker_id].config.retained_outputs
                    done = self._completed.setdefault((worker_id, process), deque(maxlen=retained))
                    if assignment not in done:
                        done.append(assignment)
                        self.completions[worker_id, process] += 1
                    self._sent.pop((worker_id, process, assignment), None)
                    self._ended.setdefault((worker_id, process, assignment), tick)
                case Finished(assignment):
                    self._sent.pop((worker_id, process, assignment), None)
                    self._ended.setdefault((worker_id, process, assignment), tick)
                case HandOff() as handoff:
                    self._check_handoff(worker_id, handoff, effect.router_id)
        if isinstance(event, FromRouterMessage) and isinstance(event.message, Resend):
            self._check_resend(worker_id, process, event.message, effects)

    def ended_before(
        self, worker_id: str, router_id: str, beat: Heartbeat, assignment: Assignment
    ) -> bool | None:
        """Had the worker process that sent this heartbeat taken and ended the assignment
        before sending it? None: no worker sent such a heartbeat."""
        sent = self._beats.get((worker_id, router_id, beat.epoch, beat.seq))
        if sent is None:
            return None
        process, tick = sent
        took = self._took.get((worker_id, process, assignment))
        ended = self._ended.get((worker_id, process, assignment))
        return took is not None and took <= tick and ended is not None and ended <= tick

    def _check_handoff(self, worker_id: str, handoff: HandOff, router_id: str) -> None:
        """A HandOff gives a router back only what the worker holds of that router's,
        under the epoch of that router's link."""
        worker = self.cluster.workers[worker_id]
        held = worker.holds()
        epoch = worker.links().get(router_id)
        wrong = [a for a in handoff.assignments if a.router != router_id or a not in held]
        if wrong or handoff.epoch != epoch or handoff.worker_id != worker_id:
            self._violation(
                f"{worker_id} handed {router_id or 'its router'} {wrong or handoff.assignments} "
                f"(epoch {handoff.epoch}; the link's is {epoch})"
            )

    def _check_resend(
        self, worker_id: str, process: int, resend: Resend, effects: list[WorkerEffect]
    ) -> None:
        assignment = resend.assignment
        answers = [
            e.message
            for e in effects
            if isinstance(e, SendToRouter)
            and isinstance(e.message, TokenRun | Finished)
            and e.message.assignment == assignment
        ]
        sent = self._sent.get((worker_id, process, assignment))
        runs = [a for a in answers if isinstance(a, TokenRun)]
        for run in runs:
            end = run.start_index + len(run.token_ids)
            self.recovered.append(Recovered(worker_id, assignment, end, self.cluster.now))
        if assignment in self.cluster.workers[worker_id].holds():
            asked = resend.from_index
            if sent is not None and asked < sent and (not runs or runs[0].start_index != asked):
                self._violation(
                    f"{worker_id} asked to resend {assignment} from {asked} "
                    f"of {sent} sent, answered {answers}"
                )
        elif assignment in self._completed.get((worker_id, process), ()) and not any(
            isinstance(a, Finished) for a in answers
        ):
            self._violation(
                f"{worker_id} completed {assignment} recently but answered a Resend "
                f"for it with {answers}"
            )

    def check_waste(self, now: float, bound_s: float, every_s: float) -> None:
        """No worker keeps an unwanted assignment past the bound once undisturbed.
        (Work of a router that died is let go of when the worker hears its link
        close; check_safety sees that it never outlives the link.)"""
        if now - self._last_waste_check < every_s or self.disturbances is None:
            return
        step = now - self._last_waste_check
        self._last_waste_check = now
        cluster = self.cluster
        unwanted: dict[tuple[str, int, Assignment], float] = {}
        for worker_id, worker in cluster.workers.items():
            if not cluster.alive(worker_id):
                continue
            process = cluster.process(worker_id)
            for assignment in worker.holds():
                if cluster.wants(worker_id, assignment) is not False:
                    continue
                key = (worker_id, process, assignment)
                since = unwanted[key] = self._unwanted.get(key, now)
                self.waste_s += step if key in self._unwanted else 0.0
                held = now - max(since, self.disturbances.quiet_since(worker_id))
                if held > bound_s:
                    self._violation(
                        f"{worker_id} kept {assignment}, which the router does not want, "
                        f"{held:.3f}s past its last disturbance (bound {bound_s:.3f}s)"
                    )
        self._unwanted = unwanted
