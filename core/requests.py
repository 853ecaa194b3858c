"""The router's request side: phases, the fence on worker output, placement, endings.

Part of the router machine (core/router.py dispatches to it from
`Router.handle`); every change of a request's phase happens here, through
`states.REQUEST`. Worker health and slot holds live in core/fleet.py; what a
worker event means for a request (an attempt lost, an acceptance a heartbeat
implies, output to ask for again) comes back here through the RequestSide
methods `lost`, `listed`, `resend` and `dropped`.

The fence: output for a request is acted on only when it names the request's
active assignment, comes from the worker holding it, and (for tokens) carries
the next index the client needs, within the request's budget. Placement: a
request is offered to the best candidate (core/fleet.py), or waits in a
bounded FIFO queue; a lost attempt is offered again at the queue's head,
before its first token as a retry, after it as a resume from the delivered
prefix.

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

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from msgspec.structs import replace

from core.fleet import Chain, Fleet, Placement
from core.protocol import (
    ArmTimer,
    Assignment,
    Cancel,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    DisarmTimer,
    ErrorKind,
    Finished,
    GenerationRequest,
    Offer,
    OfferResult,
    OfferTimer,
    ProgressTimer,
    Resend,
    RouterEffect,
    SendToWorker,
    Token,
    TokenLogprob,
    TokenRun,
)
from core.states import REQUEST, TERMINAL, Hold, Phase, RequestEvent, RouterMisuse

if TYPE_CHECKING:
    from core.router import RouterConfig

P, E = Phase, RequestEvent


@dataclass(slots=True)
class RequestRecord:
    request: GenerationRequest
    phase: Phase = P.RECEIVED
    attempt: int = 0
    active: Assignment | None = None  # set exactly while offered, assigned or streaming
    worker_id: str | None = None
    tokens: list[int] = field(default_factory=list)  # what the client has, for a resume
    resumes: int = 0
    # Attempts declined for want of a slot (other routers' work fills the worker), before
    # and after the first token: they spend neither an attempt nor a resume.
    full_retries: int = 0
    full_resumes: int = 0
    tried: set[str] = field(default_factory=set)
    finish: Finished | None = None  # a finish that arrived before all its tokens
    resend_at: float | None = None  # when the last Resend for it was sent
    progress_by: float | None = None  # the accepted attempt's next token is due by then
    chain: Chain | None = None  # the context's chain keys, for placement (see context())
    # While a handoff's continuation is offered and not yet accepted: the worker that
    # handed the stream off and its attempt, still decoding there (see above).
    handoff: tuple[str, Assignment] | None = None

    def context(self) -> Chain:
        """What the next attempt prefills (prompt, then what the client has)."""
        tokens = len(self.request.prompt_token_ids) + len(self.tokens)
        if self.chain is None or len(self.chain.tokens) != tokens:
            self.chain = Chain(self.request.prompt_token_ids + tuple(self.tokens))
        return self.chain

    @property
    def delivered(self) -> int:
        """Tokens the client has; also the index the fence expects next."""
        return len(self.tokens)


class Requests:
    def __init__(self, config: RouterConfig, fleet: Fleet, fenced: Counter[str]) -> None:
        self.config = config
        self.fleet = fleet
        self.records: dict[str, RequestRecord] = {}
        self.queue: deque[str] = deque()
        self.outcomes: Counter[str] = Counter()
        self.tokens_delivered = 0
        self.resends = 0
        self.retries = 0
        self.resumes = 0
        self.handoffs = 0
        self.handoffs_back = 0
        self.now = 0.0  # the `now` of the event being handled; never read from a clock
        self._fenced = fenced

    # --- client side ---

    def on_submit(self, request: GenerationRequest, out: list[RouterEffect]) -> None:
        if request.request_id in self.records:
            raise RouterMisuse(f"request id {request.request_id!r} is already active")
        req = RequestRecord(request)
        self.records[request.request_id] = req
        if not self.fleet.fitting(request.context_tokens):
            self._give_up(req, "no_worker", _no_worker_message(req), out)
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
        req = self._fence(worker_id, token.assignment)
        if req is not None and self._is_next(req, token.index, token.index + 1, out):
            self._deliver(req, token.token_id, token.logprob, out)

    def on_token_run(self, worker_id: str, run: TokenRun, out: list[RouterEffect]) -> None:
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

    def _deliver(
        self,
        req: RequestRecord,
        token_id: int,
        logprob: TokenLogprob | None,
        out: list[RouterEffect],
    ) -> None:
        """Deliver the next token, with its logprob record if it carries one (the
        caller has checked it is the next one). Records are not kept: a resumed
        attempt computes its own for the tokens it adds."""
        if req.phase is P.OFFERED:
            self._accept(req, out)
        first = req.phase is P.ASSIGNED  # this attempt's first token
        req.phase = REQUEST.next(req.phase, E.TOKEN)
        index = len(req.tokens)
        out.append(DeliverToken(req.request.request_id, index, token_id, logprob))
        req.tokens.append(token_id)
        self.tokens_delivered += 1
        req.progress_by = self.now + self.config.token_timeout_s
        if first and req.active is not None:
            if req.worker_id is not None:
                self.fleet.first_token(req.worker_id, req.active)
            # From now on the (usually shorter) per-token deadline; later tokens only
            # move progress_by, and the timer re-arms itself when it fires early.
            out.append(ArmTimer(ProgressTimer(req.active), req.progress_by))
        if self.fleet.stuck and req.worker_id in self.fleet.stuck:
            self.fleet.progressed(req.worker_id)
        finish = req.finish
        if finish is not None and index + 1 == finish.completion_tokens:
            self._complete(req, finish, out)

    def _ask_resend(self, req: RequestRecord, out: list[RouterEffect]) -> None:
        """Ask the worker for everything from the next expected index (rate-limited)."""
        if req.active is None or req.worker_id is None:
            return
        last = req.resend_at
        if last is not None and self.now - last < self.config.resend_interval_s:
            return
        req.resend_at = self.now
        self.resends += 1
        out.append(SendToWorker(req.worker_id, Resend(req.active, req.delivered)))

    # --- what worker events mean for requests (RequestSide, called by the fleet) ---

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

    # --- placement ---

    def dispatch_queue(self, out: list[RouterEffect]) -> None:
        """Offer queued requests in FIFO order while their head can be placed."""
        while self.queue:
            req = self.records[self.queue[0]]
            if not self.fleet.fitting(req.request.context_tokens):
                self.queue.popleft()
                # A resumed stream waiting here has tokens out: for it the loss is final.
                kind: ErrorKind = "worker_lost" if req.delivered else "no_worker"
                self._give_up(req, kind, _no_worker_message(req), out)
                continue
            placement = self._candidate(req, exclude=None)
            if placement is None:
                return
            self.queue.popleft()
            self._offer(req, placement, out)

    def _candidate(self, req: RequestRecord, exclude: str | None) -> Placement | None:
        return self.fleet.candidate(req.request.context_tokens, req.context(), req.tried, exclude)

    def _offer(self, req: RequestRecord, placement: Placement, out: list[RouterEffect]) -> None:
        worker, prefill = placement
        req.phase = REQUEST.next(req.phase, E.OFFER_SENT)
        req.attempt += 1
        assignment = Assignment(req.request.request_id, req.attempt, self.config.router_id)
        req.active = assignment
        req.worker_id = worker.worker_id
        req.tried.add(worker.worker_id)
        self.fleet.take(worker, assignment, req.request.request_id, prefill)
        offer = Offer(worker.worker_id, worker.epoch, assignment, _attempt_request(req))
        out.append(SendToWorker(worker.worker_id, offer))
        out.append(ArmTimer(OfferTimer(assignment), self.now + self.config.offer_timeout_s))

    def _attempt_lost(
        self,
        req: RequestRecord,
        kind: ErrorKind,
        message: str,
        out: list[RouterEffect],
        *,
        full: bool = False,
    ) -> None:
        """The active attempt is over (its hold already released): place it again or give
        up. `full`: the worker had no free slot, which spends no attempt or resume.
        A handoff's continuation that fails goes back to the attempt handed off."""
        if req.handoff is not None and self._back_to_handoff(req, out):
            return
        failed_worker = req.worker_id
        req.phase = REQUEST.next(req.phase, E.ATTEMPT_LOST)
        self._stop_progress_timer(req, out)
        req.active = None
        req.worker_id = None
        req.finish = None
        if req.delivered > 0:
            self._resume(req, kind, message, failed_worker, out, full)
            return
        req.full_retries += full
        if req.attempt - req.full_retries >= self.config.max_attempts:
            # Nothing reached the client, so no worker was lost *to it*: no worker could serve it.
            self._give_up(
                req, "no_worker", f"{message} (gave up after {req.attempt} attempts)", out
            )
            return
        if not self.fleet.fitting(req.request.context_tokens):
            self._give_up(req, "no_worker", _no_worker_message(req), out)
            return
        self.retries += 1
        self._place_again(req, failed_worker, out)

    def _resume(
        self,
        req: RequestRecord,
        kind: ErrorKind,
        message: str,
        failed_worker: str | None,
        out: list[RouterEffect],
        full: bool = False,
    ) -> None:
        """A started stream lost its attempt: continue it from the delivered prefix.

        Even with every token delivered (only the Finished went missing) the
        continuation is offered: the new worker ends it at once, with the reason
        (eos or length) that only a decoder can tell.
        """
        req.full_resumes += full
        if kind == "failed" or req.resumes - req.full_resumes >= self.config.max_resumes:
            lost: ErrorKind = "failed" if kind == "failed" else "worker_lost"
            self._give_up(req, lost, message, out)
            return
        if not self.fleet.fitting(req.request.context_tokens):
            self._give_up(req, "worker_lost", f"{message}; no worker can continue it", out)
            return
        req.resumes += 1
        self.resumes += 1
        self._place_again(req, failed_worker, out)

    def _place_again(
        self, req: RequestRecord, failed_worker: str | None, out: list[RouterEffect]
    ) -> None:
        """Offer the next attempt, preferring another worker, or queue it at the front."""
        placement = self._candidate(req, exclude=failed_worker)
        if placement is None:
            self.queue.appendleft(req.request.request_id)
        else:
            self._offer(req, placement, out)

    # --- handoff ---

    def _back_to_handoff(self, req: RequestRecord, out: list[RouterEffect]) -> bool:
        """The continuation failed before it was accepted (its hold already released):
        back to the attempt handed off, if its worker still holds it."""
        assert req.handoff is not None
        worker_id, assignment = req.handoff
        req.handoff = None
        if not self.fleet.holds_live(worker_id, assignment):
            return False
        req.phase = REQUEST.next(req.phase, E.HANDOFF_FAILED)
        self._stop_progress_timer(req, out)
        req.active, req.worker_id, req.finish = assignment, worker_id, None
        req.progress_by = self.now + self.config.token_timeout_s
        out.append(ArmTimer(ProgressTimer(assignment), req.progress_by))
        req.resend_at = None  # what it decoded meanwhile was fenced: ask for it now
        self._ask_resend(req, out)
        self.handoffs_back += 1
        return True

    def _let_go(self, req: RequestRecord) -> None:
        """The worker no longer holds the attempt handed off: free its slot."""
        if req.handoff is not None:
            worker_id, assignment = req.handoff
            req.handoff = None
            self.fleet.release(worker_id, assignment)

    def _cancel_handed_off(self, req: RequestRecord, out: list[RouterEffect]) -> None:
        """The continuation is accepted (or the request is over): stop the old attempt;
        its slot stays counted until the worker lets go."""
        if req.handoff is not None:
            worker_id, assignment = req.handoff
            req.handoff = None
            out.append(SendToWorker(worker_id, Cancel(assignment)))
            self.fleet.unwanted(worker_id, assignment)

    # --- endings ---

    def _accept(self, req: RequestRecord, out: list[RouterEffect]) -> None:
        assert req.active is not None and req.worker_id is not None
        req.phase = REQUEST.next(req.phase, E.ACCEPTED)
        out.append(DisarmTimer(OfferTimer(req.active)))
        self.fleet.confirm(req.worker_id, req.active)
        self._cancel_handed_off(req, out)
        # The first token's deadline: prefill of everything before it, then one step.
        config = self.config
        context = len(req.request.prompt_token_ids) + req.delivered
        budget = config.first_token_timeout_s + context * config.prefill_timeout_per_token_s
        req.progress_by = self.now + budget
        out.append(ArmTimer(ProgressTimer(req.active), req.progress_by))

    def _stop_progress_timer(self, req: RequestRecord, out: list[RouterEffect]) -> None:
        if req.progress_by is not None and req.active is not None:
            out.append(DisarmTimer(ProgressTimer(req.active)))
        req.progress_by = None

    def _complete(self, req: RequestRecord, finished: Finished, out: list[RouterEffect]) -> None:
        assert finished.reason in ("eos", "length")
        self._release(req, out)
        rid = req.request.request_id
        done = DeliverFinished(rid, finished.reason, finished.completion_tokens)
        self._terminate(req, E.FINISHED, done, out)

    def _give_up(
        self, req: RequestRecord, kind: ErrorKind, message: str, out: list[RouterEffect]
    ) -> None:
        rid = req.request.request_id
        self._terminate(req, E.GIVEN_UP, DeliverError(rid, kind, message), out)

    def _terminate(
        self,
        req: RequestRecord,
        event: RequestEvent,
        outcome: DeliverFinished | DeliverError,
        out: list[RouterEffect],
    ) -> None:
        req.phase = REQUEST.next(req.phase, event)
        self._stop_progress_timer(req, out)
        self._cancel_handed_off(req, out)
        del self.records[req.request.request_id]
        kind = outcome.reason if isinstance(outcome, DeliverFinished) else outcome.kind
        self.outcomes[kind] += 1
        out.append(outcome)

    def _release(self, req: RequestRecord, out: list[RouterEffect]) -> None:
        """Give back the active attempt's slot (the worker has let it go)."""
        if req.active is None or req.worker_id is None:
            return
        if req.phase is P.OFFERED:
            out.append(DisarmTimer(OfferTimer(req.active)))
        self.fleet.release(req.worker_id, req.active)


def _attempt_request(req: RequestRecord) -> GenerationRequest:
    """The request as the next attempt should run it: from index k if k tokens are out."""
    if not req.tokens:
        return req.request
    return replace(req.request, output_prefix=tuple(req.tokens))


def _no_worker_message(req: RequestRecord) -> str:
    return f"no healthy worker can hold {req.request.context_tokens} context tokens"
