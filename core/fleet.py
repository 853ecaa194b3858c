"""The router's view of its workers: health, heartbeat freshness, and slot holds.

Fleet is part of the router machine (core/router.py drives it from
`Router.handle`); it is split out so that every change to a worker's health
and to the holds counted against its slots happens here, through the HEALTH
and HOLD tables of core/states.py, and nowhere else.

Holds: the router counts, per worker, the assignments it believes the worker
holds. A hold is taken when an offer is sent (offered), confirmed when the
worker's answer, output or heartbeat names it (held), and released when the
worker declines or finishes it, when the offer expires, when the worker is
lost, or when it has been missing from the worker's heartbeats for too long.
An assignment the router no longer wants (its client cancelled) keeps its
hold (draining) until the worker shows it has let go, so the router never
offers a slot the worker still fills.

What the holds mean for requests (retry, resume, accept, ask again) is the
router's business: the methods here return what happened, and Router acts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct

from core.blocks import chain_hashes
from core.protocol import (
    ArmTimer,
    Assignment,
    CacheReport,
    Cancel,
    Heartbeat,
    LivenessTimer,
    Registration,
    RouterEffect,
    SendToWorker,
)
from core.states import HEALTH, HOLD, LIVE_HOLDS, Health, HealthEvent, Hold, HoldEvent

if TYPE_CHECKING:
    from core.router import RouterConfig

DRAINING_HOLDS = (Hold.DRAINING_OFFER, Hold.DRAINING)


class RequestSide(Protocol):
    """What worker events mean for requests: the router's request side (core/requests.py)."""

    def lost(self, request_id: str, assignment: Assignment, message: str,
             out: list[RouterEffect]) -> None: ...  # fmt: skip

    def listed(self, request_id: str, assignment: Assignment, out: list[RouterEffect]) -> None: ...

    def resend(self, request_id: str, assignment: Assignment, out: list[RouterEffect]) -> None: ...

    def dropped(self, request_id: str, assignment: Assignment, out: list[RouterEffect]) -> None: ...


class Chain:
    """A request's context tokens and, computed once per block size, their chain keys
    (core/blocks.py), to look up in workers' cache reports."""

    __slots__ = ("_keys", "tokens")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens: Sequence[int] = tokens
        self._keys: dict[int, list[int]] = {}

    def keys(self, block_size: int) -> list[int]:
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = chain_hashes(self.tokens, block_size)
        return keys


Placement = tuple["WorkerRecord", int]
"""A worker chosen for an attempt, and the tokens it is predicted to prefill."""


class WorkerView(Struct, frozen=True):
    worker_id: str
    epoch: int
    healthy: bool
    slots: int
    held: int
    reported_free_slots: int
    max_context: int
    placed: int = 0  # attempts offered to this worker id
    cache: CacheReport | None = None  # its latest cache report, as received
    others: int = 0  # slots its last heartbeat counts as taken by other routers' work
    health: Health = Health.HEALTHY  # healthy, stuck, silent or gone (`healthy` is its test)


@dataclass(slots=True)
class HoldRecord:
    request_id: str
    state: Hold
    prefill: int = 0  # tokens predicted to prefill, until the attempt's first token
    missing_since: float | None = None  # when a heartbeat first left it out
    taken_after: int = -1  # the worker took it after sending this heartbeat (seq)


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    epoch: int
    seq: int
    slots: int = 0
    free_slots: int = 0
    max_context: int = 0
    expires_at: float = 0.0
    health: Health = Health.HEALTHY
    timer_deadline: float | None = None  # the liveness timer as armed, if it is
    gone_epoch: int = -1  # the transport lost this epoch: it may not come back
    stuck_until: float = 0.0  # while stuck: when a heartbeat may give it another chance
    holds: dict[Assignment, HoldRecord] = field(default_factory=dict)
    cache: CacheReport | None = None  # the latest report of this epoch's process
    cache_keys: frozenset[int] = frozenset()  # cache.keys, as a set
    cache_seen_at: float = 0.0  # when that heartbeat arrived
    placed: int = 0  # attempts offered to this worker id, over the router's life
    # Slots taken by other routers' work, as the last heartbeat (or a decline for want
    # of a slot) tells: the slots it reports in use that are not this router's.
    others: int = 0

    @property
    def capacity(self) -> int:
        """Slots this router may count on: the worker's, less what others hold."""
        return self.slots - self.others

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    def is_stale(self, beat: Heartbeat) -> bool:
        """An epoch that is gone or older, or the same epoch and no newer sequence number."""
        return (
            beat.epoch <= self.gone_epoch
            or beat.epoch < self.epoch
            or (beat.epoch == self.epoch and beat.seq <= self.seq)
        )


class Fleet:
    def __init__(self, config: RouterConfig, fenced: Counter[str]) -> None:
        self.config = config
        self.workers: dict[str, WorkerRecord] = {}
        self.requests: RequestSide | None = None  # set by the Router that owns both
        self.stuck: set[str] = set()  # workers in Health.STUCK (checked per token: cheap)
        self.assigned: dict[str, int] = {}  # the last epoch handed out per worker id
        self.now = 0.0  # the `now` of the event being handled; never read from a clock
        self._fenced = fenced

    # --- worker events ---

    def register(self, worker_id: str, takeover: bool, out: list[RouterEffect]) -> None:
        """A connection asks to serve as worker_id: hand out the next epoch, unless a
        live worker (healthy or stuck: it heartbeats) has the id and this is no takeover.

        Epochs come from here, not from the workers' clocks, so a process on a host
        whose clock runs ahead cannot lock the real one out: a heartbeat naming an
        epoch never handed out is fenced."""
        worker = self.workers.get(worker_id)
        live = worker is not None and worker.health in (Health.HEALTHY, Health.STUCK)
        if live and not takeover:
            assert worker is not None
            reason = (
                f"worker id {worker_id!r} is in use by a live worker (epoch {worker.epoch}); "
                "give this one another id, or let it take over"
            )
            out.append(Registration(worker_id, None, reason))
            return
        last = self.assigned.get(worker_id, -1)
        if worker is not None:
            last = max(last, worker.epoch, worker.gone_epoch)
        epoch = self.assigned[worker_id] = last + 1
        if worker is not None:
            # The id's new process retires every older epoch (a live one only on a
            # takeover), including one handed out but not yet heard from: their
            # heartbeats are stale from now on, and what they held is lost at once
            # rather than revived by a late heartbeat until the new one's first.
            self.on_worker_gone(worker_id, epoch - 1, f"replaced by epoch {epoch}", out)
        out.append(Registration(worker_id, epoch))

    def on_heartbeat(self, worker_id: str, beat: Heartbeat, out: list[RouterEffect]) -> None:
        if beat.worker_id != worker_id:
            self._fenced["wrong_worker"] += 1
            return
        if beat.epoch > self.assigned.get(worker_id, beat.epoch):
            self._fenced["unknown_epoch"] += 1  # from the future: never handed out
            return
        worker = self.workers.get(worker_id)
        event = HealthEvent.HEARTBEAT
        if worker is None:
            worker = WorkerRecord(worker_id, beat.epoch, beat.seq)
            self.workers[worker_id] = worker
        elif worker.is_stale(beat):
            self._fenced["stale_heartbeat"] += 1
            return
        elif beat.epoch > worker.epoch:
            # A restart: everything the old process held is gone with it. The new
            # epoch is recorded first so that retries never offer to the old one.
            worker.epoch = beat.epoch
            self._lose_holds(worker, f"worker {worker_id} restarted", out)
            event = HealthEvent.NEW_EPOCH
        elif worker.health is Health.STUCK and self.now >= worker.stuck_until:
            event = HealthEvent.PROBE_DUE
        worker.seq = beat.seq
        worker.cache = beat.cache
        worker.cache_keys = frozenset(beat.cache.keys) if beat.cache is not None else frozenset()
        worker.cache_seen_at = self.now
        worker.slots = beat.slots
        worker.free_slots = beat.free_slots
        # Heartbeats list only this router's assignments; the rest of the slots the
        # worker reports taken are other routers' (several routers, one worker).
        worker.others = max(0, beat.slots - beat.free_slots - len(beat.active))
        worker.max_context = beat.max_context
        worker.expires_at = self.now + self.config.heartbeat_timeout_s
        self._move_health(worker, event)
        if worker.timer_deadline is None:
            self._arm_liveness(worker, out)
        self._reconcile(worker, beat, out)

    def on_liveness_timer(self, worker_id: str, out: list[RouterEffect]) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        worker.timer_deadline = None
        if self.now < worker.expires_at:
            self._arm_liveness(worker, out)  # heartbeats moved the deadline on
            return
        was = worker.health
        self._move_health(worker, HealthEvent.DEADLINE_MISSED)
        if was in (Health.HEALTHY, Health.STUCK):
            self._lose_holds(worker, f"worker {worker_id} stopped heartbeating", out)

    def on_worker_gone(
        self, worker_id: str, epoch: int, reason: str, out: list[RouterEffect]
    ) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or epoch < worker.epoch or epoch <= worker.gone_epoch:
            return  # never registered, or an older connection than the one we know
        worker.gone_epoch = epoch
        self._move_health(worker, HealthEvent.CONNECTION_LOST)
        self._lose_holds(worker, f"worker {worker_id} disconnected: {reason}", out)

    def settle_unwanted(
        self, worker_id: str, assignment: Assignment, released: bool, out: list[RouterEffect]
    ) -> None:
        """A fenced Finished or OfferResult still tells us about the worker's slot."""
        worker = self.workers.get(worker_id)
        record = worker.holds.get(assignment) if worker is not None else None
        if worker is None or record is None or record.state not in DRAINING_HOLDS:
            if not released:
                # The worker took an offer nobody wants (late or duplicated): stop it.
                self._fenced["orphan"] += 1
                out.append(SendToWorker(worker_id, Cancel(assignment)))
            return
        if released:
            self.move(worker, assignment, HoldEvent.RELEASED)
        else:
            self.move(worker, assignment, HoldEvent.CONFIRMED)
            out.append(SendToWorker(worker_id, Cancel(assignment)))

    def _reconcile(self, worker: WorkerRecord, beat: Heartbeat, out: list[RouterEffect]) -> None:
        """Compare the worker's own list of assignments with the router's holds."""
        requests = self._requests()
        for assignment in beat.active:
            state = self.move(worker, assignment, HoldEvent.LISTED)
            if state is None or state in DRAINING_HOLDS:
                if state is None:
                    self._fenced["orphan"] += 1
                out.append(SendToWorker(worker.worker_id, Cancel(assignment)))
            else:  # its OfferResult may have been lost or be late
                requests.listed(worker.holds[assignment].request_id, assignment, out)
        listed = set(beat.active)
        for assignment, record in list(worker.holds.items()):
            if assignment in listed or record.state in (Hold.OFFERED, Hold.DRAINING_OFFER):
                continue  # listed, or the worker may not have seen the offer yet
            if beat.seq <= record.taken_after:
                continue  # sent before the worker took it (it was overtaken on the way)
            if self.move(worker, assignment, HoldEvent.ABSENT) is not Hold.MISSING:
                continue  # a draining hold: the worker let go
            # The worker has let go of it: its last tokens or Finished are in flight, or
            # lost. Ask again; give up once it stays missing.
            assert record.missing_since is not None
            if self.now - record.missing_since < self.config.heartbeat_timeout_s:
                requests.resend(record.request_id, assignment, out)
            else:
                requests.dropped(record.request_id, assignment, out)

    def current(self, worker_id: str, epoch: int) -> bool:
        """Whether `epoch` is the live epoch the router knows the worker by (a
        HandOff from any other is stale: fenced)."""
        worker = self.workers.get(worker_id)
        return (
            worker is not None
            and worker.epoch == epoch
            and epoch > worker.gone_epoch
            and worker.health in (Health.HEALTHY, Health.STUCK)
        )

    def holds_live(self, worker_id: str, assignment: Assignment) -> bool:
        """Whether the router counts a live (wanted) hold of this assignment there."""
        worker = self.workers.get(worker_id)
        record = worker.holds.get(assignment) if worker is not None else None
        return record is not None and record.state in LIVE_HOLDS

    def full(self, worker_id: str, epoch: int) -> None:
        """The worker declined an offer for want of a slot (other routers' work fills
        it): count it full, for this router, until its next heartbeat says otherwise."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.epoch == epoch:
            worker.others = max(worker.others, worker.slots - len(worker.holds))

    def progress_missed(self, worker_id: str) -> None:
        """An assignment on the worker missed its progress deadline: no offers for now."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.health in (Health.HEALTHY, Health.STUCK):
            self._move_health(worker, HealthEvent.PROGRESS_MISSED)
            worker.stuck_until = self.now + self.config.stuck_probe_s

    def progressed(self, worker_id: str) -> None:
        """A token from a stuck worker: its decoder runs again (callers check `stuck`)."""
        self._move_health(self.workers[worker_id], HealthEvent.PROGRESS)

    def _move_health(self, worker: WorkerRecord, event: HealthEvent) -> None:
        worker.health = HEALTH.next(worker.health, event)
        if worker.health is Health.STUCK:
            self.stuck.add(worker.worker_id)
        else:
            self.stuck.discard(worker.worker_id)

    def _arm_liveness(self, worker: WorkerRecord, out: list[RouterEffect]) -> None:
        worker.timer_deadline = worker.expires_at
        out.append(ArmTimer(LivenessTimer(worker.worker_id), worker.expires_at))

    def _lose_holds(self, worker: WorkerRecord, message: str, out: list[RouterEffect]) -> None:
        """The worker is lost: every hold goes; the attempts the router wanted are lost."""
        holds, worker.holds = worker.holds, {}
        requests = self._requests()
        for assignment, record in holds.items():
            was = record.state
            record.state = HOLD.next(was, HoldEvent.RELEASED)
            if was in LIVE_HOLDS:
                requests.lost(record.request_id, assignment, message, out)

    def _requests(self) -> RequestSide:
        assert self.requests is not None, "a Fleet works inside a Router"
        return self.requests

    # --- holds ---

    @staticmethod
    def take(worker: WorkerRecord, assignment: Assignment, request_id: str, prefill: int) -> None:
        """An offer went out: the slot counts as taken from now on."""
        worker.holds[assignment] = HoldRecord(
            request_id, HOLD.next(Hold.FREE, HoldEvent.OFFER_SENT), prefill
        )
        worker.placed += 1

    def first_token(self, worker_id: str, assignment: Assignment) -> None:
        """The attempt is past its prefill: no longer work queued ahead on that worker."""
        worker = self.workers.get(worker_id)
        record = worker.holds.get(assignment) if worker is not None else None
        if record is not None:
            record.prefill = 0

    def move(self, worker: WorkerRecord, assignment: Assignment, event: HoldEvent) -> Hold | None:
        """Move one hold; None if the worker has no hold for that assignment."""
        record = worker.holds.get(assignment)
        if record is None:
            return None
        nxt = HOLD.next(record.state, event)
        if nxt is Hold.FREE:
            del worker.holds[assignment]
        elif nxt is not Hold.MISSING:
            record.missing_since = None
        elif record.missing_since is None:
            record.missing_since = self.now
        record.state = nxt
        return nxt

    def release(self, worker_id: str, assignment: Assignment) -> None:
        """The worker let the assignment go (or never took it): the slot is free."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            self.move(worker, assignment, HoldEvent.RELEASED)

    def unwanted(self, worker_id: str, assignment: Assignment) -> Hold | None:
        """The router cancelled the assignment: the hold drains until the worker lets go."""
        worker = self.workers.get(worker_id)
        return None if worker is None else self.move(worker, assignment, HoldEvent.UNWANTED)

    def taken_after(self, worker_id: str, assignment: Assignment, seq: int) -> None:
        """The worker says it took the assignment after its heartbeat `seq`."""
        worker = self.workers.get(worker_id)
        record = worker.holds.get(assignment) if worker is not None else None
        if record is not None:
            record.taken_after = max(record.taken_after, seq)

    def confirm(self, worker_id: str, assignment: Assignment) -> None:
        self.move(self.workers[worker_id], assignment, HoldEvent.CONFIRMED)

    def expire_draining_offer(self, assignment: Assignment) -> None:
        """An offer timer fired for an assignment nobody wants any more: stop counting
        its slot unless the worker confirmed it (then the worker's word releases it)."""
        for worker in self.workers.values():
            record = worker.holds.get(assignment)
            if record is not None and record.state is Hold.DRAINING_OFFER:
                self.move(worker, assignment, HoldEvent.OFFER_EXPIRED)

    # --- choosing workers ---

    def fitting(self, context_tokens: int) -> list[WorkerRecord]:
        """Healthy workers whose context holds the request."""
        return [w for w in self.workers.values() if w.healthy and w.max_context >= context_tokens]

    def candidate(
        self, context_tokens: int, context: Chain, tried: set[str], exclude: str | None
    ) -> Placement | None:
        """Healthy, fitting, a free slot; untried first, then (cache-aware) the least
        predicted time to first token, then fewest holds, then id. Returns the
        worker and the tokens it is predicted to prefill."""
        best: Placement | None = None
        best_key: tuple[bool, float, int, str] | None = None
        aware = self.config.routing == "cache-aware"
        for worker in self.fitting(context_tokens):
            if worker.worker_id == exclude or len(worker.holds) >= worker.capacity:
                continue
            prefill = len(context.tokens) - (self.cached_tokens(worker, context) if aware else 0)
            predicted = 0.0
            if aware:
                ahead = self.queued_prefill(worker)
                rate = (worker.cache.prefill_rate if worker.cache else 0.0) or (
                    self.config.default_prefill_rate
                )
                predicted = (ahead + prefill) / rate
            key = (worker.worker_id in tried, predicted, len(worker.holds), worker.worker_id)
            if best_key is None or key < best_key:
                best, best_key = (worker, prefill), key
        return best

    @staticmethod
    def queued_prefill(worker: WorkerRecord) -> int:
        """Prefill tokens placed on the worker and not yet past their first token."""
        return sum(record.prefill for record in worker.holds.values())

    def cached_tokens(self, worker: WorkerRecord, context: Chain) -> int:
        """Tokens of `context` the worker's last report says it can reuse: leading
        whole blocks found among its keys (0 for a report too old to trust)."""
        report = worker.cache
        if report is None or self.now - worker.cache_seen_at > self.config.cache_report_max_age_s:
            return 0
        keys = worker.cache_keys
        found = 0
        for key in context.keys(report.block_size):
            if key not in keys:
                break
            found += 1
        return min(found * int(report.block_size), len(context.tokens) - 1)

    # --- reading ---

    def views(self) -> tuple[WorkerView, ...]:
        return tuple(
            WorkerView(
                worker_id=w.worker_id,
                epoch=w.epoch,
                healthy=w.healthy,
                slots=w.slots,
                held=len(w.holds),
                reported_free_slots=w.free_slots,
                max_context=w.max_context,
                placed=w.placed,
                cache=w.cache,
                others=w.others,
                health=w.health,
            )
            for w in self.workers.values()
        )

    def slot_usage(self) -> list[tuple[str, int, int]]:
        """(worker id, slots the router counts as taken, slots) for each known worker."""
        return [(w.worker_id, len(w.holds), w.slots) for w in self.workers.values()]

    def live_holders(self, request_id: str) -> list[str]:
        """Workers holding a live (wanted) hold for the request."""
        return [
            w.worker_id
            for w in self.workers.values()
            for record in w.holds.values()
            if record.request_id == request_id and record.state in LIVE_HOLDS
        ]
