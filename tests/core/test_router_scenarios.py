"""Router scenarios, driven only through Router.handle, as a worker and client would."""

from __future__ import annotations

from msgspec.structs import replace

from core.config import RouterConfig
from core.protocol import (
    ArmTimer,
    Assignment,
    Cancel,
    ClientCancel,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    DisarmTimer,
    Finished,
    FromWorkerMessage,
    GenerationRequest,
    HandOff,
    Heartbeat,
    LivenessTimer,
    Offer,
    OfferResult,
    OfferTimer,
    ProgressTimer,
    RegisterWorker,
    Registration,
    Resend,
    RouterEffect,
    Sampling,
    SendToWorker,
    Submit,
    TimerFired,
    Token,
    TokenLogprob,
    TokenRun,
    WorkerGone,
)
from core.router import Router


def request(rid: str, max_new: int = 8, prompt: tuple[int, ...] = (1, 2, 3)) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_new)


def beat(
    router: Router,
    worker: str,
    now: float = 0.0,
    epoch: int = 0,
    seq: int = 1,
    slots: int = 2,
    active: tuple[Assignment, ...] = (),
    max_context: int = 1024,
    free: int | None = None,  # default: every slot not listed (no other router's work)
) -> list[RouterEffect]:
    free = slots - len(active) if free is None else free
    hb = Heartbeat(worker, epoch, seq, slots, free, max_context, active)
    return router.handle(FromWorkerMessage(worker, hb), now)


def offers(effects: list[RouterEffect]) -> list[tuple[str, Offer]]:
    return [
        (e.worker_id, e.message)
        for e in effects
        if isinstance(e, SendToWorker) and isinstance(e.message, Offer)
    ]


def cancels(effects: list[RouterEffect]) -> list[tuple[str, Assignment]]:
    return [
        (e.worker_id, e.message.assignment)
        for e in effects
        if isinstance(e, SendToWorker) and isinstance(e.message, Cancel)
    ]


def outcomes(effects: list[RouterEffect]) -> list[DeliverFinished | DeliverError]:
    return [e for e in effects if isinstance(e, DeliverFinished | DeliverError)]


def from_worker(router: Router, worker: str, message: object, now: float = 0.0) -> list:
    return router.handle(FromWorkerMessage(worker, message), now)  # type: ignore[arg-type]


def accept(router: Router, worker: str, a: Assignment, now: float = 0.0) -> list[RouterEffect]:
    return from_worker(router, worker, OfferResult(worker, 0, a, True), now)


def accepted(
    max_new: int = 8,
    config: RouterConfig | None = None,
    workers: tuple[str, ...] = ("w1",),
    slots: int = 2,
) -> tuple[Router, Assignment]:
    """A router whose request "a" (attempt 1) has been accepted by w1."""
    router = Router(config)
    for worker in workers:
        beat(router, worker, slots=slots)
    router.handle(Submit(request("a", max_new=max_new)), 0)
    a1 = Assignment("a", 1)
    accept(router, "w1", a1)
    return router, a1


def test_offer_goes_to_a_healthy_worker_with_a_timer() -> None:
    router = Router(RouterConfig(offer_timeout_s=2.0))
    beat(router, "w1")
    effects = router.handle(Submit(request("a")), 10.0)
    [(worker, offer)] = offers(effects)
    assert worker == "w1"
    assert offer.assignment == Assignment("a", 1)
    assert offer.epoch == 0
    assert ArmTimer(OfferTimer(Assignment("a", 1)), 12.0) in effects


def test_duplicate_and_gap_are_fenced_while_the_next_index_is_delivered() -> None:
    router, a1 = accepted()
    # the first token also moves the attempt to the per-token progress deadline
    assert from_worker(router, "w1", Token(a1, 0, 100)) == [
        DeliverToken("a", 0, 100),
        ArmTimer(ProgressTimer(a1), RouterConfig().token_timeout_s),
    ]
    assert from_worker(router, "w1", Token(a1, 0, 100)) == []  # duplicate
    # a gap is not delivered; the router asks again from the first missing index
    assert from_worker(router, "w1", Token(a1, 2, 102)) == [SendToWorker("w1", Resend(a1, 1))]
    assert from_worker(router, "w1", Token(a1, 1, 101)) == [DeliverToken("a", 1, 101)]
    fenced = router.statistics().fenced
    assert fenced["duplicate"] == 1
    assert fenced["gap"] == 1


def test_token_from_another_worker_is_fenced() -> None:
    router, a1 = accepted(workers=("w1", "w2"))
    assert from_worker(router, "w2", Token(a1, 0, 5)) == []
    assert router.statistics().fenced["wrong_worker"] == 1


def test_token_before_the_accept_counts_as_acceptance() -> None:
    router = Router()
    beat(router, "w1")
    router.handle(Submit(request("a")), 0)
    a1 = Assignment("a", 1)
    assert DeliverToken("a", 0, 7) in from_worker(router, "w1", Token(a1, 0, 7))
    # the reordered accept arrives afterwards and changes nothing
    assert accept(router, "w1", a1) == []
    assert router.statistics().requests_by_phase == {"streaming": 1}


def test_finished_waits_for_tokens_still_in_flight() -> None:
    router, a1 = accepted()
    from_worker(router, "w1", Token(a1, 0, 1))
    assert from_worker(router, "w1", Finished(a1, "eos", 3)) == []
    assert from_worker(router, "w1", Token(a1, 1, 2)) == [DeliverToken("a", 1, 2)]
    assert from_worker(router, "w1", Token(a1, 2, 3)) == [
        DeliverToken("a", 2, 3),
        DisarmTimer(ProgressTimer(a1)),
        DeliverFinished("a", "eos", 3),
    ]
    assert router.statistics().workers[0].held == 0


def test_offer_timeout_moves_to_attempt_two_on_another_worker() -> None:
    router = Router(RouterConfig(offer_timeout_s=1.0))
    beat(router, "w1")
    beat(router, "w2")
    [(first, _)] = offers(router.handle(Submit(request("a")), 0))
    effects = router.handle(TimerFired(OfferTimer(Assignment("a", 1))), 1.0)
    [(second, offer)] = offers(effects)
    assert second != first
    assert offer.assignment == Assignment("a", 2)
    # the slow worker is told to drop the first attempt if it ever gets it
    assert (first, Assignment("a", 1)) in cancels(effects)


def test_stale_attempts_output_is_a_no_op() -> None:
    router = Router(RouterConfig(offer_timeout_s=1.0))
    beat(router, "w1")
    beat(router, "w2")
    router.handle(Submit(request("a")), 0)
    router.handle(TimerFired(OfferTimer(Assignment("a", 1))), 1.0)
    stale = Assignment("a", 1)
    assert from_worker(router, "w1", Finished(stale, "eos", 0)) == []
    assert from_worker(router, "w1", Token(stale, 0, 9)) == []
    assert router.statistics().requests_by_phase == {"offered": 1}
    assert router.statistics().fenced["stale_attempt"] == 2


def test_decline_retries_on_the_next_candidate() -> None:
    router = Router()
    beat(router, "w1")
    beat(router, "w2")
    [(first, _)] = offers(router.handle(Submit(request("a")), 0))
    declined = OfferResult(first, 0, Assignment("a", 1), False, "no_slot")
    [(second, offer)] = offers(from_worker(router, first, declined))
    assert second != first
    assert offer.assignment.attempt == 2


def test_attempts_are_bounded() -> None:
    router = Router(RouterConfig(max_attempts=2))
    beat(router, "w1")
    beat(router, "w2")
    router.handle(Submit(request("a")), 0)
    for attempt, worker in ((1, "w1"), (2, "w2")):
        effects = from_worker(
            router, worker, OfferResult(worker, 0, Assignment("a", attempt), False, "stale_epoch")
        )
    [outcome] = outcomes(effects)
    assert isinstance(outcome, DeliverError)
    assert outcome.kind == "no_worker"


def test_a_full_worker_costs_no_attempt_and_gets_no_offer_until_it_frees_a_slot() -> None:
    # Several routers share the workers: a decline for want of a slot is their work,
    # not a fault. It spends no attempt; that worker gets no offer from this router
    # until a heartbeat shows a free slot, and the request waits in the queue.
    router = Router(RouterConfig(max_attempts=1, router_id="r1"))
    beat(router, "w1")
    beat(router, "w2")
    [(first, offer)] = offers(router.handle(Submit(request("a")), 0))
    full = OfferResult(first, 0, offer.assignment, False, "no_slot")
    [(second, offer)] = offers(from_worker(router, first, full))
    assert second != first and offer.assignment == Assignment("a", 2, "r1")
    full = OfferResult(second, 0, offer.assignment, False, "no_slot")
    effects = from_worker(router, second, full)
    assert not offers(effects) and not outcomes(effects)
    assert router.statistics().queued == 1
    # Another router's work still fills w1 (no slot free, none of them ours): nothing.
    assert not offers(beat(router, first, seq=2, free=0))
    # w2 frees a slot: the request goes there, its third attempt and still no failure.
    [(worker, offer)] = offers(beat(router, second, seq=2, free=1))
    assert worker == second and offer.assignment.attempt == 3


def test_worker_crash_before_first_token_completes_elsewhere() -> None:
    router, _ = accepted(max_new=2, workers=("w1", "w2"))
    # w1 comes back with a new epoch: it lost everything it held
    effects = beat(router, "w1", now=0.5, epoch=1)
    [(worker, offer)] = offers(effects)
    assert (worker, offer.assignment) == ("w2", Assignment("a", 2))
    a2 = offer.assignment
    from_worker(router, "w2", OfferResult("w2", 0, a2, True))
    assert from_worker(router, "w2", Token(a2, 0, 4))[0] == DeliverToken("a", 0, 4)
    from_worker(router, "w2", Token(a2, 1, 5))
    assert outcomes(from_worker(router, "w2", Finished(a2, "length", 2))) == [
        DeliverFinished("a", "length", 2)
    ]


def test_heartbeat_expiry_before_first_token_fails_over() -> None:
    router = Router(RouterConfig(heartbeat_timeout_s=3.0))
    beat(router, "w1")
    beat(router, "w2", now=2.0)
    router.handle(Submit(request("a")), 2.0)
    accept(router, "w1", Assignment("a", 1))
    effects = router.handle(TimerFired(LivenessTimer("w1")), 3.0)
    [(worker, offer)] = offers(effects)
    assert (worker, offer.assignment.attempt) == ("w2", 2)
    assert not router.statistics().workers[0].healthy


def test_without_resume_worker_lost_after_first_token_ends_the_stream() -> None:
    config = RouterConfig(heartbeat_timeout_s=3.0, max_resumes=0)  # --no-resume
    router, a1 = accepted(config=config, workers=("w1", "w2"))
    from_worker(router, "w1", Token(a1, 0, 1))
    beat(router, "w2", now=2.5, seq=2)
    effects = router.handle(TimerFired(LivenessTimer("w1")), 3.0)
    assert offers(effects) == []
    [outcome] = outcomes(effects)
    assert isinstance(outcome, DeliverError)
    assert outcome.kind == "worker_lost"
    # nothing more is delivered for it, whatever arrives
    assert from_worker(router, "w1", Token(a1, 1, 2)) == []


def test_a_lost_connection_fails_over_or_ends_streams_at_once_and_fences_its_epoch() -> None:
    router = Router(RouterConfig(max_resumes=0))
    beat(router, "w1")
    beat(router, "w2")
    router.handle(Submit(request("a")), 0)
    router.handle(Submit(request("b")), 0)
    a1, b1 = Assignment("a", 1), Assignment("b", 1)
    accept(router, "w1", a1)
    accept(router, "w2", b1)
    from_worker(router, "w1", Token(a1, 0, 7))  # a has a delivered token, b has none
    router.handle(Submit(request("c")), 0)  # lands on w1 (fewest holds, then id order)
    c1 = Assignment("c", 1)
    accept(router, "w1", c1)
    effects = router.handle(WorkerGone("w1", 0, "connection reset"), 0.1)
    [outcome] = outcomes(effects)
    assert (outcome.request_id, outcome.kind) == ("a", "worker_lost")  # type: ignore[union-attr]
    assert [(w, o.assignment) for w, o in offers(effects)] == [("w2", Assignment("c", 2))]
    assert router.statistics().retries == 1
    # the gone epoch may not come back: its heartbeats and output are stale now
    assert beat(router, "w1", now=0.2, seq=9) == []
    assert not router.statistics().workers[0].healthy
    assert from_worker(router, "w1", Token(c1, 0, 1)) == []
    # a gone notice for an older connection than the current one changes nothing
    beat(router, "w1", now=0.3, epoch=1)
    assert router.handle(WorkerGone("w1", 0, "late notice"), 0.4) == []
    assert router.statistics().workers[0].healthy


def test_a_draining_worker_gets_no_offers_and_its_work_completes() -> None:
    router, a1 = accepted(max_new=1, workers=("w1",), slots=2)
    beat(router, "w1", seq=2, slots=0, active=(a1,))  # draining: no capacity offered
    router.handle(Submit(request("b")), 0.1)
    assert router.statistics().queued == 1
    from_worker(router, "w1", Token(a1, 0, 3))
    effects = from_worker(router, "w1", Finished(a1, "length", 1))
    assert outcomes(effects) == [DeliverFinished("a", "length", 1)]
    assert offers(effects) == []  # b waits for capacity elsewhere
    [(_, outcome)] = [(0, o) for o in outcomes(router.handle(WorkerGone("w1", 0, "exit"), 1.0))]
    assert (outcome.request_id, outcome.kind) == ("b", "no_worker")  # type: ignore[union-attr]


def test_liveness_timer_before_expiry_rearms() -> None:
    router = Router(RouterConfig(heartbeat_timeout_s=3.0))
    beat(router, "w1", now=0.0)
    beat(router, "w1", now=2.0, seq=2)
    effects = router.handle(TimerFired(LivenessTimer("w1")), 3.0)
    assert effects == [ArmTimer(LivenessTimer("w1"), 5.0)]
    assert router.statistics().workers[0].healthy


def test_old_heartbeats_are_ignored() -> None:
    router = Router(RouterConfig(heartbeat_timeout_s=3.0))
    beat(router, "w1", now=0.0, epoch=1, seq=5)
    assert beat(router, "w1", now=1.0, epoch=1, seq=4) == []
    assert beat(router, "w1", now=1.0, epoch=0, seq=9) == []
    assert router.statistics().fenced["stale_heartbeat"] == 2


def test_client_cancel_sends_cancel_and_frees_the_slot_once() -> None:
    router, a1 = accepted(slots=1)
    from_worker(router, "w1", Token(a1, 0, 1))
    effects = router.handle(ClientCancel("a"), 1.0)
    assert cancels(effects) == [("w1", a1)]
    assert outcomes(effects) == [DeliverError("a", "cancelled", "cancelled by the client")]
    assert router.handle(ClientCancel("a"), 1.0) == []  # a second cancel is harmless
    # the slot stays counted until the worker confirms it let go
    assert router.statistics().workers[0].held == 1
    assert from_worker(router, "w1", Token(a1, 1, 2)) == []
    from_worker(router, "w1", Finished(a1, "cancelled", 1))
    assert router.statistics().workers[0].held == 0
    from_worker(router, "w1", Finished(a1, "cancelled", 1))
    assert router.statistics().workers[0].held == 0


def test_heartbeat_listing_an_unwanted_assignment_gets_it_cancelled() -> None:
    router = Router()
    beat(router, "w1")
    orphan = Assignment("ghost", 3)
    effects = beat(router, "w1", seq=2, active=(orphan,))
    assert cancels(effects) == [("w1", orphan)]


def test_queue_overflow_is_overloaded_and_queued_requests_run_when_a_slot_frees() -> None:
    router = Router(RouterConfig(queue_limit=1))
    beat(router, "w1", slots=1)
    router.handle(Submit(request("a", max_new=1)), 0)
    assert offers(router.handle(Submit(request("b")), 0)) == []
    [overloaded] = outcomes(router.handle(Submit(request("c")), 0))
    assert isinstance(overloaded, DeliverError)
    assert overloaded.kind == "overloaded"
    assert router.statistics().queued == 1
    a1 = Assignment("a", 1)
    accept(router, "w1", a1)
    from_worker(router, "w1", Token(a1, 0, 1))
    effects = from_worker(router, "w1", Finished(a1, "length", 1))
    assert outcomes(effects) == [DeliverFinished("a", "length", 1)]
    [(_, offer)] = offers(effects)
    assert offer.assignment == Assignment("b", 1)


def test_no_worker_and_too_long_requests_fail_at_once() -> None:
    router = Router()
    [none] = outcomes(router.handle(Submit(request("a")), 0))
    assert isinstance(none, DeliverError)
    assert none.kind == "no_worker"
    beat(router, "w1", max_context=16)
    [too_long] = outcomes(router.handle(Submit(request("b", max_new=20)), 0))
    assert isinstance(too_long, DeliverError)
    assert too_long.kind == "no_worker"
    assert "context" in too_long.message


def test_failed_finish_after_first_token_is_failed() -> None:
    router, a1 = accepted(workers=("w1", "w2"))
    from_worker(router, "w1", Token(a1, 0, 1))
    [outcome] = outcomes(from_worker(router, "w1", Finished(a1, "failed", 1)))
    assert isinstance(outcome, DeliverError)
    assert outcome.kind == "failed"


def test_finish_claiming_fewer_tokens_than_delivered_is_fenced() -> None:
    router, a1 = accepted(max_new=3)
    from_worker(router, "w1", Token(a1, 0, 1))
    from_worker(router, "w1", Token(a1, 1, 1))
    assert from_worker(router, "w1", Finished(a1, "eos", 1)) == []
    assert from_worker(router, "w1", Token(a1, 2, 1)) == [DeliverToken("a", 2, 1)]
    assert from_worker(router, "w1", Token(a1, 3, 1)) == []  # past max_new_tokens
    assert router.statistics().fenced["over_budget"] == 2


def test_heartbeat_without_a_cancelled_assignment_releases_its_slot() -> None:
    # The worker's Finished(cancelled) was lost; its next heartbeat still shows the truth.
    router, a1 = accepted(slots=1)
    router.handle(ClientCancel("a"), 0.1)
    assert cancels(beat(router, "w1", now=0.2, seq=2, slots=1, active=(a1,))) == [("w1", a1)]
    assert router.statistics().workers[0].held == 1
    beat(router, "w1", now=0.3, seq=3, slots=1)
    assert router.statistics().workers[0].held == 0


def test_confirmed_assignment_missing_from_heartbeats_is_lost_after_the_timeout() -> None:
    # The worker dropped an assignment and its Finished never arrived.
    router, _ = accepted(config=RouterConfig(heartbeat_timeout_s=3.0), workers=("w1", "w2"))
    assert offers(beat(router, "w1", now=1.0, seq=2)) == []  # maybe still in flight
    effects = beat(router, "w1", now=4.0, seq=3)
    [(worker, offer)] = offers(effects)
    assert (worker, offer.assignment.attempt) == ("w2", 2)


def test_a_token_run_delivers_only_what_is_missing_and_completes_a_pending_finish() -> None:
    router, a1 = accepted(max_new=5)
    from_worker(router, "w1", Token(a1, 0, 10))
    from_worker(router, "w1", Token(a1, 1, 11))
    assert from_worker(router, "w1", Finished(a1, "length", 5)) == []
    assert from_worker(router, "w1", TokenRun(a1, 3, (13, 14))) == [
        SendToWorker("w1", Resend(a1, 2))
    ]
    effects = from_worker(router, "w1", TokenRun(a1, 1, (11, 12, 13, 14)))
    assert effects == [
        DeliverToken("a", 2, 12),
        DeliverToken("a", 3, 13),
        DeliverToken("a", 4, 14),
        DisarmTimer(ProgressTimer(a1)),
        DeliverFinished("a", "length", 5),
    ]


def test_resends_are_rate_limited() -> None:
    router, a1 = accepted(config=RouterConfig(resend_interval_s=0.5))
    assert from_worker(router, "w1", Token(a1, 3, 1), now=1.0) == [
        SendToWorker("w1", Resend(a1, 0))
    ]
    assert from_worker(router, "w1", Token(a1, 4, 1), now=1.2) == []
    assert from_worker(router, "w1", Token(a1, 5, 1), now=1.5) == [
        SendToWorker("w1", Resend(a1, 0))
    ]
    assert router.statistics().resends_requested == 2


def test_missing_finished_is_asked_for_again_before_the_attempt_is_given_up() -> None:
    router, a1 = accepted(config=RouterConfig(heartbeat_timeout_s=3.0))
    from_worker(router, "w1", Token(a1, 0, 1))
    # the worker finished (no longer lists it) but its last token and Finished were lost
    assert beat(router, "w1", now=1.0, seq=2) == [SendToWorker("w1", Resend(a1, 1))]
    assert from_worker(router, "w1", TokenRun(a1, 1, (2,))) == [DeliverToken("a", 1, 2)]
    assert outcomes(from_worker(router, "w1", Finished(a1, "eos", 2))) == [
        DeliverFinished("a", "eos", 2)
    ]


def test_a_started_stream_whose_worker_is_lost_resumes_from_the_delivered_prefix() -> None:
    request_a = GenerationRequest("a", (1, 2, 3), 5, Sampling(0.8, 0.9, 42), (7,))
    router = Router(RouterConfig(max_resumes=1))
    beat(router, "w1")
    beat(router, "w2")
    router.handle(Submit(request_a), 0)
    a1 = Assignment("a", 1)
    accept(router, "w1", a1)
    from_worker(router, "w1", Token(a1, 0, 11))
    from_worker(router, "w1", Token(a1, 1, 12))
    effects = router.handle(WorkerGone("w1", 0, "reset"), 0.5)
    assert outcomes(effects) == []  # the client sees no error
    [(worker, offer)] = offers(effects)
    assert (worker, offer.assignment) == ("w2", Assignment("a", 2))
    # the same request, seed and all, with what the client already has as its prefix
    assert offer.request == replace(request_a, output_prefix=(11, 12))
    a2 = offer.assignment
    accept(router, "w2", a2, 0.6)
    assert from_worker(router, "w2", Token(a2, 1, 99)) == []  # index 1 is delivered: fenced
    delivered = [from_worker(router, "w2", Token(a2, i, 20 + i)) for i in (2, 3, 4)]
    assert [d[0] for d in delivered] == [DeliverToken("a", i, 20 + i) for i in (2, 3, 4)]
    done = from_worker(router, "w2", Finished(a2, "length", 5))
    assert outcomes(done) == [DeliverFinished("a", "length", 5)]
    stats = router.statistics()
    assert (stats.resumes, stats.retries, stats.fenced["duplicate"]) == (1, 0, 1)


def test_resumes_are_bounded_then_worker_lost() -> None:
    router = Router(RouterConfig(max_resumes=1))
    for worker in ("w1", "w2", "w3"):
        beat(router, worker)
    router.handle(Submit(request("a")), 0)
    a1 = Assignment("a", 1)
    accept(router, "w1", a1)
    from_worker(router, "w1", Token(a1, 0, 5))
    [(_, offer)] = offers(router.handle(WorkerGone("w1", 0, "reset"), 0.1))
    a2 = offer.assignment
    accept(router, offer.worker_id, a2)
    from_worker(router, offer.worker_id, Token(a2, 1, 6))
    effects = router.handle(WorkerGone(offer.worker_id, 0, "reset"), 0.2)
    assert offers(effects) == []
    [outcome] = outcomes(effects)
    assert (outcome.request_id, outcome.kind) == ("a", "worker_lost")  # type: ignore[union-attr]


def test_a_failed_decoder_after_the_first_token_is_not_resumed() -> None:
    router, a1 = accepted(workers=("w1", "w2"))
    from_worker(router, "w1", Token(a1, 0, 5))
    effects = from_worker(router, "w1", Finished(a1, "failed", 1))
    assert offers(effects) == []
    assert outcomes(effects)[0].kind == "failed"  # type: ignore[union-attr]


def test_a_stream_with_every_token_delivered_is_resumed_for_its_finish() -> None:
    router, a1 = accepted(max_new=2, workers=("w1", "w2"))
    from_worker(router, "w1", Token(a1, 0, 5))
    from_worker(router, "w1", Token(a1, 1, 6))  # the budget is spent; Finished never comes
    [(worker, offer)] = offers(router.handle(WorkerGone("w1", 0, "reset"), 0.1))
    assert offer.request.output_prefix == (5, 6)
    a2 = offer.assignment
    done = from_worker(router, worker, Finished(a2, "length", 2))  # ends at once
    assert outcomes(done) == [DeliverFinished("a", "length", 2)]


def test_a_token_run_past_the_budget_delivers_only_up_to_the_budget() -> None:
    router, a1 = accepted(max_new=2)
    effects = from_worker(router, "w1", TokenRun(a1, 0, (5, 6, 7, 8)))
    assert [e for e in effects if isinstance(e, DeliverToken)] == [
        DeliverToken("a", 0, 5),
        DeliverToken("a", 1, 6),
    ]
    assert router.statistics().fenced["over_budget"] == 1


def test_a_resumed_stream_waiting_for_a_slot_ends_worker_lost_if_no_worker_is_left() -> None:
    router = Router()
    beat(router, "w1", slots=1)
    beat(router, "w2", slots=1)
    router.handle(Submit(request("a")), 0)
    router.handle(Submit(request("b")), 0)
    a1, b1 = Assignment("a", 1), Assignment("b", 1)
    accept(router, "w1", a1)
    accept(router, "w2", b1)
    from_worker(router, "w1", Token(a1, 0, 5))
    effects = router.handle(WorkerGone("w1", 0, "reset"), 0.1)
    assert offers(effects) == [] and router.statistics().queued == 1  # w2 is full: a waits
    effects = router.handle(WorkerGone("w2", 0, "reset"), 0.2)
    kinds = {o.request_id: o.kind for o in outcomes(effects)}  # type: ignore[union-attr]
    assert kinds == {"a": "worker_lost", "b": "no_worker"}


def test_a_stream_whose_decoder_hangs_resumes_elsewhere_and_its_worker_gets_no_offers() -> None:
    config = RouterConfig(
        first_token_timeout_s=5.0, prefill_timeout_per_token_s=1.0, token_timeout_s=2.0,
        stuck_probe_s=10.0, heartbeat_timeout_s=100.0,
    )  # fmt: skip
    router, a1 = accepted(config=config, workers=("w1", "w2"))
    # the first token is due after 5 s plus 1 s for each of the 3 prompt tokens
    assert router.handle(TimerFired(ProgressTimer(a1)), 0.5) == [  # early: it re-arms
        ArmTimer(ProgressTimer(a1), 8.0)
    ]
    # the first token: the per-token deadline from now on
    assert from_worker(router, "w1", Token(a1, 0, 7), now=1.0)[1] == ArmTimer(
        ProgressTimer(a1), 3.0
    )
    from_worker(router, "w1", Token(a1, 1, 8), now=2.5)  # moves progress_by to 4.5
    assert router.handle(TimerFired(ProgressTimer(a1)), 3.0) == [ArmTimer(ProgressTimer(a1), 4.5)]
    effects = router.handle(TimerFired(ProgressTimer(a1)), 4.5)  # nothing since 2.5 s
    assert cancels(effects) == [("w1", a1)]
    [(worker, offer)] = offers(effects)
    assert worker == "w2" and offer.request.output_prefix == (7, 8)  # resumed at k = 2
    views = {v.worker_id: v for v in router.statistics().workers}
    assert not views["w1"].healthy and views["w1"].held == 1  # stuck; the slot drains
    # heartbeats are not progress: w1 stays stuck and gets nothing new
    beat(router, "w1", now=5.0, seq=2, active=(a1,))
    router.handle(Submit(request("b")), 5.0)
    assert router.placement("b") == ("w2", Assignment("b", 1))
    # after stuck_probe_s a heartbeat gives it another chance
    beat(router, "w1", now=14.6, seq=3)
    assert {v.worker_id for v in router.statistics().workers if v.healthy} == {"w1", "w2"}


def test_epochs_are_handed_out_and_a_heartbeat_from_the_future_changes_nothing() -> None:
    router = Router(RouterConfig())
    [first] = router.handle(RegisterWorker("w1"), 0.0)
    assert first == Registration("w1", 0)
    beat(router, "w1", epoch=0)
    router.handle(Submit(request("a")), 0.0)
    # a second process under the live id is refused, and nothing changes
    [refused] = router.handle(RegisterWorker("w1"), 0.1)
    assert refused.epoch is None and "w1" in refused.reason
    # a heartbeat naming an epoch never handed out (a clock ahead) is fenced
    assert beat(router, "w1", now=0.2, epoch=1_000, seq=1) == []
    assert router.statistics().fenced["unknown_epoch"] == 1
    assert router.worker_clock("w1") == (0, 1, True) and router.holders("a") == ["w1"]
    # a takeover marks the old epoch gone (its attempt fails over) and hands out the next
    effects = router.handle(RegisterWorker("w1", takeover=True), 0.3)
    assert effects[-1] == Registration("w1", 1)
    assert router.worker_clock("w1") == (0, 1, False)
    beat(router, "w1", now=0.4, epoch=1)
    assert router.worker_clock("w1") == (1, 1, True)


def test_logprob_records_are_delivered_with_their_tokens_from_tokens_and_runs() -> None:
    router, a1 = accepted(max_new=4)
    records = [TokenLogprob(-0.1 * (i + 1), ((i, -0.05),)) for i in range(4)]
    assert [e for e in from_worker(router, "w1", Token(a1, 0, 10, records[0]))
            if isinstance(e, DeliverToken)] == [DeliverToken("a", 0, 10, records[0])]  # fmt: skip
    from_worker(router, "w1", Token(a1, 2, 12, records[2]))  # a gap: dropped, record and all
    run = TokenRun(a1, 0, (10, 11, 12), tuple(records[:3]))
    effects = from_worker(router, "w1", run)
    assert [e for e in effects if isinstance(e, DeliverToken)] == [
        DeliverToken("a", 1, 11, records[1]),
        DeliverToken("a", 2, 12, records[2]),
    ]


# --- handoff: a draining worker gives its streams back (core/requests.py) ---


def _streaming_on_one_of_two() -> tuple[Router, str, str, Assignment]:
    """A stream with 3 tokens delivered on one worker; another worker has a free slot."""
    router = Router(RouterConfig())
    beat(router, "w1")
    beat(router, "w2")
    [(first, offer)] = offers(router.handle(Submit(request("r", max_new=8)), 0.1))
    a1 = offer.assignment
    router.handle(FromWorkerMessage(first, OfferResult(first, 0, a1, True)), 0.2)
    for index in range(3):
        router.handle(FromWorkerMessage(first, Token(a1, index, 10 + index)), 0.3)
    return router, first, "w2" if first == "w1" else "w1", a1


def _hand_off(router: Router, worker: str, *assignments: Assignment) -> list[RouterEffect]:
    beat(router, worker, 0.4, seq=2, slots=0, active=assignments, free=0)  # draining
    return router.handle(FromWorkerMessage(worker, HandOff(worker, 0, assignments)), 0.4)


def delivered(effects: list[RouterEffect]) -> list[tuple[int, int]]:
    return [(e.index, e.token_id) for e in effects if isinstance(e, DeliverToken)]


def test_a_handed_off_stream_goes_on_elsewhere_and_the_old_attempt_ends_on_acceptance() -> None:
    router, first, other, a1 = _streaming_on_one_of_two()
    effects = _hand_off(router, first, a1)
    [(to, offer)] = offers(effects)
    a2 = offer.assignment
    assert to == other and a2.attempt == 2 and offer.request.output_prefix == (10, 11, 12)
    assert not cancels(effects)  # the old attempt decodes on until the new one is accepted
    assert router.handed_off("r") == (first, a1) and router.wants(first, a1)
    # its tokens no longer reach the client: only the continuation's do
    assert not delivered(router.handle(FromWorkerMessage(first, Token(a1, 3, 13)), 0.5))
    assert router.statistics().fenced["stale_attempt"] == 1
    accepted = router.handle(FromWorkerMessage(other, OfferResult(other, 0, a2, True)), 0.6)
    assert cancels(accepted) == [(first, a1)] and router.handed_off("r") is None
    assert delivered(router.handle(FromWorkerMessage(other, Token(a2, 3, 13)), 0.7)) == [(3, 13)]
    stats = router.statistics()
    assert (stats.handoffs, stats.handoffs_back, stats.resumes) == (1, 0, 0)
    # a repeated HandOff for the attempt already handed off changes nothing
    assert not offers(_hand_off(router, first, a1))


def test_a_continuation_that_fails_before_acceptance_goes_back_to_the_old_attempt() -> None:
    router, first, other, a1 = _streaming_on_one_of_two()
    [(_, offer)] = offers(_hand_off(router, first, a1))
    router.handle(FromWorkerMessage(first, Token(a1, 3, 13)), 0.5)  # fenced meanwhile
    declined = OfferResult(other, 0, offer.assignment, False, "no_slot")
    back = router.handle(FromWorkerMessage(other, declined), 0.6)
    resends = [e.message for e in back if isinstance(e, SendToWorker)]
    assert resends == [Resend(a1, 3)]  # what the fence dropped, asked for again
    assert router.placement("r") == (first, a1) and router.statistics().handoffs_back == 1
    run = TokenRun(a1, 3, (13, 14))
    assert delivered(router.handle(FromWorkerMessage(first, run), 0.7)) == [(3, 13), (4, 14)]


def test_a_stream_nobody_else_can_take_stays_and_a_stale_handoff_is_fenced() -> None:
    router, first, other, a1 = _streaming_on_one_of_two()
    beat(router, other, 0.35, seq=2, slots=0, free=0)  # the other is draining too
    assert not offers(_hand_off(router, first, a1)) and router.placement("r") == (first, a1)
    assert delivered(router.handle(FromWorkerMessage(first, Token(a1, 3, 13)), 0.5)) == [(3, 13)]
    stale = HandOff(first, 7, (a1,))  # an epoch the router never handed out
    assert not router.handle(FromWorkerMessage(first, stale), 0.6)
    assert router.statistics().fenced["stale_handoff"] == 1


def test_a_client_cancel_during_a_handoff_cancels_both_attempts() -> None:
    router, first, other, a1 = _streaming_on_one_of_two()
    [(_, offer)] = offers(_hand_off(router, first, a1))
    effects = router.handle(ClientCancel("r"), 0.5)
    assert sorted(cancels(effects)) == sorted([(first, a1), (other, offer.assignment)])
    assert router.handed_off("r") is None and router.holders("r") == []
