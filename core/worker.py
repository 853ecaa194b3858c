"""The worker machine: what one worker process decides, sans-IO.

One Worker fronts one decoder. It answers the router's offers (its own
admission check), tells the decoder what to start and stop, fences the
decoder's output, and heartbeats its epoch, capacity and held assignments.

Theory of operation
-------------------
Each assignment the worker hears of is in one state of `states.ASSIGNMENT`
(unseen, forestalled, declined, active, ended), derived from what the worker keeps (its
active table and its bounded table of answers) and changed only through
`_move`, which checks the table. An active assignment ends exactly once: the
decoder finishes it, the router cancels it or supersedes it with a newer
attempt, or the decoder breaks. Each of those ends it through `_end`, the one
place a slot is given back, so a slot is freed once whatever order cancel,
finish and failure arrive in.

Offers are answered idempotently: the answer to each assignment is remembered
(in a bounded table), and a duplicate offer gets the same answer again rather
than a second slot. An offer for another worker id or another epoch (it was
meant for this worker before a restart) is declined. A Cancel that overtakes
its Offer leaves the assignment forestalled, so the Offer, when it lands, is
declined; that landing is the offer's first, counted apart from a true
duplicate (`offer_after_cancel`): a link that reorders its own messages, or a
client that cancels while the offer is on its way, is enough to cause it,
whereas a second copy of one offer needs the network to deliver it twice.

Decoder output passes the same fence as at the router: a token goes out only
if it names an active assignment and carries the next index; anything else
(late output after a cancel, a repeated index, a token past the budget) is
dropped and counted. A skipped index is worse than noise: the token at the
index skipped never reaches anyone, so the assignment is stopped and ends
as failed rather than finishing short.

Several routers
---------------
A worker may serve several routers at once, one link each (`_links`): each
router hands out its own epoch for the worker at registration (RouterLinked)
and sees its own heartbeats, with its own epoch, sequence numbers and its own
assignments listed, and the free slots of the whole worker. Offers from
different routers compete for the same slots: the worker accepts while it
has one free and declines (no_slot) otherwise, so no router needs to know
what the others hold. A router's messages are fenced to its own assignments
(an assignment names its router), and losing a link (RouterUnlinked, or a
new registration with that router) ends that router's assignments only;
nothing is sent for them, as nobody is left to receive it.

Draining
--------
Drain stops the worker taking offers (its heartbeats report no slots). With
handoff (the default) it also tells each router, in a HandOff sent with
every heartbeat, which of that router's assignments it still holds: the
router continues each elsewhere and cancels it here once the continuation is
accepted, and the process exits when nothing is left. Until a Cancel comes
the worker decodes on as before, so a stream nobody else can take keeps
running here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import KeysView, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from msgspec import Struct

from core.protocol import (
    ArmTimer,
    Assignment,
    CacheReport,
    Cancel,
    DeclineReason,
    Decoded,
    DecodeDone,
    DecoderFailed,
    Drain,
    Finished,
    FinishReason,
    FromRouterMessage,
    HandOff,
    Heartbeat,
    HeartbeatTimer,
    Offer,
    OfferResult,
    Resend,
    RouterLinked,
    RouterUnlinked,
    SendToRouter,
    StartDecode,
    StopDecode,
    TimerFired,
    Token,
    TokenLogprob,
    TokenRun,
    ToWorker,
    WorkerEffect,
    WorkerEvent,
    WorkerStart,
)
from core.states import ASSIGNMENT, AssignmentEvent, AssignmentState, WorkerMisuse

__all__ = ["Worker", "WorkerConfig", "WorkerMisuse", "WorkerStatistics"]

S, E = AssignmentState, AssignmentEvent


class WorkerConfig(Struct, frozen=True):
    """`router` is the router linked from the start, at `epoch` ("" for a lone router
    that leaves its assignments unnamed); None starts with no link: routers join
    with RouterLinked."""

    worker_id: str
    epoch: int = 0
    router: str | None = ""
    slots: int = 8
    max_context: int = 2048
    heartbeat_interval_s: float = 0.5
    remembered_answers: int = 4096  # bound on the duplicate-offer table
    retained_outputs: int = 256  # finished outputs kept to answer Resend


class WorkerStatistics(Struct, frozen=True):
    worker_id: str
    epoch: int  # the first link's (config.epoch when it has none)
    slots: int
    active: int
    accepted: int
    declined: dict[str, int]
    fenced: dict[str, int]
    tokens_sent: int
    routers: dict[str, int] = {}  # router id -> the epoch its link serves under


@dataclass(slots=True)
class _Link:
    """One router's link: the epoch it handed out, and the heartbeats sent on it."""

    epoch: int
    seq: int = 0


@dataclass(slots=True)
class _Active:
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # everything sent, for Resend
    # The logprob records sent with tokens[first:], for Resend, when the request asks
    # (a continuation's prefix came with the offer, without its records).
    records: list[TokenLogprob] | None = None
    first: int = 0
    taken_after: int = 0  # the link's heartbeat seq when it was taken (OfferResult.seq)

    def run_from(self, assignment: Assignment, from_index: int) -> TokenRun | None:
        """The tokens from `from_index` on (with their records), or None if none."""
        start = from_index if self.records is None else max(from_index, self.first)
        if start >= len(self.tokens):
            return None
        records = () if self.records is None else tuple(self.records[start - self.first :])
        after = self.taken_after if start == self.first else None
        return TokenRun(assignment, start, tuple(self.tokens[start:]), records, after)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._active: dict[Assignment, _Active] = {}
        # The answer to every assignment seen, bounded; None: forestalled, no offer yet.
        self._answers: OrderedDict[Assignment, OfferResult | None] = OrderedDict()
        self._retained: OrderedDict[Assignment, tuple[_Active, Finished]] = OrderedDict()
        self._links: dict[str, _Link] = {}
        if config.router is not None:
            self._links[config.router] = _Link(config.epoch)
        self._fenced: Counter[str] = Counter()
        self._declined: Counter[str] = Counter()
        self._accepted = 0
        self._tokens_sent = 0
        self.draining = False
        self.handing_off = False  # draining, and giving the active assignments back
        self.cache: CacheReport | None = None  # the decoder's latest, sent with heartbeats

    @property
    def free_slots(self) -> int:
        return self.config.slots - len(self._active)

    def handle(self, event: WorkerEvent, now: float) -> list[WorkerEffect]:
        out: list[WorkerEffect] = []
        match event:
            case Decoded(assignment, index, token_id, logprob):
                self._on_decoded(assignment, index, token_id, logprob, out)
            case DecodeDone(assignment, reason):
                if assignment in self._active:
                    self._end(assignment, reason, E.DECODE_DONE, out)
                else:
                    self._fenced["late_finish"] += 1
            case FromRouterMessage(message, router):
                self._from_router(message, router, out)
            case TimerFired(HeartbeatTimer()) | WorkerStart():
                self._heartbeats(out)
                deadline = now + self.config.heartbeat_interval_s
                out.append(ArmTimer(HeartbeatTimer(), deadline))
            case Drain(handoff):
                # Offer no capacity from now on; the heartbeat tells the router. With
                # handoff, each router is also given back its assignments (again with
                # every heartbeat, for those it has not taken yet).
                self.draining = True
                self.handing_off = handoff
                self._heartbeats(out)
            case RouterLinked(router, epoch):
                if router in self._links:  # re-registered: the router let the old link go
                    self._unlink(router, out)
                self._links[router] = link = _Link(epoch)
                out.append(SendToRouter(self._heartbeat(router, link), router))
            case RouterUnlinked(router):
                if router in self._links:
                    self._unlink(router, out)
            case DecoderFailed():
                for assignment in list(self._active):
                    self._end(assignment, "failed", E.DECODER_FAILED, out)
            case _:
                raise WorkerMisuse(f"worker cannot handle {event!r}")
        return out

    def state_of(self, assignment: Assignment) -> AssignmentState:
        """Where the assignment stands, from what the worker keeps about it."""
        if assignment in self._active:
            return S.ACTIVE
        if assignment not in self._answers:
            return S.UNSEEN  # never seen, or its answer has left the bounded table
        answer = self._answers[assignment]
        if answer is None:
            return S.FORESTALLED
        return S.ENDED if answer.accepted else S.DECLINED

    def links(self) -> dict[str, int]:
        """router id -> the epoch this worker serves that router under."""
        return {router: link.epoch for router, link in self._links.items()}

    def holds(self) -> KeysView[Assignment]:
        """The assignments that occupy a slot right now (a live, read-only view)."""
        return self._active.keys()

    def fence_counts(self) -> Mapping[str, int]:
        """Messages fenced so far, by reason (a live, read-only view: cheap to poll)."""
        return MappingProxyType(self._fenced)

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(
            worker_id=self.config.worker_id,
            epoch=next(iter(self._links.values())).epoch if self._links else self.config.epoch,
            slots=self.config.slots,
            active=len(self._active),
            accepted=self._accepted,
            declined=dict(self._declined),
            fenced=dict(self._fenced),
            tokens_sent=self._tokens_sent,
            routers=self.links(),
        )

    def _from_router(self, message: ToWorker, router: str, out: list[WorkerEffect]) -> None:
        link = self._links.get(router)
        if link is None:
            self._fenced["unlinked"] += 1  # a frame that outlived its link
            return
        if message.assignment.router != router:
            # Each router acts on its own assignments only: one naming another
            # router's is a bug or an impostor, and must not touch that router's work.
            self._fenced["foreign_assignment"] += 1
            if isinstance(message, Offer):  # answered, never remembered: not ours to decide
                self._declined["wrong_router"] += 1
                config = self.config
                answer = OfferResult(
                    config.worker_id, link.epoch, message.assignment, False, "wrong_router"
                )
                out.append(SendToRouter(answer, router))
            return
        match message:
            case Offer() as offer:
                self._on_offer(offer, link, out)
            case Cancel(assignment):
                self._on_cancel(assignment, link, out)
            case Resend(assignment, from_index):
                self._on_resend(assignment, from_index, out)

    def _unlink(self, router: str, out: list[WorkerEffect]) -> None:
        """The router's link is gone: its assignments end, with nothing sent, and what
        was kept to answer it again goes (a frame of the old link that arrives on a new
        one is judged afresh: an offer of the old epoch is declined as stale)."""
        del self._links[router]
        for assignment in [a for a in self._active if a.router == router]:
            self._end(assignment, "cancelled", E.ROUTER_LOST, out, tell=False)
        for kept in (self._answers, self._retained):
            for assignment in [a for a in kept if a.router == router]:
                del kept[assignment]

    def _on_decoded(
        self,
        assignment: Assignment,
        index: int,
        token_id: int,
        logprob: TokenLogprob | None,
        out: list[WorkerEffect],
    ) -> None:
        active = self._active.get(assignment)
        if active is None:
            self._fenced["late_token"] += 1
        elif index < len(active.tokens):
            self._fenced["duplicate"] += 1  # said again: the client has it already
        elif index > len(active.tokens):
            # The decoder skipped an index: that token is lost to the client for good, so
            # this output can never be completed truthfully. Stop it and report it failed.
            self._fenced["gap"] += 1
            self._end(assignment, "failed", E.DECODER_SKIPPED, out)
        elif index >= active.max_new_tokens:
            self._fenced["over_budget"] += 1
        else:  # (active, decoded) -> active: the table's one self-loop, not looked up per token
            if active.records is not None:
                if logprob is None:  # the decoder broke its contract: the record is lost
                    self._fenced["missing_logprob"] += 1
                    self._end(assignment, "failed", E.DECODER_SKIPPED, out)
                    return
                active.records.append(logprob)
            active.tokens.append(token_id)
            self._tokens_sent += 1
            after = active.taken_after if index == active.first else None
            token = Token(assignment, index, token_id, logprob, after)
            out.append(SendToRouter(token, assignment.router))

    def _on_resend(self, assignment: Assignment, from_index: int, out: list[WorkerEffect]) -> None:
        active = self._active.get(assignment)
        finished: Finished | None = None
        if active is None and (kept := self._retained.get(assignment)) is not None:
            active, finished = kept
        if active is None:
            self._fenced["resend_unknown"] += 1
            return
        run = active.run_from(assignment, from_index)
        if run is not None:
            out.append(SendToRouter(run, assignment.router))
        if finished is not None:
            out.append(SendToRouter(finished, assignment.router))

    def _on_offer(self, offer: Offer, link: _Link, out: list[WorkerEffect]) -> None:
        assignment = offer.assignment
        state = self.state_of(assignment)
        answer = self._answers.get(assignment)
        if state is S.FORESTALLED:
            # The offer's first landing, after its cancel: declined, not a duplicate.
            self._fenced["offer_after_cancel"] += 1
            answer = self._decline(assignment, "cancelled", link)
            self._remember(assignment, answer)
        elif answer is None and state is S.ACTIVE:
            # Still running, its answer long out of the bounded table: the same answer.
            self._fenced["duplicate_offer"] += 1
            answer = OfferResult(self.config.worker_id, link.epoch, assignment, True, seq=link.seq)
        elif answer is None:
            answer = self._decide(offer, link, out)
            self._remember(assignment, answer)
        else:
            self._fenced["duplicate_offer"] += 1
        out.append(SendToRouter(answer, assignment.router))

    def _decide(self, offer: Offer, link: _Link, out: list[WorkerEffect]) -> OfferResult:
        """Admission for a first-seen offer; starts decoding when accepted."""
        if offer.worker_id != self.config.worker_id:
            return self._decline(offer.assignment, "wrong_worker", link)
        if offer.epoch != link.epoch:
            return self._decline(offer.assignment, "stale_epoch", link)
        current = self._attempt_of(offer.assignment)
        if current is not None:
            if current.attempt > offer.assignment.attempt:
                return self._decline(offer.assignment, "stale_attempt", link)
            # The router moved on to a newer attempt here: the old one is dead.
            self._end(current, "cancelled", E.SUPERSEDED, out)
        if self.free_slots <= 0 or self.draining:
            return self._decline(offer.assignment, "no_slot", link)
        if offer.request.context_tokens > self.config.max_context:
            return self._decline(offer.assignment, "context_length", link)
        self._move(offer.assignment, E.OFFER_ADMITTED)
        # A continuation's output so far counts as sent: its next index is k.
        request = offer.request
        prefix = list(request.output_prefix)
        records: list[TokenLogprob] | None = None if request.logprobs is None else []
        self._active[offer.assignment] = _Active(
            request.max_new_tokens, prefix, records, len(prefix), link.seq
        )
        self._accepted += 1
        out.append(StartDecode(offer.assignment, offer.request))
        return OfferResult(self.config.worker_id, link.epoch, offer.assignment, True, seq=link.seq)

    def _on_cancel(self, assignment: Assignment, link: _Link, out: list[WorkerEffect]) -> None:
        state = self.state_of(assignment)
        if state is S.ACTIVE:
            self._end(assignment, "cancelled", E.CANCEL, out)
        elif state is S.UNSEEN:
            # The cancel overtook its offer: make sure the offer is declined when it lands.
            self._move(assignment, E.CANCEL)
            self._remember(assignment, None)
        else:
            self._fenced["late_cancel"] += 1

    def _end(
        self,
        assignment: Assignment,
        reason: FinishReason,
        event: AssignmentEvent,
        out: list[WorkerEffect],
        *,
        tell: bool = True,
    ) -> None:
        """The one place an active assignment ends and its slot is freed (`tell`: the
        router hears of it, unless its link is gone)."""
        self._move(assignment, event)
        active = self._active.pop(assignment)
        if reason == "cancelled" or event is E.DECODER_SKIPPED:
            out.append(StopDecode(assignment))  # otherwise the decoder has already stopped
        if not tell:
            return
        finished = Finished(assignment, reason, len(active.tokens))
        out.append(SendToRouter(finished, assignment.router))
        if reason in ("eos", "length"):
            self._retained[assignment] = (active, finished)
            while len(self._retained) > self.config.retained_outputs:
                self._retained.popitem(last=False)

    def _decline(self, assignment: Assignment, reason: DeclineReason, link: _Link) -> OfferResult:
        self._move(assignment, E.OFFER_REFUSED)
        self._declined[reason] += 1
        return OfferResult(self.config.worker_id, link.epoch, assignment, False, reason)

    def _move(self, assignment: Assignment, event: AssignmentEvent) -> AssignmentState:
        """Check a change against the table before the caller makes it (raises if illegal)."""
        return ASSIGNMENT.next(self.state_of(assignment), event)

    def _remember(self, assignment: Assignment, answer: OfferResult | None) -> None:
        self._answers[assignment] = answer
        while len(self._answers) > self.config.remembered_answers:
            self._answers.popitem(last=False)

    def _attempt_of(self, offered: Assignment) -> Assignment | None:
        """The attempt of the same request of the same router that runs here, if any
        (another router's request of the same id is another request)."""
        for assignment in self._active:
            if assignment.request_id == offered.request_id and assignment.router == offered.router:
                return assignment
        return None

    def _heartbeats(self, out: list[WorkerEffect]) -> None:
        for router, link in self._links.items():
            out.append(SendToRouter(self._heartbeat(router, link), router))
            if self.handing_off:
                held = tuple(a for a in self._active if a.router == router)
                if held:
                    handoff = HandOff(self.config.worker_id, link.epoch, held)
                    out.append(SendToRouter(handoff, router))

    def _heartbeat(self, router: str, link: _Link) -> Heartbeat:
        """This router's heartbeat: its epoch and sequence, its own assignments, and
        the free slots of the whole worker (what any router's offer competes for)."""
        link.seq += 1
        return Heartbeat(
            worker_id=self.config.worker_id,
            epoch=link.epoch,
            seq=link.seq,
            slots=0 if self.draining else self.config.slots,
            free_slots=0 if self.draining else self.free_slots,
            max_context=self.config.max_context,
            active=tuple(a for a in self._active if a.router == router),
            cache=self.cache,
        )
