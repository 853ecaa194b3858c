"""The router machine's entry point: one `handle` over the request side and the fleet.

One Router spreads GenerationRequests over workers and turns their fenced
output into an in-order stream per client. It is sans-IO: `handle(event, now)`
returns effects (messages to send, timers to arm, deliveries to clients) and
never reads a clock, draws a random number or touches the network. Its state
is requests (core/requests.py, over core/placement.py and core/ledger.py) and
workers with their slot holds (core/fleet.py, over core/slots.py); each moves
only through its table in core/states.py. The config is core/config.py's.

Theory of operation
-------------------
A request moves through the phases of `states.REQUEST`. Each attempt to serve
it gets a fresh Assignment(request_id, attempt). The router accepts worker
output for a request only when it names the request's active assignment and,
for tokens, carries index == tokens already delivered. Anything else (a
duplicate, a gap, a reordered or stale message, anything after a terminal
outcome) is dropped and counted in statistics(). When an attempt is lost
(decline, offer timeout, worker loss, failed finish) the request goes back to
`received` and is placed again: before its first token that is a plain retry
on another worker; after it, a *resume*: the router knows exactly which
tokens the client has (it delivered them), so it offers a continuation, the
same request with those tokens as `output_prefix`, as a new attempt; the new
worker generates from index k, the fence expects index k, and the client's
stream simply goes on. Retries are bounded by `max_attempts`, resumes by
`max_resumes` (0 restores the plain contract: a started stream that loses its
worker ends with `worker_lost`). A failed finish (the decoder broke on this
request) is not resumed.

Slots: the router counts, per worker, the assignments it believes the worker
holds (core/slots.py). Heartbeats list the worker's assignments; the router
reconciles its holds with them and answers any it does not want with Cancel,
so slots leak neither on the worker nor in the router even when messages are
duplicated, reordered or dropped.

Errors split by fault: anything from the network is expected to be wrong at
times and is fenced; a call our own code should never make (submitting the
same request id twice, a move no table has) raises RouterMisuse.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from itertools import islice
from types import MappingProxyType
from typing import Literal

from msgspec import Struct, structs

from core.config import RouterConfig
from core.fleet import Fleet, WorkerView
from core.protocol import (
    Assignment,
    ClientCancel,
    Finished,
    FromWorkerMessage,
    HandOff,
    Heartbeat,
    LivenessTimer,
    OfferResult,
    OfferTimer,
    ProgressTimer,
    RegisterWorker,
    RouterEffect,
    RouterEvent,
    Submit,
    TimerFired,
    Token,
    TokenRun,
    WorkerGone,
)
from core.requests import Requests
from core.states import Phase, RouterMisuse

__all__ = [
    "RequestView",
    "Router",
    "RouterMisuse",
    "RouterStatistics",
    "WorkerView",
]

FenceReason = Literal[
    "late",  # names a request that is terminal or unknown
    "stale_attempt",  # names an attempt other than the active one
    "wrong_worker",  # came from a worker that does not hold the assignment
    "duplicate",  # token index already delivered
    "gap",  # token index beyond the next expected one
    "over_budget",  # token index at or past max_new_tokens, or a bad count
    "duplicate_result",  # offer answer for an assignment already accepted
    "stale_heartbeat",  # older epoch or sequence number than already seen, or a gone epoch
    "unknown_epoch",  # a heartbeat naming an epoch the router never handed out
    "orphan",  # worker holds an assignment nobody wants: Cancel sent
]


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
    handoffs: int = 0  # continuations started by a draining worker's HandOff
    handoffs_back: int = 0  # of those, failed before acceptance: back to the first worker


class RequestView(Struct, frozen=True):
    """One open request as the router holds it: a copy for dashboards, never a handle."""

    request_id: str
    phase: Phase
    attempt: int  # attempts offered so far (1: the first offer); a resume is one more
    resumes: int  # continuations after its first token
    worker_id: str | None  # where its active attempt is placed, while it has one
    delivered: int  # tokens the client has
    max_new_tokens: int
    prompt_tokens: int
    handed_off_by: str | None = None  # a draining worker whose stream this continues


class Router:
    def __init__(self, config: RouterConfig | None = None, router_id: str | None = None) -> None:
        """router_id, when given, replaces the config's (one config, several routers)."""
        config = config or RouterConfig()
        if router_id is not None:
            config = structs.replace(config, router_id=router_id)
        self.config = config
        self._fenced: Counter[str] = Counter()
        self.fleet = Fleet(self.config, self._fenced)
        self.requests = Requests(self.config, self.fleet, self._fenced)

    # --- the one entry point ---

    def handle(self, event: RouterEvent, now: float) -> list[RouterEffect]:
        requests, fleet = self.requests, self.fleet
        requests.now = fleet.now = now
        out: list[RouterEffect] = []
        match event:
            case FromWorkerMessage(worker_id, Token() as token):
                requests.on_token(worker_id, token, out)
            case FromWorkerMessage(worker_id, TokenRun() as run):
                requests.on_token_run(worker_id, run, out)
            case FromWorkerMessage(worker_id, Finished() as finished):
                requests.on_finished(worker_id, finished, out)
            case FromWorkerMessage(worker_id, OfferResult() as result):
                requests.on_offer_result(worker_id, result, out)
            case FromWorkerMessage(worker_id, Heartbeat() as heartbeat):
                requests.act(fleet.on_heartbeat(worker_id, heartbeat, out), out)
            case FromWorkerMessage(worker_id, HandOff(sender, epoch, assignments)):
                if sender == worker_id and fleet.current(worker_id, epoch):
                    requests.on_handoff(worker_id, assignments, out)
                else:
                    self._fenced["stale_handoff"] += 1
            case Submit(request):
                requests.on_submit(request, out)
                return out  # submit dispatches itself; nothing else changed
            case ClientCancel(request_id):
                requests.on_client_cancel(request_id, out)
            case TimerFired(OfferTimer(assignment)):
                requests.on_offer_timeout(assignment, out)
            case TimerFired(ProgressTimer(assignment)):
                requests.on_progress_timeout(assignment, out)
            case TimerFired(LivenessTimer(worker_id)):
                requests.act(fleet.on_liveness_timer(worker_id, out), out)
            case WorkerGone(worker_id, epoch, reason):
                requests.act(fleet.on_worker_gone(worker_id, epoch, reason, out), out)
            case RegisterWorker(worker_id, takeover):
                requests.act(fleet.register(worker_id, takeover, out), out)
            case _:
                raise RouterMisuse(f"router cannot handle {event!r}")
        requests.dispatch_queue(out)
        return out

    def fence_counts(self) -> Mapping[str, int]:
        """Messages fenced so far, by reason (a live, read-only view: cheap to poll)."""
        return MappingProxyType(self._fenced)

    def statistics(self) -> RouterStatistics:
        requests = self.requests
        phases = Counter(r.phase.value for r in requests.records.values())
        return RouterStatistics(
            requests_by_phase=dict(phases),
            queued=len(requests.queue),
            workers=self.fleet.views(),
            fenced=dict(self._fenced),
            outcomes=dict(requests.outcomes),
            tokens_delivered=requests.tokens_delivered,
            resends_requested=requests.resends,
            retries=requests.retries,
            resumes=requests.resumes,
            handoffs=requests.handoffs,
            handoffs_back=requests.handoffs_back,
        )

    def slot_usage(self) -> list[tuple[str, int, int]]:
        """(worker id, slots the router counts as taken, slots) for each known worker."""
        return self.fleet.slot_usage()

    # --- point reads (cheap enough to ask after every event: the simulator's oracles do) ---

    def placement(self, request_id: str) -> tuple[str, Assignment] | None:
        """(worker id, assignment) of the request's active attempt, if it has one."""
        req = self.requests.records.get(request_id)
        if req is None or req.active is None or req.worker_id is None:
            return None
        return req.worker_id, req.active

    def wants(self, worker_id: str, assignment: Assignment) -> bool:
        """Is this the active attempt of a live request, placed on this worker, or the
        attempt it handed off that the router keeps running until its continuation is
        accepted?"""
        placed = (worker_id, assignment)
        return self.placement(assignment.request_id) == placed or (
            self.handed_off(assignment.request_id) == placed
        )

    def handoffs_back(self) -> int:
        """Handoffs whose continuation failed, so the stream went back to its worker."""
        return self.requests.handoffs_back

    def accepted(self, request_id: str) -> bool:
        """Whether the request's active attempt is accepted (assigned or streaming)."""
        req = self.requests.records.get(request_id)
        return req is not None and req.phase in (Phase.ASSIGNED, Phase.STREAMING)

    def handed_off(self, request_id: str) -> tuple[str, Assignment] | None:
        """(worker id, assignment) of the attempt the request's continuation replaces,
        while that continuation is offered and not yet accepted."""
        req = self.requests.records.get(request_id)
        return None if req is None else req.handoff

    def worker_clock(self, worker_id: str) -> tuple[int, int, bool] | None:
        """(epoch, heartbeat sequence, healthy) as the router sees the worker, if known."""
        worker = self.fleet.workers.get(worker_id)
        return None if worker is None else (worker.epoch, worker.seq, worker.healthy)

    def attempts_lost(self) -> int:
        """Attempts let go of and placed again so far (retries plus resumes)."""
        return self.requests.retries + self.requests.resumes

    def predicted_prefill(self, worker_id: str, assignment: Assignment) -> int | None:
        """Tokens the router predicted this attempt prefills on that worker (its context
        less what the worker's cache report offered), until its first token; None if
        the worker holds no such assignment."""
        worker = self.fleet.workers.get(worker_id)
        record = worker.holds.get(assignment) if worker is not None else None
        return None if record is None else record.prefill

    def views(self) -> tuple[WorkerView, ...]:
        """Each known worker as the router sees it."""
        return self.fleet.views()

    def queued_prefill(self, worker_id: str) -> int:
        """Prefill tokens placed on the worker and not yet past their first token."""
        worker = self.fleet.workers.get(worker_id)
        return 0 if worker is None else self.fleet.queued_prefill(worker)

    def holders(self, request_id: str) -> list[str]:
        """Workers on which the router counts a live hold (offered, held, missing) for it."""
        return self.fleet.live_holders(request_id)

    def open_requests(self, limit: int | None = None) -> tuple[RequestView, ...]:
        """The requests not yet terminal, oldest first (at most `limit` of them)."""
        records = self.requests.records.values()
        return tuple(
            RequestView(
                request_id=req.request.request_id,
                phase=req.phase,
                attempt=req.attempt,
                resumes=req.resumes,
                worker_id=req.worker_id,
                delivered=req.delivered,
                max_new_tokens=req.request.max_new_tokens,
                prompt_tokens=len(req.request.prompt_token_ids),
                handed_off_by=None if req.handoff is None else req.handoff[0],
            )
            for req in islice(records, limit)
        )
