"""Each request's attempts at one router, and the oracles that judge them.

The router-side Oracles (sim/oracles.py) keep, per request, the attempts its
router offered (a Tally of Attempts, from the offers themselves), and this
module judges them: the limits (attempts before the first token at most
`max_attempts`, continuations after it at most `max_resumes`, declines for want
of a slot spending neither), the placement itself (the target healthy at the
offer's epoch, the request held on that one worker only, or on it and the
draining worker that handed it off), every attempt let go of explained by a
disturbance of its own worker, every error outcome explained by its cause,
progress within the deadlines, and the fences of a handoff. The other
router-side oracles read the tallies (when an attempt last made progress,
which workers a request has tried).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.protocol import (
    Assignment,
    Cancel,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    FromWorkerMessage,
    Offer,
    OfferResult,
    RouterEffect,
    SendToWorker,
    Token,
    TokenRun,
)
from sim.disturbances import DECODER_FAULTS

if TYPE_CHECKING:
    from sim.disturbances import Disturbances
    from sim.view import ClusterView, NodeView


@dataclass(slots=True)
class Attempt:
    assignment: Assignment
    worker_id: str
    offered_at: float
    context: int  # prompt plus output prefix: what its first token waits for
    open: bool = True
    progress_at: float = 0.0  # the offer, then each token it delivered
    streaming: bool = False  # delivered a token
    full: bool = False  # declined for want of a slot (several routers): spends nothing


@dataclass(slots=True)
class Tally:
    """Per request: the attempts offered, split by whether the client had tokens."""

    attempts: list[Attempt] = field(default_factory=list)
    before_first_token: int = 0
    resumes: int = 0
    full_retries: int = 0  # of those, declined for want of a slot (several routers)
    full_resumes: int = 0


class Attempts:
    """One router's requests, attempt by attempt, and the checks on them above."""

    def __init__(
        self,
        cluster: ClusterView,
        node: NodeView,
        disturbances: Disturbances | None,
        violation: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.router = node.router
        self.config = node.router.config
        self.streams = node.streams
        self.disturbances = disturbances
        self._violation = violation
        self.attempts_lost = 0
        self.full_declines = 0  # attempts declined for want of a slot
        self.tallies: dict[str, Tally] = {}
        self._lost_mark = 0
        self._handoffs_back = 0
        # request -> (worker, attempt handed off, its continuation) until that is settled
        self._handing_off: dict[str, tuple[str, Assignment, Assignment]] = {}

    def note_full(self, result: OfferResult) -> bool:
        """A decline for want of a slot, of the request's open attempt: it spends no
        attempt or resume (the router must agree). With several routers it is the
        others' work; with one, the router's view was off, which a fault explains.
        True if this decline is news (the router marks the worker full)."""
        if result.accepted or result.reason != "no_slot":
            return False
        tally = self.tallies.get(result.assignment.request_id)
        last = tally.attempts[-1] if tally and tally.attempts else None
        if tally is None or last is None or not last.open or last.assignment != result.assignment:
            return False
        if last.full:
            return False
        last.full = True
        self.full_declines += 1
        if self.streams[result.assignment.request_id].tokens:
            tally.full_resumes += 1
        else:
            tally.full_retries += 1
        clock = self.router.worker_clock(last.worker_id)
        return clock is not None and clock[0] == result.epoch

    def progressed(self, request_id: str, now: float) -> None:
        """The router delivered a token of the request: its open attempt made progress."""
        tally = self.tallies.get(request_id)
        if tally is not None and tally.attempts:
            attempt = tally.attempts[-1]
            attempt.progress_at, attempt.streaming = now, True

    def on_offer(self, worker_id: str, offer: Offer, now: float) -> None:
        rid = offer.assignment.request_id
        config = self.config
        clock = self.router.worker_clock(worker_id)
        if clock is None or not clock[2] or clock[0] != offer.epoch:
            self._violation(
                f"{rid}: offered to {worker_id} at epoch {offer.epoch}, which the router "
                f"sees as {clock} (epoch, sequence, healthy)"
            )
        tally = self.tallies.setdefault(rid, Tally())
        if tally.attempts and tally.attempts[-1].open:
            self._lose(rid, tally.attempts[-1], now)
        context = len(offer.request.prompt_token_ids) + len(offer.request.output_prefix)
        tally.attempts.append(Attempt(offer.assignment, worker_id, now, context, progress_at=now))
        handed = self.router.handed_off(rid)
        if handed is not None:  # a handoff spends no resume; the old attempt runs on
            self._handing_off[rid] = (*handed, offer.assignment)
        elif self.streams[rid].tokens:
            tally.resumes += 1
            if tally.resumes - tally.full_resumes > config.max_resumes:
                self._violation(f"{rid}: resume {tally.resumes} > max_resumes {config.max_resumes}")
        else:
            tally.before_first_token += 1
            if tally.before_first_token - tally.full_retries > config.max_attempts:
                self._violation(
                    f"{rid}: attempt {tally.before_first_token} before the first token "
                    f"> max_attempts {config.max_attempts} (and {tally.full_retries} "
                    "declined for want of a slot)"
                )
        holders = self.router.holders(rid)
        expected = [worker_id] if handed is None else sorted({worker_id, handed[0]})
        if sorted(holders) != expected:
            self._violation(
                f"{rid}: placed on {holders} at once (offer to {worker_id}"
                + (")" if handed is None else f", handed off by {handed[0]})")
            )

    def on_outcome(
        self, request_id: str, outcome: DeliverFinished | DeliverError, now: float
    ) -> None:
        tally = self.tallies.pop(request_id, None)
        last = tally.attempts[-1] if tally and tally.attempts else None
        kind = outcome.kind if isinstance(outcome, DeliverError) else "finished"
        if kind in ("finished", "cancelled"):
            return
        if kind == "overloaded":
            return  # judged at submit, where the queue's length is known
        if last is not None and last.open:
            self._lose(request_id, last, now)
        if kind == "failed" and self.disturbances is not None:
            if last is None or not self.disturbances.explains(
                last.worker_id, last.offered_at, now, DECODER_FAULTS
            ):
                where = last.worker_id if last else "no worker"
                self._violation(f"{request_id}: failed on {where} without a decoder fault there")
            return
        spent = tally is not None and (
            tally.resumes - tally.full_resumes >= self.config.max_resumes
            if self.streams[request_id].tokens
            else tally.before_first_token - tally.full_retries >= self.config.max_attempts
        )
        if not spent:
            self._check_none_fit(request_id, kind, now)

    def _check_none_fit(self, request_id: str, kind: str, now: float) -> None:
        """Given up with attempts left: allowed only if no worker could take it."""
        if self.disturbances is None:
            return
        for worker_id in self.cluster.workers:
            known = self.router.worker_clock(worker_id) is not None
            if known and not self.disturbances.explains(worker_id, now, now):
                self._violation(
                    f"{request_id}: {kind} with attempts left while {worker_id} was "
                    "undisturbed and known to the router"
                )
                return

    def check_overloaded(self, request_id: str, queued_before: int) -> None:
        if queued_before < self.config.queue_limit:
            self._violation(
                f"{request_id}: overloaded with {queued_before} queued, under the "
                f"queue limit {self.config.queue_limit}"
            )

    def find_lost(self, now: float) -> None:
        """After each router step: if the router counted a retry or resume, find the
        attempts it let go of."""
        mark = self.router.attempts_lost()
        if mark != self._lost_mark:
            self._lost_mark = mark
            self._find_lost_attempts(now)

    def _find_lost_attempts(self, now: float) -> None:
        """The router counted a retry or resume: find the attempts it let go of."""
        for rid, tally in self.tallies.items():
            last = tally.attempts[-1] if tally.attempts else None
            if (
                last is not None
                and last.open
                and self.router.placement(rid) != (last.worker_id, last.assignment)
            ):
                self._lose(rid, last, now)

    def _lose(self, request_id: str, attempt: Attempt, now: float) -> None:
        attempt.open = False
        self.attempts_lost += 1
        disturbances = self.disturbances
        if attempt.full and self.cluster.shared:
            return  # the worker was full of other routers' work: no fault needed
        if disturbances is not None and not disturbances.explains(
            attempt.worker_id, attempt.offered_at, now
        ):
            self._violation(
                f"{request_id}: attempt {attempt.assignment.attempt} on {attempt.worker_id} "
                f"(offered at {attempt.offered_at:.4f}) lost at {now:.4f}, and no fault "
                f"touched {attempt.worker_id} to explain it"
            )

    def check_delivered_from_active(
        self, event: FromWorkerMessage, effects: list[RouterEffect]
    ) -> None:
        """Output reaches the client only from the attempt that is active (after the
        step), on the worker it was placed on: never the other of a handoff's two."""
        message = event.message
        if not isinstance(message, Token | TokenRun):
            return
        if not any(isinstance(e, DeliverToken) for e in effects):
            return
        placed = self.router.placement(message.assignment.request_id)
        if placed is not None and placed != (event.worker_id, message.assignment):
            self._violation(
                f"{message.assignment} from {event.worker_id} reached the client while "
                f"{placed} is the active attempt"
            )

    def check_handoffs(self, effects: list[RouterEffect], now: float) -> None:
        """A handed-off attempt is cancelled only once its continuation is accepted
        (or the request is over); a continuation that fails before that goes back to it,
        which reopens it here."""
        if not self._handing_off:
            return
        for effect in effects:
            if not (isinstance(effect, SendToWorker) and isinstance(effect.message, Cancel)):
                continue
            rid = effect.message.assignment.request_id
            pending = self._handing_off.get(rid)
            if pending is None or (effect.worker_id, effect.message.assignment) != pending[:2]:
                continue
            del self._handing_off[rid]
            placed = self.router.placement(rid)
            settled = placed is None or (placed[1] == pending[2] and self.router.accepted(rid))
            if not settled:
                self._violation(
                    f"{pending[1]} on {pending[0]}, handed off, was cancelled before its "
                    f"continuation {pending[2]} was accepted"
                )
        back = self.router.handoffs_back()
        went_back, self._handoffs_back = back != self._handoffs_back, back
        for rid, (worker_id, assignment, _) in list(self._handing_off.items()):
            if self.router.handed_off(rid) == (worker_id, assignment):
                continue  # still pending
            if not went_back or self.router.placement(rid) != (worker_id, assignment):
                # settled without a Cancel of ours: the router lost that worker's hold
                # (the worker was lost), or the request ended
                del self._handing_off[rid]
                continue
            del self._handing_off[rid]  # back on the worker that handed it off
            tally = self.tallies.get(rid)
            if tally is None or not tally.attempts:
                continue
            last = tally.attempts[-1]
            if last.open:
                self._lose(rid, last, now)  # the continuation that failed
            again = Attempt(assignment, worker_id, now, last.context, progress_at=now)
            again.streaming = True
            tally.attempts.append(again)

    def check_progress(self, now: float, slack_s: float) -> None:
        """No placed request waits longer than its progress deadline plus the slack
        (during the faults too): the router gives up on a worker that stopped."""
        config = self.config
        for rid, tally in self.tallies.items():
            attempt = tally.attempts[-1] if tally.attempts else None
            if attempt is None or not attempt.open:
                continue
            if attempt.streaming:
                deadline = config.token_timeout_s
            else:
                per_token = config.prefill_timeout_per_token_s
                deadline = config.first_token_timeout_s + attempt.context * per_token
            waited = now - attempt.progress_at
            if waited > deadline + slack_s:
                self._violation(
                    f"{rid}: attempt {attempt.assignment.attempt} on {attempt.worker_id} "
                    f"made no progress for {waited:.2f}s (deadline {deadline:.2f}s + "
                    f"{slack_s:.2f}s), and the router still waits"
                )
