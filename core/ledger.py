"""The router's request ledger: each open request's record, its delivery and its endings.

Part of the router machine's request side (core/requests.py builds on
core/placement.py, which builds on this). A RequestRecord is what the router
knows of one open request: its phase in `states.REQUEST`, its active attempt
and where that is placed, and every token the client has, which is also the
index the fence expects next and the prefix a resume continues from. The
Ledger delivers the next token once the fence has let it through, and makes
the moves that accept an attempt, complete a request, give it up or end it;
a terminal request leaves the ledger at once. Request phases move only in
these three modules, and only through the REQUEST table.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from core.config import RouterConfig
from core.fleet import Fleet
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
    OfferTimer,
    ProgressTimer,
    Resend,
    RouterEffect,
    SendToWorker,
    TokenLogprob,
)
from core.slots import Chain
from core.states import REQUEST, Phase, RequestEvent

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
    # handed the stream off and its attempt, still decoding there (core/requests.py).
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


class Ledger:
    """Open requests by id, what each client has, and the moves that deliver to it and
    end an attempt or a request."""

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

    # --- delivery ---

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

    # --- the attempt a handoff replaces ---

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


def no_worker_message(req: RequestRecord) -> str:
    return f"no healthy worker can hold {req.request.context_tokens} context tokens"
