"""The router machine: every router state transition lives in this file.

One Router spreads GenerationRequests over workers and turns their fenced
output into an in-order stream per client. It is sans-IO: `handle(event, now)`
returns effects (messages to send, timers to arm, deliveries to clients) and
never reads a clock, draws a random number or touches the network.

Theory of operation
-------------------
A request moves through the phases of TRANSITIONS below. Each attempt to serve
it gets a fresh Assignment(request_id, attempt). The router accepts worker
output for a request only when it names the request's active assignment and,
for tokens, carries index == tokens already delivered. Anything else (a
duplicate, a gap, a reordered or stale message, anything after a terminal
outcome) is dropped and counted in statistics(). Before the first token has
been delivered, a failed attempt (decline, offer timeout, worker loss, failed
finish) is retried on another worker. After it, a lost attempt is *resumed*:
the router knows exactly which tokens the client has (it delivered them), so
it offers a continuation, the same request with those tokens as
`output_prefix`, as a new attempt; the new worker generates from index k, the
fence expects index k, and the client's stream simply goes on. Resumes are
bounded by `max_resumes` (0 restores the plain contract: a started stream that
loses its worker ends with `worker_lost`). A failed finish (the decoder broke
on this request) is not resumed.

Slots: the router counts, per worker, the assignments it believes the worker
holds ("holds"). A hold is taken when an offer is sent and released when the
worker declines, finishes, is lost, or its heartbeat shows it no longer holds a
cancelled assignment. Heartbeats list the worker's assignments; the router
answers any it does not want with Cancel, so slots leak neither on the worker
nor in the router even when messages are duplicated, reordered or dropped.

Errors split by fault: anything from the network is expected to be wrong at
times and is fenced; a call our own code should never make (submitting the
same request id twice) raises RouterMisuse.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

from msgspec import Struct
from msgspec.structs import replace

from core.protocol import (
    ArmTimer,
    Assignment,
    Cancel,
    ClientCancel,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    DisarmTimer,
    ErrorKind,
    Finished,
    FromWorkerMessage,
    GenerationRequest,
    Heartbeat,
    LivenessTimer,
    Offer,
    OfferResult,
    OfferTimer,
    Resend,
    RouterEffect,
    RouterEvent,
    SendToWorker,
    Submit,
    TimerFired,
    Token,
    TokenRun,
    WorkerGone,
)


class RouterMisuse(Exception):
    """Our own code asked the router for something impossible (a bug, not bad input)."""


class Phase(enum.Enum):
    RECEIVED = "received"  # admitted, waiting in the queue for a slot
    OFFERED = "offered"  # offer sent to one worker, answer pending
    ASSIGNED = "assigned"  # the worker accepted; no token delivered yet
    STREAMING = "streaming"  # at least one token delivered to the client
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


Input = Literal[
    "dispatch",  # a candidate worker has a free slot: send an offer
    "accept",  # the worker accepted (explicitly, or implied by its output)
    "token",  # the next token was delivered to the client
    "finish",  # the worker finished and every token has been delivered
    "retry",  # the attempt failed before the first token; offer elsewhere
    "requeue",  # the attempt failed before the first token; no slot now, wait
    "give_up",  # no worker can serve it, attempts exhausted, or lost mid-stream
    "cancel",  # the client cancelled
]

P = Phase
TRANSITIONS: dict[tuple[Phase, Input], Phase] = {
    (P.RECEIVED, "dispatch"): P.OFFERED,
    (P.RECEIVED, "give_up"): P.FAILED,
    (P.RECEIVED, "cancel"): P.CANCELLED,
    (P.OFFERED, "accept"): P.ASSIGNED,
    (P.OFFERED, "retry"): P.OFFERED,
    (P.OFFERED, "requeue"): P.RECEIVED,
    (P.OFFERED, "give_up"): P.FAILED,
    (P.OFFERED, "cancel"): P.CANCELLED,
    (P.ASSIGNED, "token"): P.STREAMING,
    (P.ASSIGNED, "finish"): P.COMPLETED,  # finished with zero tokens
    (P.ASSIGNED, "retry"): P.OFFERED,
    (P.ASSIGNED, "requeue"): P.RECEIVED,
    (P.ASSIGNED, "give_up"): P.FAILED,
    (P.ASSIGNED, "cancel"): P.CANCELLED,
    (P.STREAMING, "token"): P.STREAMING,
    (P.STREAMING, "finish"): P.COMPLETED,
    (P.STREAMING, "give_up"): P.FAILED,
    (P.STREAMING, "retry"): P.OFFERED,  # resumed: the continuation is offered
    (P.STREAMING, "requeue"): P.RECEIVED,  # resumed: waits for a slot
    (P.STREAMING, "cancel"): P.CANCELLED,
}
"""(phase, input) -> next phase. A pair missing here is a bug in this file."""

TERMINAL = frozenset({P.COMPLETED, P.FAILED, P.CANCELLED})

FenceReason = Literal[
    "late",  # names a request that is terminal or unknown
    "stale_attempt",  # names an attempt other than the active one
    "wrong_worker",  # came from a worker that does not hold the assignment
    "duplicate",  # token index already delivered
    "gap",  # token index beyond the next expected one
    "over_budget",  # token index at or past max_new_tokens, or a bad count
    "duplicate_result",  # offer answer for an assignment already accepted
    "stale_heartbeat",  # older epoch or sequence number than already seen, or a gone epoch
    "orphan",  # worker holds an assignment nobody wants: Cancel sent
]


class RouterConfig(Struct, frozen=True):
    offer_timeout_s: float = 2.0
    heartbeat_timeout_s: float = 3.0
    resend_interval_s: float = 0.1  # at most one Resend per request this often
    max_attempts: int = 3
    queue_limit: int = 256
    max_resumes: int = 2  # continuations after the first token; 0 = never resume


class WorkerView(Struct, frozen=True):
    worker_id: str
    epoch: int
    healthy: bool
    slots: int
    held: int
    reported_free_slots: int
    max_context: int


class RouterStatistics(Struct, frozen=True):
    requests_by_phase: dict[str, int]
    queued: int
    workers: tuple[WorkerView, ...]
    fenced: dict[str, int]
    outcomes: dict[str, int]
    tokens_delivered: int
    resends_requested: int
    retries: int  # attempts that failed before the first token and were tried again
    resumes: int  # continuations offered after the first token


@dataclass(slots=True)
class _Request:
    request: GenerationRequest
    phase: Phase = P.RECEIVED
    attempt: int = 0
    active: Assignment | None = None
    worker_id: str | None = None
    tokens: list[int] = field(default_factory=list)  # what the client has, for a resume
    resumes: int = 0
    tried: set[str] = field(default_factory=set)
    finish: Finished | None = None  # a finish that arrived before all its tokens
    resend_at: float | None = None  # when the last Resend for it was sent

    @property
    def delivered(self) -> int:
        """Tokens the client has; also the index the fence expects next."""
        return len(self.tokens)


@dataclass(slots=True)
class _Hold:
    request_id: str
    confirmed: bool = False  # the worker is known to have accepted it
    draining: bool = False  # the router no longer wants it; awaiting release
    missing_since: float | None = None  # confirmed but absent from heartbeats


@dataclass(slots=True)
class _Worker:
    worker_id: str
    epoch: int
    seq: int
    slots: int
    free_slots: int
    max_context: int
    expires_at: float
    healthy: bool = True
    timer_deadline: float | None = None
    gone_epoch: int = -1  # the transport lost this epoch: it may not come back
    holds: dict[Assignment, _Hold] = field(default_factory=dict)


class Router:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._requests: dict[str, _Request] = {}
        self._queue: deque[str] = deque()
        self._workers: dict[str, _Worker] = {}
        self._fenced: Counter[str] = Counter()
        self._outcomes: Counter[str] = Counter()
        self._tokens_delivered = 0
        self._resends = 0
        self._retries = 0
        self._resumes_total = 0
        self._now = 0.0  # the `now` of the event being handled; never read from a clock

    # --- the one entry point ---

    def handle(self, event: RouterEvent, now: float) -> list[RouterEffect]:
        self._now = now
        out: list[RouterEffect] = []
        match event:
            case FromWorkerMessage(worker_id, Token() as token):
                self._on_token(worker_id, token, out)
            case FromWorkerMessage(worker_id, TokenRun() as run):
                self._on_token_run(worker_id, run, out)
            case FromWorkerMessage(worker_id, Finished() as finished):
                self._on_finished(worker_id, finished, out)
            case FromWorkerMessage(worker_id, OfferResult() as result):
                self._on_offer_result(worker_id, result, out)
            case FromWorkerMessage(worker_id, Heartbeat() as heartbeat):
                self._on_heartbeat(worker_id, heartbeat, out)
            case Submit(request):
                self._on_submit(request, out)
                return out  # submit dispatches itself; nothing else changed
            case ClientCancel(request_id):
                self._on_client_cancel(request_id, out)
            case TimerFired(OfferTimer(assignment)):
                self._on_offer_timeout(assignment, out)
            case TimerFired(LivenessTimer(worker_id)):
                self._on_liveness_timer(worker_id, out)
            case WorkerGone(worker_id, epoch, reason):
                self._on_worker_gone(worker_id, epoch, reason, out)
            case _:
                raise RouterMisuse(f"router cannot handle {event!r}")
        self._dispatch_queue(out)
        return out

    def statistics(self) -> RouterStatistics:
        phases = Counter(r.phase.value for r in self._requests.values())
        workers = tuple(
            WorkerView(
                worker_id=w.worker_id,
                epoch=w.epoch,
                healthy=w.healthy,
                slots=w.slots,
                held=len(w.holds),
                reported_free_slots=w.free_slots,
                max_context=w.max_context,
            )
            for w in self._workers.values()
        )
        return RouterStatistics(
            requests_by_phase=dict(phases),
            queued=len(self._queue),
            workers=workers,
            fenced=dict(self._fenced),
            outcomes=dict(self._outcomes),
            tokens_delivered=self._tokens_delivered,
            resends_requested=self._resends,
            retries=self._retries,
            resumes=self._resumes_total,
        )

    def slot_usage(self) -> list[tuple[str, int, int]]:
        """(worker id, slots the router counts as taken, slots) for each known worker."""
        return [(w.worker_id, len(w.holds), w.slots) for w in self._workers.values()]

    # --- client side ---

    def _on_submit(self, request: GenerationRequest, out: list[RouterEffect]) -> None:
        if request.request_id in self._requests:
            raise RouterMisuse(f"request id {request.request_id!r} is already active")
        req = _Request(request)
        self._requests[request.request_id] = req
        if not self._fitting_workers(req):
            self._give_up(req, "no_worker", self._no_worker_message(req), out)
        elif not self._queue and (worker := self._candidate(req, exclude=None)) is not None:
            self._offer(req, worker, "dispatch", out)
        elif len(self._queue) >= self.config.queue_limit:
            self._give_up(req, "overloaded", "all workers are busy and the queue is full", out)
        else:
            self._queue.append(request.request_id)

    def _on_client_cancel(self, request_id: str, out: list[RouterEffect]) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return  # already terminal: a late cancel is normal and harmless
        if req.phase is P.RECEIVED:
            self._queue.remove(request_id)
        else:
            self._drain_active(req, out)
        cancelled = DeliverError(request_id, "cancelled", "cancelled by the client")
        self._terminate(req, "cancel", cancelled, out)

    # --- worker output ---

    def _on_token(self, worker_id: str, token: Token, out: list[RouterEffect]) -> None:
        req = self._fence(worker_id, token.assignment)
        if req is not None and self._is_next(req, token.index, token.index + 1, out):
            self._deliver(req, token.token_id, out)

    def _on_token_run(self, worker_id: str, run: TokenRun, out: list[RouterEffect]) -> None:
        req = self._fence(worker_id, run.assignment)
        end = run.start_index + len(run.token_ids)
        if req is None or not self._is_next(req, run.start_index, end, out):
            return
        budget_end = min(end, req.request.max_new_tokens)
        if budget_end < end:
            self._fenced["over_budget"] += 1  # a run past the budget: the excess is dropped
        for index in range(req.delivered, budget_end):
            if req.phase in TERMINAL:
                return  # a pending Finished completed it; the rest is over its count
            self._deliver(req, run.token_ids[index - run.start_index], out)

    def _is_next(self, req: _Request, start: int, end: int, out: list[RouterEffect]) -> bool:
        """The fence for output: does [start, end) contain the next index, within budget?"""
        if end <= req.delivered:
            self._fenced["duplicate"] += 1
            return False
        if start > req.delivered:
            self._fenced["gap"] += 1  # dropped; everything from the gap on is asked again
            self._ask_resend(req, out)
            return False
        if req.delivered >= req.request.max_new_tokens:
            self._fenced["over_budget"] += 1
            return False
        return True

    def _deliver(self, req: _Request, token_id: int, out: list[RouterEffect]) -> None:
        """Deliver the next token (the caller has checked it is the next one)."""
        if req.phase is P.OFFERED:
            self._accept(req, out)
        self._move(req, "token")
        out.append(DeliverToken(req.request.request_id, req.delivered, token_id))
        req.tokens.append(token_id)
        self._tokens_delivered += 1
        if req.finish is not None and req.delivered == req.finish.completion_tokens:
            self._complete(req, req.finish, out)

    def _on_finished(self, worker_id: str, finished: Finished, out: list[RouterEffect]) -> None:
        req = self._fence(worker_id, finished.assignment)
        if req is None:
            self._settle_drained(worker_id, finished.assignment, released=True, out=out)
            return
        if finished.reason in ("failed", "cancelled"):
            # The worker gave up on its own (we cancel only what we no longer track).
            self._release(req, out)
            self._attempt_failed(req, "failed", f"worker {worker_id} {finished.reason}", out)
            return
        if not req.delivered <= finished.completion_tokens <= req.request.max_new_tokens:
            self._fenced["over_budget"] += 1
            return
        if req.phase is P.OFFERED:
            self._accept(req, out)
        if finished.completion_tokens == req.delivered:
            self._complete(req, finished, out)
        else:
            req.finish = finished  # its last tokens are still in flight

    def _on_offer_result(
        self, worker_id: str, result: OfferResult, out: list[RouterEffect]
    ) -> None:
        req = self._fence(worker_id, result.assignment)
        if req is None:
            released = not result.accepted
            self._settle_drained(worker_id, result.assignment, released=released, out=out)
            return
        if req.phase is not P.OFFERED:
            self._fenced["duplicate_result"] += 1
            return
        if result.accepted:
            self._accept(req, out)
        else:
            self._release(req, out)
            self._attempt_failed(req, "no_worker", f"declined: {result.reason}", out)

    def _settle_drained(
        self, worker_id: str, assignment: Assignment, released: bool, out: list[RouterEffect]
    ) -> None:
        """A fenced Finished or OfferResult still tells us about the worker's slot."""
        worker = self._workers.get(worker_id)
        hold = worker.holds.get(assignment) if worker is not None else None
        if worker is None or hold is None or not hold.draining:
            if not released:
                # The worker took an offer nobody wants (late or duplicated): stop it.
                self._fenced["orphan"] += 1
                out.append(SendToWorker(worker_id, Cancel(assignment)))
            return
        if released:
            del worker.holds[assignment]
        else:
            hold.confirmed = True
            out.append(SendToWorker(worker_id, Cancel(assignment)))

    def _fence(self, worker_id: str, assignment: Assignment) -> _Request | None:
        """The request this worker message may act on, or None (counted) if fenced."""
        req = self._requests.get(assignment.request_id)
        if req is None:
            self._fenced["late"] += 1
            return None
        if req.active != assignment:
            self._fenced["stale_attempt"] += 1
            return None
        if req.worker_id != worker_id:
            self._fenced["wrong_worker"] += 1
            return None
        return req

    # --- timers and liveness ---

    def _on_offer_timeout(self, assignment: Assignment, out: list[RouterEffect]) -> None:
        req = self._requests.get(assignment.request_id)
        if req is not None and req.active == assignment and req.phase is P.OFFERED:
            # Cancel in case the offer was only slow: a late offer is then declined.
            assert req.worker_id is not None
            out.append(SendToWorker(req.worker_id, Cancel(assignment)))
            self._release(req, out)
            self._attempt_failed(req, "no_worker", "offer timed out", out)
            return
        # A request cancelled while offered keeps its hold until the offer expires.
        for worker in self._workers.values():
            hold = worker.holds.get(assignment)
            if hold is not None and hold.draining and not hold.confirmed:
                del worker.holds[assignment]

    def _on_liveness_timer(self, worker_id: str, out: list[RouterEffect]) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.timer_deadline = None
        if self._now >= worker.expires_at:
            if worker.healthy:
                worker.healthy = False
                self._lose_holds(worker, f"worker {worker_id} stopped heartbeating", out)
        else:
            self._arm_liveness(worker, out)

    def _on_worker_gone(
        self, worker_id: str, epoch: int, reason: str, out: list[RouterEffect]
    ) -> None:
        worker = self._workers.get(worker_id)
        if worker is None or epoch < worker.epoch or epoch <= worker.gone_epoch:
            return  # never registered, or an older connection than the one we know
        worker.gone_epoch = epoch
        worker.healthy = False
        self._lose_holds(worker, f"worker {worker_id} disconnected: {reason}", out)

    def _on_heartbeat(self, worker_id: str, beat: Heartbeat, out: list[RouterEffect]) -> None:
        if beat.worker_id != worker_id:
            self._fenced["wrong_worker"] += 1
            return
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = _Worker(worker_id, beat.epoch, beat.seq, 0, 0, 0, 0.0)
            self._workers[worker_id] = worker
        elif (
            beat.epoch <= worker.gone_epoch
            or beat.epoch < worker.epoch
            or (beat.epoch == worker.epoch and beat.seq <= worker.seq)
        ):
            self._fenced["stale_heartbeat"] += 1
            return
        elif beat.epoch > worker.epoch:
            # A restart: everything the old process held is gone with it. The new
            # epoch is recorded first so that retries never offer to the old one.
            worker.epoch = beat.epoch
            self._lose_holds(worker, f"worker {worker_id} restarted", out)
        worker.seq = beat.seq
        worker.slots = beat.slots
        worker.free_slots = beat.free_slots
        worker.max_context = beat.max_context
        worker.expires_at = self._now + self.config.heartbeat_timeout_s
        worker.healthy = True
        if worker.timer_deadline is None:
            self._arm_liveness(worker, out)
        self._reconcile(worker, beat, out)

    def _reconcile(self, worker: _Worker, beat: Heartbeat, out: list[RouterEffect]) -> None:
        """Compare the worker's own list of assignments with the router's holds."""
        listed = set(beat.active)
        for assignment in beat.active:
            hold = worker.holds.get(assignment)
            if hold is None or hold.draining:
                if hold is None:
                    self._fenced["orphan"] += 1
                out.append(SendToWorker(worker.worker_id, Cancel(assignment)))
            else:
                hold.confirmed = True
                hold.missing_since = None
                req = self._requests[hold.request_id]
                if req.phase is P.OFFERED:  # its OfferResult was lost or is late
                    self._accept(req, out)
        for assignment, hold in list(worker.holds.items()):
            if assignment in listed or not hold.confirmed:
                continue
            if hold.draining:
                del worker.holds[assignment]  # the worker let it go
            else:
                # The worker has let go of it: its last tokens or Finished are in
                # flight, or lost. Ask again; give up once it stays missing.
                req = self._requests[hold.request_id]
                if hold.missing_since is None:
                    hold.missing_since = self._now
                if self._now - hold.missing_since < self.config.heartbeat_timeout_s:
                    self._ask_resend(req, out)
                else:
                    self._release(req, out)
                    self._attempt_failed(req, "worker_lost", "worker dropped the assignment", out)

    def _ask_resend(self, req: _Request, out: list[RouterEffect]) -> None:
        """Ask the worker for everything from the next expected index (rate-limited)."""
        if req.active is None or req.worker_id is None:
            return
        last = req.resend_at
        if last is not None and self._now - last < self.config.resend_interval_s:
            return
        req.resend_at = self._now
        self._resends += 1
        out.append(SendToWorker(req.worker_id, Resend(req.active, req.delivered)))

    def _arm_liveness(self, worker: _Worker, out: list[RouterEffect]) -> None:
        worker.timer_deadline = worker.expires_at
        out.append(ArmTimer(LivenessTimer(worker.worker_id), worker.expires_at))

    def _lose_holds(self, worker: _Worker, message: str, out: list[RouterEffect]) -> None:
        holds, worker.holds = worker.holds, {}
        for assignment, hold in holds.items():
            if hold.draining:
                continue
            req = self._requests[hold.request_id]
            if req.phase is P.OFFERED:
                out.append(DisarmTimer(OfferTimer(assignment)))
            self._attempt_failed(req, "worker_lost", message, out)

    # --- scheduling ---

    def _fitting_workers(self, req: _Request) -> list[_Worker]:
        need = req.request.context_tokens
        return [w for w in self._workers.values() if w.healthy and w.max_context >= need]

    def _candidate(self, req: _Request, exclude: str | None) -> _Worker | None:
        """Healthy, fitting, a free slot; untried first, then fewest holds, then id."""
        best: _Worker | None = None
        best_key: tuple[bool, int, str] | None = None
        for worker in self._fitting_workers(req):
            if worker.worker_id == exclude or len(worker.holds) >= worker.slots:
                continue
            key = (worker.worker_id in req.tried, len(worker.holds), worker.worker_id)
            if best_key is None or key < best_key:
                best, best_key = worker, key
        return best

    def _offer(self, req: _Request, worker: _Worker, how: Input, out: list[RouterEffect]) -> None:
        self._move(req, how)
        req.attempt += 1
        assignment = Assignment(req.request.request_id, req.attempt)
        req.active = assignment
        req.worker_id = worker.worker_id
        req.tried.add(worker.worker_id)
        worker.holds[assignment] = _Hold(req.request.request_id)
        offer = Offer(worker.worker_id, worker.epoch, assignment, self._attempt_request(req))
        out.append(SendToWorker(worker.worker_id, offer))
        out.append(ArmTimer(OfferTimer(assignment), self._now + self.config.offer_timeout_s))

    @staticmethod
    def _attempt_request(req: _Request) -> GenerationRequest:
        """The request as the next attempt should run it: from index k if k tokens are out."""
        if not req.tokens:
            return req.request
        return replace(req.request, output_prefix=tuple(req.tokens))

    def _dispatch_queue(self, out: list[RouterEffect]) -> None:
        """Offer queued requests in FIFO order while their head can be placed."""
        while self._queue:
            req = self._requests[self._queue[0]]
            if not self._fitting_workers(req):
                self._queue.popleft()
                # A resumed stream waiting here has tokens out: for it the loss is final.
                kind: ErrorKind = "worker_lost" if req.delivered else "no_worker"
                self._give_up(req, kind, self._no_worker_message(req), out)
                continue
            worker = self._candidate(req, exclude=None)
            if worker is None:
                return
            self._queue.popleft()
            self._offer(req, worker, "dispatch", out)

    def _attempt_failed(
        self, req: _Request, kind: ErrorKind, message: str, out: list[RouterEffect]
    ) -> None:
        """The active attempt is over (its hold already released): retry or give up."""
        failed_worker = req.worker_id
        req.active = None
        req.worker_id = None
        req.finish = None
        if req.delivered > 0:
            self._resume(req, kind, message, failed_worker, out)
            return
        if req.attempt >= self.config.max_attempts:
            # Nothing reached the client, so no worker was lost *to it*: no worker could serve it.
            self._give_up(
                req, "no_worker", f"{message} (gave up after {req.attempt} attempts)", out
            )
            return
        if not self._fitting_workers(req):
            self._give_up(req, "no_worker", self._no_worker_message(req), out)
            return
        self._retries += 1
        self._place_again(req, failed_worker, out)

    def _resume(
        self,
        req: _Request,
        kind: ErrorKind,
        message: str,
        failed_worker: str | None,
        out: list[RouterEffect],
    ) -> None:
        """A started stream lost its attempt: continue it from the delivered prefix.

        Even with every token delivered (only the Finished went missing) the
        continuation is offered: the new worker ends it at once, with the reason
        (eos or length) that only a decoder can tell.
        """
        if kind == "failed" or req.resumes >= self.config.max_resumes:
            lost: ErrorKind = "failed" if kind == "failed" else "worker_lost"
            self._give_up(req, lost, message, out)
            return
        if not self._fitting_workers(req):
            self._give_up(req, "worker_lost", f"{message}; no worker can continue it", out)
            return
        req.resumes += 1
        self._resumes_total += 1
        self._place_again(req, failed_worker, out)

    def _place_again(
        self, req: _Request, failed_worker: str | None, out: list[RouterEffect]
    ) -> None:
        """Offer the next attempt, preferring another worker, or queue it at the front."""
        worker = self._candidate(req, exclude=failed_worker)
        if worker is None:
            self._move(req, "requeue")
            self._queue.appendleft(req.request.request_id)
        else:
            self._offer(req, worker, "retry", out)

    # --- endings ---

    def _accept(self, req: _Request, out: list[RouterEffect]) -> None:
        assert req.active is not None and req.worker_id is not None
        self._move(req, "accept")
        out.append(DisarmTimer(OfferTimer(req.active)))
        hold = self._workers[req.worker_id].holds.get(req.active)
        if hold is not None:
            hold.confirmed = True

    def _complete(self, req: _Request, finished: Finished, out: list[RouterEffect]) -> None:
        assert finished.reason in ("eos", "length")
        self._release(req, out)
        rid = req.request.request_id
        done = DeliverFinished(rid, finished.reason, finished.completion_tokens)
        self._terminate(req, "finish", done, out)

    def _give_up(
        self, req: _Request, kind: ErrorKind, message: str, out: list[RouterEffect]
    ) -> None:
        rid = req.request.request_id
        self._terminate(req, "give_up", DeliverError(rid, kind, message), out)

    def _terminate(
        self,
        req: _Request,
        how: Input,
        outcome: DeliverFinished | DeliverError,
        out: list[RouterEffect],
    ) -> None:
        self._move(req, how)
        del self._requests[req.request.request_id]
        kind = outcome.reason if isinstance(outcome, DeliverFinished) else outcome.kind
        self._outcomes[kind] += 1
        out.append(outcome)

    def _release(self, req: _Request, out: list[RouterEffect]) -> None:
        """Give back the active attempt's slot (the worker has let it go)."""
        if req.active is None or req.worker_id is None:
            return
        if req.phase is P.OFFERED:
            out.append(DisarmTimer(OfferTimer(req.active)))
        worker = self._workers.get(req.worker_id)
        if worker is not None:
            worker.holds.pop(req.active, None)

    def _drain_active(self, req: _Request, out: list[RouterEffect]) -> None:
        """The router no longer wants the active attempt: cancel it, keep the slot counted."""
        if req.active is None or req.worker_id is None:
            return
        out.append(SendToWorker(req.worker_id, Cancel(req.active)))
        worker = self._workers.get(req.worker_id)
        hold = worker.holds.get(req.active) if worker is not None else None
        if hold is not None:
            hold.draining = True
            if hold.confirmed:
                out.append(DisarmTimer(OfferTimer(req.active)))

    def _move(self, req: _Request, how: Input) -> None:
        nxt = TRANSITIONS.get((req.phase, how))
        if nxt is None:
            raise RouterMisuse(f"no transition from {req.phase.value} on {how}")
        req.phase = nxt

    @staticmethod
    def _no_worker_message(req: _Request) -> str:
        return f"no healthy worker can hold {req.request.context_tokens} context tokens"
