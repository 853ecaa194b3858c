"""Every state machine in core, as data: its states, the events that move them, one table.

Like h11's `_state.py`, this file is the one place that says which moves are
legal. The machines (core/router.py, core/fleet.py, core/worker.py) keep
their state in these enums and change it only through `Table.next`, which
raises the machine's misuse error for a pair the table does not list: asking
for such a move is a bug in our own code, never something the network can
cause. Messages from the network that cannot apply (a duplicate token, an
answer for an assignment long gone) are fenced and counted by the machines
*before* they would reach a table, so they never raise.

Five machines:

- request phase (router, one per request): received -> offered -> assigned
  -> streaming -> completed | failed | cancelled. A lost attempt sends the
  request back to received with its delivered tokens kept; from there it is
  offered again (retry before the first token, resume after it) or given up.
  A streaming request whose draining worker hands it off goes back to
  received too and is offered at once; if that offer fails before it is
  accepted, it returns to streaming on the worker that handed it off.
- slot hold (router, one per (worker, assignment) the router counts against
  a worker's slots): offered -> held -> missing, or draining once the router
  no longer wants it, until released.
- worker health (router, one per worker): healthy, stuck (it heartbeats but
  its assignments stopped making progress), silent (its heartbeats stopped),
  gone (the transport lost its connection).
- assignment (worker, one per assignment it has seen): unseen -> active ->
  ended, or unseen -> declined, or unseen -> forestalled (its cancel overtook
  it) -> declined when the offer lands.
- sequence (a decoder's scheduler, one per assignment it decodes): waiting ->
  prefilling -> decoding, growing a block at each boundary; preempted back to
  waiting (from either running state) when the pool runs out; gone when it
  stops or can never fit.

States and events are StrEnums: their values read well in statistics and
traces, and they hash as fast as strings on the router's hot path.
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Generic, TypeVar


class Misuse(Exception):
    """Our own code asked a machine for a move its table does not have (a bug, not bad input)."""


class RouterMisuse(Misuse):
    """The router was asked for something impossible."""


class WorkerMisuse(Misuse):
    """The worker was fed an event it can never take."""


S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class Table(Generic[S, E]):
    """(state, event) -> next state; anything missing is a misuse.

    `recorder`, when a caller sets one, counts every move taken: the
    simulator's coverage report (sim/coverage.py) uses it to show which
    moves a sweep exercised. It is None in production, where `next` costs
    one dict lookup and one attribute test.
    """

    __slots__ = ("_moves", "misuse", "name", "recorder")

    def __init__(self, name: str, moves: dict[tuple[S, E], S], misuse: type[Misuse]) -> None:
        self.name = name
        self._moves = moves
        self.misuse = misuse
        self.recorder: Counter[tuple[S, E]] | None = None

    def next(self, state: S, event: E) -> S:
        nxt = self._moves.get((state, event))
        if nxt is None:
            raise self.misuse(f"{self.name}: no move from {state.value} on {event.value}")
        if self.recorder is not None:
            self.recorder[state, event] += 1
        return nxt

    def pairs(self) -> list[tuple[S, E, S]]:
        return [(state, event, nxt) for (state, event), nxt in self._moves.items()]


# --- request phase (router) ---


class Phase(enum.StrEnum):
    RECEIVED = "received"  # waiting for a worker: new, or its last attempt was lost
    OFFERED = "offered"  # an offer is out to one worker, answer pending
    ASSIGNED = "assigned"  # the worker accepted; no token delivered by this attempt yet
    STREAMING = "streaming"  # this attempt delivered a token to the client
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RequestEvent(enum.StrEnum):
    OFFER_SENT = "offer_sent"  # a healthy worker that fits had a free slot: Offer sent
    ACCEPTED = "accepted"  # OfferResult(accepted), or output / a heartbeat shows it running
    TOKEN = "token"  # a Token (or a TokenRun's next entry) passed the fence, delivered
    FINISHED = "finished"  # Finished(eos|length), and every token it counts is delivered
    # Declined, offer timed out, worker silent / gone / restarted, Finished(failed or
    # cancelled) it was not asked for, or dropped from the worker's heartbeats:
    ATTEMPT_LOST = "attempt_lost"
    GIVEN_UP = "given_up"  # nothing can serve it: no worker fits, queue full, attempts spent
    CLIENT_CANCEL = "client_cancel"  # ClientCancel
    # HandOff from its (draining) worker, and another worker has a slot: continued there
    HANDED_OFF = "handed_off"
    # the continuation's offer failed before it was accepted, and the worker that
    # handed the stream off still holds it: back to that worker
    HANDOFF_FAILED = "handoff_failed"


P, R = Phase, RequestEvent
REQUEST = Table[Phase, RequestEvent](
    "request",
    {
        (P.RECEIVED, R.OFFER_SENT): P.OFFERED,
        (P.RECEIVED, R.GIVEN_UP): P.FAILED,
        (P.RECEIVED, R.CLIENT_CANCEL): P.CANCELLED,
        (P.OFFERED, R.ACCEPTED): P.ASSIGNED,
        (P.OFFERED, R.ATTEMPT_LOST): P.RECEIVED,
        (P.OFFERED, R.CLIENT_CANCEL): P.CANCELLED,
        (P.OFFERED, R.HANDOFF_FAILED): P.STREAMING,
        (P.ASSIGNED, R.TOKEN): P.STREAMING,
        (P.ASSIGNED, R.FINISHED): P.COMPLETED,  # finished without a token of its own
        (P.ASSIGNED, R.ATTEMPT_LOST): P.RECEIVED,
        (P.ASSIGNED, R.CLIENT_CANCEL): P.CANCELLED,
        (P.STREAMING, R.TOKEN): P.STREAMING,
        (P.STREAMING, R.FINISHED): P.COMPLETED,
        (P.STREAMING, R.ATTEMPT_LOST): P.RECEIVED,  # delivered tokens kept: it resumes
        (P.STREAMING, R.CLIENT_CANCEL): P.CANCELLED,
        (P.STREAMING, R.HANDED_OFF): P.RECEIVED,  # and offered elsewhere in the same step
    },
    RouterMisuse,
)
TERMINAL = frozenset({P.COMPLETED, P.FAILED, P.CANCELLED})


# --- slot hold (router): one assignment counted against one worker's slots ---


class Hold(enum.StrEnum):
    FREE = "free"  # not counted (the record is deleted on entering it)
    OFFERED = "offered"  # an Offer is out; the worker has not confirmed it
    HELD = "held"  # confirmed: an answer, its output or a heartbeat named it
    MISSING = "missing"  # confirmed, then absent from a heartbeat: its end is in flight or lost
    DRAINING_OFFER = "draining_offer"  # unwanted before confirmation: until answer or offer timer
    DRAINING = "draining"  # unwanted after confirmation: until the worker lets go


class HoldEvent(enum.StrEnum):
    OFFER_SENT = "offer_sent"
    CONFIRMED = "confirmed"  # OfferResult(accepted) or output names the assignment
    LISTED = "listed"  # a fresh heartbeat lists the assignment
    # A fresh heartbeat does not list it. Only confirmed holds take this event: an
    # unconfirmed offer may simply not have reached the worker yet (core/fleet.py).
    ABSENT = "absent"
    UNWANTED = "unwanted"  # the router cancelled it (client cancel): Cancel sent
    OFFER_EXPIRED = "offer_expired"  # the offer timer fired for an unconfirmed, unwanted hold
    # Declined, Finished, offer timed out, missing too long, or the worker was lost:
    RELEASED = "released"


H, HE = Hold, HoldEvent
HOLD = Table[Hold, HoldEvent](
    "slot hold",
    {
        (H.FREE, HE.OFFER_SENT): H.OFFERED,
        (H.OFFERED, HE.CONFIRMED): H.HELD,
        (H.OFFERED, HE.LISTED): H.HELD,
        (H.OFFERED, HE.UNWANTED): H.DRAINING_OFFER,
        (H.OFFERED, HE.RELEASED): H.FREE,
        (H.HELD, HE.CONFIRMED): H.HELD,
        (H.HELD, HE.LISTED): H.HELD,
        (H.HELD, HE.ABSENT): H.MISSING,  # Resend: its last tokens or Finished may be lost
        (H.HELD, HE.UNWANTED): H.DRAINING,
        (H.HELD, HE.RELEASED): H.FREE,
        (H.MISSING, HE.LISTED): H.HELD,
        (H.MISSING, HE.ABSENT): H.MISSING,  # Resend again, until it has been missing too long
        (H.MISSING, HE.UNWANTED): H.DRAINING,
        (H.MISSING, HE.RELEASED): H.FREE,
        (H.DRAINING_OFFER, HE.CONFIRMED): H.DRAINING,  # Cancel again
        (H.DRAINING_OFFER, HE.LISTED): H.DRAINING_OFFER,  # Cancel again
        (H.DRAINING_OFFER, HE.OFFER_EXPIRED): H.FREE,
        (H.DRAINING_OFFER, HE.RELEASED): H.FREE,
        (H.DRAINING, HE.CONFIRMED): H.DRAINING,  # Cancel again
        (H.DRAINING, HE.LISTED): H.DRAINING,  # Cancel again
        (H.DRAINING, HE.ABSENT): H.FREE,  # the worker let go
        (H.DRAINING, HE.RELEASED): H.FREE,
    },
    RouterMisuse,
)
LIVE_HOLDS = frozenset({H.OFFERED, H.HELD, H.MISSING})  # the router still wants these


# --- worker health (router) ---


class Health(enum.StrEnum):
    HEALTHY = "healthy"
    STUCK = "stuck"  # heartbeats, but an assignment missed its progress deadline: no offers
    SILENT = "silent"  # no heartbeat before its deadline
    GONE = "gone"  # the transport lost this epoch's connection; only a newer epoch returns


class HealthEvent(enum.StrEnum):
    HEARTBEAT = "heartbeat"  # a fresh heartbeat of the current epoch
    NEW_EPOCH = "new_epoch"  # a heartbeat of a newer epoch: the process restarted
    DEADLINE_MISSED = "deadline_missed"  # the liveness timer fired past the deadline
    CONNECTION_LOST = "connection_lost"  # WorkerGone for the current or a newer epoch
    PROGRESS_MISSED = "progress_missed"  # an assignment on it missed its progress deadline
    PROGRESS = "progress"  # a stuck worker's assignment delivered a token
    PROBE_DUE = "probe_due"  # a heartbeat of a worker stuck for `stuck_probe_s`: try it again


W, WE = Health, HealthEvent
HEALTH = Table[Health, HealthEvent](
    "worker health",
    {
        (W.HEALTHY, WE.HEARTBEAT): W.HEALTHY,
        (W.HEALTHY, WE.NEW_EPOCH): W.HEALTHY,
        (W.HEALTHY, WE.DEADLINE_MISSED): W.SILENT,
        (W.HEALTHY, WE.CONNECTION_LOST): W.GONE,
        (W.HEALTHY, WE.PROGRESS_MISSED): W.STUCK,
        (W.STUCK, WE.HEARTBEAT): W.STUCK,  # a heartbeat is not progress
        (W.STUCK, WE.PROGRESS_MISSED): W.STUCK,
        (W.STUCK, WE.PROGRESS): W.HEALTHY,
        (W.STUCK, WE.PROBE_DUE): W.HEALTHY,  # one more chance; a miss makes it stuck again
        (W.STUCK, WE.NEW_EPOCH): W.HEALTHY,  # restarted: a new process, a new decoder
        (W.STUCK, WE.DEADLINE_MISSED): W.SILENT,
        (W.STUCK, WE.CONNECTION_LOST): W.GONE,
        (W.SILENT, WE.HEARTBEAT): W.HEALTHY,  # a stall ended
        (W.SILENT, WE.NEW_EPOCH): W.HEALTHY,
        (W.SILENT, WE.DEADLINE_MISSED): W.SILENT,
        (W.SILENT, WE.CONNECTION_LOST): W.GONE,
        # A gone epoch's heartbeats are stale (fenced), so only a newer epoch returns.
        (W.GONE, WE.NEW_EPOCH): W.HEALTHY,
        (W.GONE, WE.DEADLINE_MISSED): W.GONE,
        (W.GONE, WE.CONNECTION_LOST): W.GONE,
    },
    RouterMisuse,
)


# --- assignment (worker) ---


class AssignmentState(enum.StrEnum):
    UNSEEN = "unseen"  # no offer or cancel seen (or forgotten: the answer table is bounded)
    FORESTALLED = "forestalled"  # its cancel came first: the offer, when it lands, is declined
    DECLINED = "declined"  # answered no
    ACTIVE = "active"  # accepted: holds a slot, decoding
    ENDED = "ended"  # was active; finished, cancelled or failed, slot freed


class AssignmentEvent(enum.StrEnum):
    OFFER_ADMITTED = "offer_admitted"
    OFFER_REFUSED = "offer_refused"  # wrong worker or epoch, stale attempt, no slot, too long
    CANCEL = "cancel"
    DECODED = "decoded"  # the decoder produced the next index
    DECODE_DONE = "decode_done"  # the decoder ended it: eos, length or failed
    SUPERSEDED = "superseded"  # the router offered a newer attempt of the same request
    DECODER_FAILED = "decoder_failed"
    DECODER_SKIPPED = "decoder_skipped"  # the decoder's output skipped an index: stop it
    ROUTER_LOST = "router_lost"  # the link to the router that made it is gone


A, AE = AssignmentState, AssignmentEvent
ASSIGNMENT = Table[AssignmentState, AssignmentEvent](
    "assignment",
    {
        (A.UNSEEN, AE.OFFER_ADMITTED): A.ACTIVE,
        (A.UNSEEN, AE.OFFER_REFUSED): A.DECLINED,
        (A.UNSEEN, AE.CANCEL): A.FORESTALLED,  # the cancel overtook its offer
        (A.FORESTALLED, AE.OFFER_REFUSED): A.DECLINED,  # ... which lands and is declined
        (A.ACTIVE, AE.DECODED): A.ACTIVE,
        (A.ACTIVE, AE.DECODE_DONE): A.ENDED,
        (A.ACTIVE, AE.CANCEL): A.ENDED,
        (A.ACTIVE, AE.SUPERSEDED): A.ENDED,
        (A.ACTIVE, AE.DECODER_FAILED): A.ENDED,
        (A.ACTIVE, AE.DECODER_SKIPPED): A.ENDED,
        (A.ACTIVE, AE.ROUTER_LOST): A.ENDED,
    },
    WorkerMisuse,
)


# --- sequence (a decoder's scheduler, core/scheduler.py) ---


class SchedulerMisuse(Misuse):
    """The scheduler was asked about a sequence it does not have, or twice for one."""


class SeqState(enum.StrEnum):
    WAITING = "waiting"  # queued for a row and the blocks of its known context
    PREFILLING = "prefilling"  # holds a row and blocks; its context is being computed
    DECODING = "decoding"  # its context is in the cache: one token a step
    GONE = "gone"  # stopped (ended, cancelled, superseded) or refused: it holds nothing


class SeqEvent(enum.StrEnum):
    ADMITTED = "admitted"  # a row and the context's blocks were free (a cached prefix shared)
    REFUSED = "refused"  # its whole context can never fit: max_context or the whole pool
    PREFILLED = "prefilled"  # the step computed the rest of its context: it decodes next
    GREW = "grew"  # it crossed a block boundary and took one more block
    PREEMPTED = "preempted"  # the pool ran out: its blocks back, recomputed from the head
    STOPPED = "stopped"  # its assignment ended or was dropped: its blocks go back


Q, QE = SeqState, SeqEvent
SEQUENCE = Table[SeqState, SeqEvent](
    "sequence",
    {
        (Q.WAITING, QE.ADMITTED): Q.PREFILLING,
        (Q.WAITING, QE.REFUSED): Q.GONE,
        (Q.WAITING, QE.STOPPED): Q.GONE,
        (Q.PREFILLING, QE.PREFILLED): Q.DECODING,
        (Q.PREFILLING, QE.PREEMPTED): Q.WAITING,  # admitted last, so the first to go
        (Q.PREFILLING, QE.STOPPED): Q.GONE,
        (Q.DECODING, QE.GREW): Q.DECODING,
        (Q.DECODING, QE.PREEMPTED): Q.WAITING,
        (Q.DECODING, QE.STOPPED): Q.GONE,
    },
    SchedulerMisuse,
)

TABLES: tuple[Table, ...] = (REQUEST, HOLD, HEALTH, ASSIGNMENT, SEQUENCE)  # type: ignore[type-arg]
