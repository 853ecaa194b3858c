"""The router's view of its workers: health, heartbeats, liveness and epochs.

Fleet is part of the router machine (core/router.py drives it from
`Router.handle`); every change to a worker's health happens here, through the
HEALTH table of core/states.py, and nowhere else. It extends Slots
(core/slots.py), which owns each worker's record, the holds counted against
its slots and the choice of a worker for the next attempt.

Epochs come from registration: the router hands each process of a worker id
the next epoch, and fences heartbeats of an epoch it never handed out, one
that is gone (the transport lost it) or one older than the live one.

What a worker event means for the attempts placed there is the request
side's business (core/requests.py): the methods taking worker events
(register, on_heartbeat, on_liveness_timer, on_worker_gone) yield it as
AttemptNews, one item at a time: an attempt lost with its worker, listed by a
heartbeat, to ask again for, or dropped. Router hands each item to the
request side before the fleet goes on, so the effects come out in the order
the event implies them; the fleet itself never calls the request side.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Literal

from msgspec import Struct

from core.config import RouterConfig
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
from core.slots import DRAINING_HOLDS, Slots, WorkerRecord
from core.states import HEALTH, Health, HealthEvent, Hold, HoldEvent


class AttemptNews(Struct, frozen=True):
    """What a worker event means for one attempt placed there (the request side acts):
    lost (with its worker, `message` says how), listed (a heartbeat shows it runs),
    resend (the worker let go of it: ask for its last output again), dropped (it
    stayed missing from the worker's heartbeats)."""

    kind: Literal["lost", "listed", "resend", "dropped"]
    request_id: str
    assignment: Assignment
    message: str = ""


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


class Fleet(Slots):
    def __init__(self, config: RouterConfig, fenced: Counter[str]) -> None:
        super().__init__(config, fenced)
        self.stuck: set[str] = set()  # workers in Health.STUCK (checked per token: cheap)
        self.assigned: dict[str, int] = {}  # the last epoch handed out per worker id

    # --- worker events ---

    def register(
        self, worker_id: str, takeover: bool, out: list[RouterEffect]
    ) -> Iterator[AttemptNews]:
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
            yield from self.on_worker_gone(worker_id, epoch - 1, f"replaced by epoch {epoch}", out)
        out.append(Registration(worker_id, epoch))

    def on_heartbeat(
        self, worker_id: str, beat: Heartbeat, out: list[RouterEffect]
    ) -> Iterator[AttemptNews]:
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
            yield from self._lose_holds(worker, f"worker {worker_id} restarted")
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
        yield from self._reconcile(worker, beat, out)

    def on_liveness_timer(self, worker_id: str, out: list[RouterEffect]) -> Iterator[AttemptNews]:
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
            yield from self._lose_holds(worker, f"worker {worker_id} stopped heartbeating")

    def on_worker_gone(
        self, worker_id: str, epoch: int, reason: str, out: list[RouterEffect]
    ) -> Iterator[AttemptNews]:
        worker = self.workers.get(worker_id)
        if worker is None or epoch < worker.epoch or epoch <= worker.gone_epoch:
            return  # never registered, or an older connection than the one we know
        worker.gone_epoch = epoch
        self._move_health(worker, HealthEvent.CONNECTION_LOST)
        yield from self._lose_holds(worker, f"worker {worker_id} disconnected: {reason}")

    def _reconcile(
        self, worker: WorkerRecord, beat: Heartbeat, out: list[RouterEffect]
    ) -> Iterator[AttemptNews]:
        """Compare the worker's own list of assignments with the router's holds."""
        for assignment in beat.active:
            state = self.move(worker, assignment, HoldEvent.LISTED)
            if state is None or state in DRAINING_HOLDS:
                if state is None:
                    self._fenced["orphan"] += 1
                out.append(SendToWorker(worker.worker_id, Cancel(assignment)))
            else:  # its OfferResult may have been lost or be late
                yield AttemptNews("listed", worker.holds[assignment].request_id, assignment)
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
                yield AttemptNews("resend", record.request_id, assignment)
            else:
                yield AttemptNews("dropped", record.request_id, assignment)

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

    def _lose_holds(self, worker: WorkerRecord, message: str) -> Iterator[AttemptNews]:
        """The worker is lost: every hold goes; the attempts the router wanted are lost."""
        for request_id, assignment in self.release_all(worker):
            yield AttemptNews("lost", request_id, assignment, message)

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
