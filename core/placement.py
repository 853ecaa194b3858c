"""Placing a request's attempts: the queue, the offer, and what follows a lost attempt.

Part of the router machine's request side (core/requests.py extends Placer).
A request is offered to the best candidate (core/slots.py) or waits in a
bounded FIFO queue, drained in order whenever a slot may have come free. A
lost attempt is placed again at once, preferring another worker, or waits at
the queue's head: before its first token as a retry (at most max_attempts in
all), after it as a resume, a continuation from the delivered prefix (at most
max_resumes; a failed finish is not resumed). A decline for want of a slot
spends neither. A handoff's continuation that fails before it is accepted
goes back to the attempt it replaced, if that attempt's worker still holds it.
"""

from __future__ import annotations

from msgspec.structs import replace

from core.ledger import Ledger, RequestRecord, no_worker_message
from core.protocol import (
    ArmTimer,
    Assignment,
    ErrorKind,
    GenerationRequest,
    Offer,
    OfferTimer,
    ProgressTimer,
    RouterEffect,
    SendToWorker,
)
from core.slots import Placement
from core.states import REQUEST, RequestEvent

E = RequestEvent


class Placer(Ledger):
    """Offering attempts: the queue, the candidate, and what follows a lost one."""

    def dispatch_queue(self, out: list[RouterEffect]) -> None:
        """Offer queued requests in FIFO order while their head can be placed."""
        while self.queue:
            req = self.records[self.queue[0]]
            if not self.fleet.fitting(req.request.context_tokens):
                self.queue.popleft()
                # A resumed stream waiting here has tokens out: for it the loss is final.
                kind: ErrorKind = "worker_lost" if req.delivered else "no_worker"
                self._give_up(req, kind, no_worker_message(req), out)
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
            self._give_up(req, "no_worker", no_worker_message(req), out)
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

    # --- a handoff's continuation that failed ---

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


def _attempt_request(req: RequestRecord) -> GenerationRequest:
    """The request as the next attempt should run it: from index k if k tokens are out."""
    if not req.tokens:
        return req.request
    return replace(req.request, output_prefix=tuple(req.tokens))
