"""The router's slot accounting: each worker's record, the holds on its slots, and
the choice of a worker with a free one.

Part of the router machine, under core/fleet.py (Fleet extends Slots with the
workers' health, heartbeats and epochs). Every move of a slot hold happens
here, through the HOLD table of core/states.py, and nowhere else.

Holds: the router counts, per worker, the assignments it believes the worker
holds. A hold is taken when an offer is sent (offered), confirmed when the
worker's answer, output or heartbeat names it (held), and released when the
worker declines or finishes it, when the offer expires, when the worker is
lost, or when it has been missing from the worker's heartbeats for too long.
An assignment the router no longer wants (its client cancelled) keeps its
hold (draining) until the worker shows it has let go, so the router never
offers a slot the worker still fills.

Choosing: a healthy worker whose context fits and whose holds leave a slot
free, ranked (cache-aware) by the predicted time to first token from the
holds still prefilling there and its latest cache report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.blocks import chain_hashes
from core.config import RouterConfig
from core.protocol import (
    Assignment,
    CacheReport,
    Cancel,
    Heartbeat,
    RouterEffect,
    SendToWorker,
)
from core.states import HOLD, LIVE_HOLDS, Health, Hold, HoldEvent

DRAINING_HOLDS = (Hold.DRAINING_OFFER, Hold.DRAINING)


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


class Slots:
    """The holds of every known worker, and where the next attempt may go."""

    def __init__(self, config: RouterConfig, fenced: Counter[str]) -> None:
        self.config = config
        self.workers: dict[str, WorkerRecord] = {}
        self.now = 0.0  # the `now` of the event being handled; never read from a clock
        self._fenced = fenced

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

    def release_all(self, worker: WorkerRecord) -> list[tuple[str, Assignment]]:
        """The worker is lost: every hold goes. Returns (request id, assignment) of each
        live one, in hold order: the attempts the router wanted there."""
        holds, worker.holds = worker.holds, {}
        lost: list[tuple[str, Assignment]] = []
        for assignment, record in holds.items():
            was = record.state
            record.state = HOLD.next(was, HoldEvent.RELEASED)
            if was in LIVE_HOLDS:
                lost.append((record.request_id, assignment))
        return lost

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

    # --- what a fenced answer still says about a slot ---

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

    # --- reading ---

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
