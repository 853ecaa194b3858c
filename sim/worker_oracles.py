"""The oracles that watch the workers: Resends answered, HandOffs, unwanted work kept.

One WorkerOracles sees every worker event the cluster runs (whichever router
it concerns), so it is also where the router-side oracles learn what only a
worker knows: when each process took and ended each assignment and sent each
heartbeat (`ended_before`), and every TokenRun sent in answer to a Resend
(`recovered`), which each router's Oracles time to the client. What it checks
is in sim/oracles.py's list, with the router side's.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.protocol import (
    Assignment,
    Finished,
    FromRouterMessage,
    HandOff,
    Heartbeat,
    Resend,
    SendToRouter,
    StartDecode,
    StopDecode,
    Token,
    TokenRun,
    WorkerEffect,
    WorkerEvent,
)

if TYPE_CHECKING:
    from sim.disturbances import Disturbances
    from sim.view import ClusterView


@dataclass(frozen=True, slots=True)
class Recovered:
    """A TokenRun a worker sent in answer to a Resend: up to `end`, at `sent_at`."""

    worker_id: str
    assignment: Assignment
    end: int
    sent_at: float


class WorkerOracles:
    """The worker-side checks of sim/oracles.py's list (answered Resends, HandOffs,
    waste), for every worker. Keys name the worker process (its start count), since
    its epochs are per router."""

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
        close; Invariants.check_safety sees that it never outlives the link.)"""
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
