"""The router's request side: what clients and workers send about requests, fenced.

Part of the router machine (core/router.py dispatches to it from
`Router.handle`). Requests builds on Placer (core/placement.py: the queue,
offers, retries and resumes), which builds on Ledger (core/ledger.py: each
request's record, delivery and endings); every change of a request's phase
happens in those three modules, through `states.REQUEST`. Worker health and
slot holds live in core/fleet.py and core/slots.py; what a worker event means
for a request (an attempt lost, an acceptance a heartbeat implies, output to
ask for again) comes back here as AttemptNews, which `act` hands to `lost`,
`listed`, `resend` and `dropped`.

The fence: output for a request is acted on only when it names the request's
active assignment, comes from the worker holding it, and (for tokens) carries
the next index the client needs, within the request's budget.

Handoff: a draining worker gives a streaming request's attempt back
(HandOff). If another worker has a slot, the request goes on there at once,
from its delivered index, as a new attempt that is active from its offer:
the fence accepts only that attempt's tokens from then on, so the two
workers' outputs can never both reach the client. The old attempt is not
cancelled yet; the draining worker keeps decoding it (its tokens are fenced
as stale) and its slot stays counted, so that if the continuation fails
before it is accepted (declined, its offer timed out, its worker lost) the
request returns to the old attempt and asks it again (Resend) for what it
produced meanwhile. Once the continuation is accepted, the old attempt is
cancelled and drains like any unwanted one. A handoff spends no retry or
resume; when no other worker can take the stream it stays where it is, and
the next HandOff (the worker repeats it with each heartbeat) tries again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import assert_never

from core.fleet import AttemptNews
from core.ledger import RequestRecord, no_worker_message
from core.placement import Placer
from core.protocol import (
    ArmTimer,
    Assignment,
    Cancel,
    DeliverError,
    DisarmTimer,
    Finished,
    GenerationRequest,
    OfferResult,
    OfferTimer,
    ProgressTimer,
    RouterEffect,
    SendToWorker,
    Token,
    TokenRun,
)
from core.states import REQUEST, TERMINAL, Hold, Phase, RequestEvent, RouterMisuse

P, E = Phase, RequestEvent


class Requests(Placer):
    """The request side's entry points: what clients send, and worker output, fenced."""

    # --- client side ---

    def on_submit(self, request: GenerationRequest, out: list[RouterEffect]) -> None:
        if request.request_id in self.records:
            raise RouterMisuse(f"request id {request.request_id!r} is already active")
        req = RequestRecord(request)
        self.records[request.request_id] = req
        if not self.fleet.fitting(request.context_tokens):
            self._give_up(req, "no_worker", no_worker_message(req), out)
        elif not self.queue and (placement := self._candidate(req, exclude=None)) is not None:
            self._offer(req, placement, out)
        elif len(self.queue) >= self.config.queue_limit:
            self._give_up(req, "overloaded", "all workers are busy and the queue is full", out)
        else:
            self.queue.append(request.request_id)

    def on_client_cancel(self, request_id: str, out: list[RouterEffect]) -> None:
        req = self.records.get(request_id)
        if req is None:
            return  # already terminal: a late cancel is normal and harmless
        if req.phase is P.RECEIVED:
            self.queue.remove(request_id)
        elif req.active is not None and req.worker_id is not None:
            # Cancel it, but keep its slot counted until the worker lets go.
            out.append(SendToWorker(req.worker_id, Cancel(req.active)))
            if self.fleet.unwanted(req.worker_id, req.active) is Hold.DRAINING:
                out.append(DisarmTimer(OfferTimer(req.active)))  # confirmed: no offer timer
        cancelled = DeliverError(request_id, "cancelled", "cancelled by the client")
        self._terminate(req, E.CLIENT_CANCEL, cancelled, out)

    # --- worker output ---

    def on_token(self, worker_id: str, token: Token, out: list[RouterEffect]) -> None:
        if token.taken_after is not None:  # its first token: maybe the first news of it
            self.fleet.taken_after(worker_id, token.assignment, token.taken_after)
        req = self._fence(worker_id, token.assignment)
        if req is not None and self._is_next(req, token.index, token.index + 1, out):
            self._deliver(req, token.token_id, token.logprob, out)

    def on_token_run(self, worker_id: str, run: TokenRun, out: list[RouterEffect]) -> None:
        if run.taken_after is not None:  # from the attempt's first token: as on_token
            self.fleet.taken_after(worker_id, run.assignment, run.taken_after)
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
            at = index - run.start_index
            self._deliver(req, run.token_ids[at], run.logprobs[at] if run.logprobs else None, out)

    def on_handoff(
        self, worker_id: str, assignments: tuple[Assignment, ...], out: list[RouterEffect]
    ) -> None:
        """A draining worker gives these attempts back: continue each elsewhere (above)."""
        for assignment in assignments:
            req = self.records.get(assignment.request_id)
            if req is None or req.active != assignment or req.worker_id != worker_id:
                continue  # over, or handed off already: a repeated HandOff is no news
            if req.phase is not P.STREAMING:
                continue  # before its first token: handed off once it streams
            placement = self._candidate(req, exclude=worker_id)
            if placement is None:
                continue  # nobody else can take it now: it goes on here
            self._stop_progress_timer(req, out)
            req.phase = REQUEST.next(req.phase, E.HANDED_OFF)
            req.handoff = (worker_id, assignment)
            req.finish = None
            self.handoffs += 1
            self._offer(req, placement, out)

    def on_finished(self, worker_id: str, finished: Finished, out: list[RouterEffect]) -> None:
        req = self.records.get(finished.assignment.request_id)
        if req is not None and req.handoff == (worker_id, finished.assignment):
            self._let_go(req)  # the attempt handed off ended there: nothing to go back to
            return
        req = self._fence(worker_id, finished.assignment)
        if req is None:
            self.fleet.settle_unwanted(worker_id, finished.assignment, released=True, out=out)
            return
        if finished.reason in ("failed", "cancelled"):
            # The worker gave up on its own (we cancel only what we no longer track).
            self._release(req, out)
            self._attempt_lost(req, "failed", f"worker {worker_id} {finished.reason}", out)
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

    def on_offer_result(self, worker_id: str, result: OfferResult, out: list[RouterEffect]) -> None:
        if result.accepted:
            self.fleet.taken_after(worker_id, result.assignment, result.seq)
        req = self.records.get(result.assignment.request_id)
        if req is not None and req.handoff == (worker_id, result.assignment):
            return  # a late answer for the attempt handed off, which runs there still
        req = self._fence(worker_id, result.assignment)
        if req is None:
            released = not result.accepted
            self.fleet.settle_unwanted(worker_id, result.assignment, released, out)
            return
        if req.phase is not P.OFFERED:
            self._fenced["duplicate_result"] += 1
            return
        if result.accepted:
            self._accept(req, out)
            return
        self._release(req, out)
        # A full worker: with routers sharing workers, that is other routers' work, not
        # a fault. No offers there until its next heartbeat, and the request is placed
        # again without spending an attempt.
        full = result.reason == "no_slot"
        if full:
            self.fleet.full(worker_id, result.epoch)
        self._attempt_lost(req, "no_worker", f"declined: {result.reason}", out, full=full)

    def on_offer_timeout(self, assignment: Assignment, out: list[RouterEffect]) -> None:
        req = self.records.get(assignment.request_id)
        if req is not None and req.active == assignment and req.phase is P.OFFERED:
            # Cancel in case the offer was only slow: a late offer is then declined.
            assert req.worker_id is not None
            out.append(SendToWorker(req.worker_id, Cancel(assignment)))
            self._release(req, out)
            self._attempt_lost(req, "no_worker", "offer timed out", out)
            return
        # A request cancelled while offered keeps its hold until the offer expires.
        self.fleet.expire_draining_offer(assignment)

    def on_progress_timeout(self, assignment: Assignment, out: list[RouterEffect]) -> None:
        """An accepted attempt's deadline: if it made no progress, fail it over."""
        req = self.records.get(assignment.request_id)
        if req is None or req.active != assignment or req.progress_by is None:
            return  # over already (its timer is disarmed then; this one was in flight)
        if self.now < req.progress_by:  # tokens came meanwhile: wait for the next one
            out.append(ArmTimer(ProgressTimer(assignment), req.progress_by))
            return
        worker_id = req.worker_id
        assert worker_id is not None
        # Its decoder is hung or hopelessly slow. Stop it; its slot stays counted
        # (draining) until the worker lets go, and the worker gets no offers for now.
        out.append(SendToWorker(worker_id, Cancel(assignment)))
        self.fleet.unwanted(worker_id, assignment)
        self.fleet.progress_missed(worker_id)
        req.progress_by = None
        what = "its first token" if not req.tokens else f"token {req.delivered}"
        message = f"worker {worker_id} made no progress ({what} overdue)"
        self._attempt_lost(req, "worker_lost", message, out)

    def _fence(self, worker_id: str, assignment: Assignment) -> RequestRecord | None:
        """The request this worker message may act on, or None (counted) if fenced."""
        req = self.records.get(assignment.request_id)
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

    def _is_next(self, req: RequestRecord, start: int, end: int, out: list[RouterEffect]) -> bool:
        """The fence for output: does [start, end) contain the next index, within budget?"""
        delivered = len(req.tokens)
        if end <= delivered:
            self._fenced["duplicate"] += 1
            return False
        if start > delivered:
            self._fenced["gap"] += 1  # dropped; everything from the gap on is asked again
            self._ask_resend(req, out)
            return False
        if delivered >= req.request.max_new_tokens:
            self._fenced["over_budget"] += 1
            return False
        return True

    # --- what worker events mean for requests (AttemptNews, from the fleet) ---

    def act(self, news: Iterable[AttemptNews], out: list[RouterEffect]) -> None:
        """Act on what a worker event means for each attempt, item by item as the fleet
        tells it (the fleet goes on after each, so the effects keep the event's order)."""
        for item in news:
            match item.kind:
                case "lost":
                    self.lost(item.request_id, item.assignment, item.message, out)
                case "listed":
                    self.listed(item.request_id, item.assignment, out)
                case "resend":
                    self.resend(item.request_id, item.assignment, out)
                case "dropped":
                    self.dropped(item.request_id, item.assignment, out)
                case _ as unknown:
                    assert_never(unknown)

    def lost(
        self, request_id: str, assignment: Assignment, message: str, out: list[RouterEffect]
    ) -> None:
        """The worker holding this attempt is lost (its hold is already gone)."""
        req = self.records[request_id]
        if req.active != assignment:  # a handed-off attempt: nothing to go back to now
            req.handoff = None
            return
        if req.phase is P.OFFERED:
            out.append(DisarmTimer(OfferTimer(assignment)))
        self._attempt_lost(req, "worker_lost", message, out)

    def listed(self, request_id: str, assignment: Assignment, out: list[RouterEffect]) -> None:
        """A heartbeat lists the attempt: it runs, whether or not its answer arrived."""
        req = self.records[request_id]
        if req.phase is P.OFFERED and req.active == assignment:
            self._accept(req, out)

    def resend(self, request_id: str, assignment: Assignment, out: list[RouterEffect]) -> None:
        """The worker no longer lists the attempt: its last output is in flight or lost."""
        req = self.records[request_id]
        if req.active != assignment:  # the attempt handed off ended there
            self._let_go(req)
            return
        self._ask_resend(req, out)

    def dropped(self, request_id: str, assignment: Assignment, out: list[RouterEffect]) -> None:
        """The attempt stayed missing from the worker's heartbeats: it is lost."""
        req = self.records[request_id]
        if req.active != assignment:  # the attempt handed off is gone there
            self._let_go(req)
            return
        self._release(req, out)
        self._attempt_lost(req, "worker_lost", "worker dropped the assignment", out)
