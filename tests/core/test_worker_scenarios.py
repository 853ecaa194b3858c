"""Worker scenarios, driven only through Worker.handle."""

from __future__ import annotations

from core.protocol import (
    ArmTimer,
    Assignment,
    Cancel,
    Decoded,
    DecodeDone,
    DecoderFailed,
    Drain,
    Finished,
    FromRouterMessage,
    GenerationRequest,
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
    WorkerEffect,
    WorkerStart,
)
from core.worker import Worker, WorkerConfig


def make(slots: int = 2, max_context: int = 64, epoch: int = 3) -> Worker:
    return Worker(WorkerConfig("w1", epoch=epoch, slots=slots, max_context=max_context))


def offer(worker: Worker, rid: str, attempt: int = 1, max_new: int = 4, **kw: object) -> list:
    fields = {"worker_id": "w1", "epoch": worker.config.epoch} | kw
    request = GenerationRequest(rid, (1, 2, 3), max_new)
    message = Offer(assignment=Assignment(rid, attempt), request=request, **fields)  # type: ignore[arg-type]
    return worker.handle(FromRouterMessage(message), 0.0)


def sent(effects: list[WorkerEffect]) -> list:
    return [e.message for e in effects if isinstance(e, SendToRouter)]


def answer(effects: list[WorkerEffect]) -> OfferResult:
    [result] = [m for m in sent(effects) if isinstance(m, OfferResult)]
    return result


def test_accepted_offer_starts_decoding() -> None:
    worker = make()
    effects = offer(worker, "a")
    assert answer(effects).accepted
    assert any(isinstance(e, StartDecode) for e in effects)
    assert worker.free_slots == 1


def test_duplicate_offer_gets_the_same_answer_and_no_second_slot() -> None:
    worker = make()
    first = answer(offer(worker, "a"))
    again = offer(worker, "a")
    assert answer(again) == first
    assert not any(isinstance(e, StartDecode) for e in again)
    assert worker.free_slots == 1


def test_offers_for_another_worker_or_epoch_are_declined() -> None:
    worker = make(epoch=3)
    assert answer(offer(worker, "a", worker_id="w9")).reason == "wrong_worker"
    assert answer(offer(worker, "b", epoch=2)).reason == "stale_epoch"
    assert worker.free_slots == 2


def test_admission_checks_slots_and_context() -> None:
    worker = make(slots=1, max_context=10)
    assert answer(offer(worker, "long", max_new=8)).reason == "context_length"
    assert answer(offer(worker, "a", max_new=4)).accepted
    assert answer(offer(worker, "b", max_new=4)).reason == "no_slot"


def test_only_the_next_index_of_an_active_assignment_goes_out() -> None:
    worker = make()
    offer(worker, "a")
    a1 = Assignment("a", 1)
    # The attempt's first token says after which heartbeat it was taken (none yet: 0).
    assert sent(worker.handle(Decoded(a1, 0, 10), 0)) == [Token(a1, 0, 10, taken_after=0)]
    assert sent(worker.handle(Decoded(a1, 0, 10), 0)) == []
    assert sent(worker.handle(Decoded(a1, 1, 11), 0)) == [Token(a1, 1, 11)]
    assert worker.statistics().fenced == {"duplicate": 1}


def test_a_decoder_that_skips_an_index_is_stopped_and_its_output_fails() -> None:
    """The token at the skipped index can never reach the client: finishing the output
    (short, as eos or length) would be a lie, so the worker stops it and fails it."""
    worker = make()
    offer(worker, "a")
    a1 = Assignment("a", 1)
    worker.handle(Decoded(a1, 0, 10), 0)
    effects = worker.handle(Decoded(a1, 2, 12), 0)
    assert StopDecode(a1) in effects
    assert sent(effects) == [Finished(a1, "failed", 1)]
    assert worker.free_slots == 2
    assert sent(worker.handle(Decoded(a1, 1, 11), 0)) == []  # late: it has ended
    assert sent(worker.handle(DecodeDone(a1, "eos"), 0)) == []
    assert worker.statistics().fenced == {"gap": 1, "late_token": 1, "late_finish": 1}


def test_cancel_frees_the_slot_exactly_once_in_any_order() -> None:
    worker = make()
    offer(worker, "a")
    a1 = Assignment("a", 1)
    worker.handle(Decoded(a1, 0, 10), 0)
    effects = worker.handle(FromRouterMessage(Cancel(a1)), 0)
    assert StopDecode(a1) in effects
    assert sent(effects) == [Finished(a1, "cancelled", 1)]
    assert worker.free_slots == 2
    # everything after the cancel is late and changes nothing
    assert worker.handle(FromRouterMessage(Cancel(a1)), 0) == []
    assert worker.handle(Decoded(a1, 1, 11), 0) == []
    assert worker.handle(DecodeDone(a1, "eos"), 0) == []
    assert worker.handle(DecoderFailed(), 0) == []
    assert worker.free_slots == 2


def test_finish_then_cancel_frees_once() -> None:
    worker = make()
    offer(worker, "a")
    a1 = Assignment("a", 1)
    worker.handle(Decoded(a1, 0, 10), 0)
    assert sent(worker.handle(DecodeDone(a1, "eos"), 0)) == [Finished(a1, "eos", 1)]
    assert worker.handle(FromRouterMessage(Cancel(a1)), 0) == []
    assert worker.free_slots == 2


def test_cancel_that_overtakes_its_offer_makes_the_offer_declined() -> None:
    worker = make()
    worker.handle(FromRouterMessage(Cancel(Assignment("a", 1))), 0)
    assert answer(offer(worker, "a")).reason == "cancelled"
    assert worker.free_slots == 2


def test_newer_attempt_replaces_the_old_one_and_older_is_declined() -> None:
    worker = make()
    offer(worker, "a", attempt=2)
    effects = offer(worker, "a", attempt=3)
    assert Finished(Assignment("a", 2), "cancelled", 0) in sent(effects)
    assert answer(effects).accepted
    assert answer(offer(worker, "a", attempt=1)).reason == "stale_attempt"
    assert worker.free_slots == 1


def test_decoder_failure_ends_every_assignment() -> None:
    worker = make()
    offer(worker, "a")
    offer(worker, "b")
    effects = worker.handle(DecoderFailed("cuda error"), 0)
    assert sorted(m.assignment.request_id for m in sent(effects)) == ["a", "b"]
    assert all(isinstance(m, Finished) and m.reason == "failed" for m in sent(effects))
    assert worker.free_slots == 2


def test_drain_declines_new_offers_and_lets_active_ones_finish() -> None:
    worker = make(slots=2, max_context=64, epoch=3)
    offer(worker, "a", max_new=1)
    [hb] = sent(worker.handle(Drain(handoff=False), 1.0))
    assert hb == Heartbeat("w1", 3, 1, 0, 0, 64, (Assignment("a", 1),))
    assert answer(offer(worker, "b")).reason == "no_slot"
    a1 = Assignment("a", 1)
    assert sent(worker.handle(Decoded(a1, 0, 9), 1.1)) == [Token(a1, 0, 9, taken_after=0)]
    assert sent(worker.handle(DecodeDone(a1, "length"), 1.1)) == [Finished(a1, "length", 1)]
    assert list(worker.holds()) == []


def test_drain_with_handoff_gives_each_router_its_own_assignments_until_cancelled() -> None:
    worker = shared(slots=3)
    offer_from(worker, "ra", "q1")
    offer_from(worker, "rb", "q1")
    offer_from(worker, "rb", "q2")
    given = [(r, m) for r, m in routed(worker.handle(Drain(), 1.0)) if isinstance(m, HandOff)]
    assert given == [
        ("ra", HandOff("w1", 5, (Assignment("q1", 1, "ra"),))),
        ("rb", HandOff("w1", 0, (Assignment("q1", 1, "rb"), Assignment("q2", 1, "rb")))),
    ]
    assert not answer(offer_from(worker, "ra", "q3")).accepted  # draining: no new work
    # it decodes on until a router cancels: what it holds is given back again each beat
    assert worker.handle(Decoded(Assignment("q1", 1, "ra"), 0, 7), 1.1)
    worker.handle(FromRouterMessage(Cancel(Assignment("q1", 1, "rb")), "rb"), 1.2)
    again = [(r, m) for r, m in routed(worker.handle(TimerFired(HeartbeatTimer()), 1.5))
             if isinstance(m, HandOff)]  # fmt: skip
    assert [(r, m.assignments) for r, m in again] == [
        ("ra", (Assignment("q1", 1, "ra"),)),
        ("rb", (Assignment("q2", 1, "rb"),)),
    ]
    for router, rid in (("ra", "q1"), ("rb", "q2")):
        worker.handle(FromRouterMessage(Cancel(Assignment(rid, 1, router)), router), 1.6)
    quiet = routed(worker.handle(TimerFired(HeartbeatTimer()), 2.0))
    assert not [m for _, m in quiet if isinstance(m, HandOff)] and not list(worker.holds())


def test_heartbeats_carry_epoch_sequence_capacity_and_assignments() -> None:
    worker = make(slots=2, max_context=64, epoch=3)
    first = worker.handle(WorkerStart(), 1.0)
    assert ArmTimer(HeartbeatTimer(), 1.5) in first
    offer(worker, "a")
    [hb] = sent(worker.handle(TimerFired(HeartbeatTimer()), 1.5))
    assert hb == Heartbeat("w1", 3, 2, 2, 1, 64, (Assignment("a", 1),))


def test_resend_repeats_the_tokens_and_the_finish_as_one_run() -> None:
    worker = make()
    offer(worker, "a")
    a1 = Assignment("a", 1)
    for index, token in enumerate((10, 11, 12)):
        worker.handle(Decoded(a1, index, token), 0)
    assert sent(worker.handle(FromRouterMessage(Resend(a1, 1)), 0)) == [TokenRun(a1, 1, (11, 12))]
    worker.handle(DecodeDone(a1, "eos"), 0)
    assert sent(worker.handle(FromRouterMessage(Resend(a1, 3)), 0)) == [Finished(a1, "eos", 3)]
    assert sent(worker.handle(FromRouterMessage(Resend(a1, 0)), 0)) == [
        TokenRun(a1, 0, (10, 11, 12), taken_after=0),  # from its first token: says when taken
        Finished(a1, "eos", 3),
    ]
    assert worker.free_slots == 2
    assert worker.handle(FromRouterMessage(Resend(Assignment("zz", 1), 0)), 0) == []


def test_a_continuation_starts_at_the_index_after_its_prefix() -> None:
    worker = make()
    request = GenerationRequest("a", (1, 2, 3), 6, output_prefix=(10, 11, 12))
    effects = worker.handle(FromRouterMessage(Offer("w1", 3, Assignment("a", 2), request)), 0)
    assert StartDecode(Assignment("a", 2), request) in effects
    a2 = Assignment("a", 2)
    assert sent(worker.handle(Decoded(a2, 0, 10), 0)) == []  # the prefix is not sent again
    assert sent(worker.handle(Decoded(a2, 3, 13), 0)) == [Token(a2, 3, 13, taken_after=0)]
    assert sent(worker.handle(DecodeDone(a2, "eos"), 0)) == [Finished(a2, "eos", 4)]


def test_logprob_records_go_with_their_tokens_and_a_resend_repeats_them() -> None:
    worker = make()
    request = GenerationRequest("a", (1, 2, 3), 6, output_prefix=(10, 11), logprobs=1)
    a2 = Assignment("a", 2)
    worker.handle(FromRouterMessage(Offer("w1", 3, a2, request)), 0)
    records = [TokenLogprob(-0.5 * i, ((5, -0.1),)) for i in range(3)]
    for index, (token, record) in enumerate(zip((12, 13, 14), records, strict=True)):
        assert sent(worker.handle(Decoded(a2, 2 + index, token, record), 0)) == [
            Token(a2, 2 + index, token, record, 0 if index == 0 else None)
        ]
    # The prefix's records are the router's business: a run starts after the prefix.
    assert sent(worker.handle(FromRouterMessage(Resend(a2, 3)), 0)) == [
        TokenRun(a2, 3, (13, 14), tuple(records[1:]))
    ]
    assert sent(worker.handle(FromRouterMessage(Resend(a2, 0)), 0)) == [
        TokenRun(a2, 2, (12, 13, 14), tuple(records), 0)
    ]
    worker.handle(DecodeDone(a2, "eos"), 0)
    assert sent(worker.handle(FromRouterMessage(Resend(a2, 4)), 0)) == [
        TokenRun(a2, 4, (14,), (records[2],)),
        Finished(a2, "eos", 5),
    ]


def test_a_token_without_the_record_its_request_asks_for_fails_the_assignment() -> None:
    worker = make()
    a1 = Assignment("a", 1)
    request = GenerationRequest("a", (1, 2, 3), 4, logprobs=0)
    worker.handle(FromRouterMessage(Offer("w1", 3, a1, request)), 0)
    effects = worker.handle(Decoded(a1, 0, 10), 0)
    assert StopDecode(a1) in effects
    assert sent(effects) == [Finished(a1, "failed", 0)]
    assert worker.statistics().fenced == {"missing_logprob": 1}


# --- several routers sharing one worker ---


def shared(slots: int = 2) -> Worker:
    """A worker with no link of its own, linked to routers ra (epoch 5) and rb (epoch 0)."""
    worker = Worker(WorkerConfig("w1", slots=slots, router=None))
    worker.handle(RouterLinked("ra", 5), 0.0)
    worker.handle(RouterLinked("rb", 0), 0.0)
    return worker


def offer_from(worker: Worker, router: str, rid: str, attempt: int = 1, epoch: int | None = None):
    epoch = worker.links()[router] if epoch is None else epoch
    request = GenerationRequest(rid, (1, 2, 3), 4)
    message = Offer("w1", epoch, Assignment(rid, attempt, router), request)
    return worker.handle(FromRouterMessage(message, router), 0.0)


def routed(effects: list[WorkerEffect]) -> list[tuple[str, object]]:
    return [(e.router_id, e.message) for e in effects if isinstance(e, SendToRouter)]


def test_a_new_link_gets_a_heartbeat_at_once_under_its_own_epoch() -> None:
    worker = Worker(WorkerConfig("w1", slots=2, router=None))
    assert not routed(worker.handle(WorkerStart(), 0.0))  # no router yet: nobody to tell
    [(router, beat)] = routed(worker.handle(RouterLinked("ra", 7), 0.0))
    assert router == "ra" and isinstance(beat, Heartbeat) and beat.epoch == 7


def test_offers_of_several_routers_compete_for_the_same_slots() -> None:
    worker = shared(slots=2)
    assert answer(offer_from(worker, "ra", "q1")).accepted
    assert answer(offer_from(worker, "rb", "q1")).accepted  # same id, another request
    full = answer(offer_from(worker, "rb", "q2"))
    assert not full.accepted and full.reason == "no_slot" and full.epoch == 0
    assert worker.free_slots == 0


def test_each_router_hears_its_own_heartbeat_with_its_own_work_and_every_free_slot() -> None:
    worker = shared(slots=3)
    offer_from(worker, "ra", "q1")
    offer_from(worker, "rb", "q1")
    beats = dict(routed(worker.handle(TimerFired(HeartbeatTimer()), 1.0)))
    a, b = beats["ra"], beats["rb"]
    assert isinstance(a, Heartbeat) and isinstance(b, Heartbeat)
    assert (a.epoch, a.active, a.free_slots) == (5, (Assignment("q1", 1, "ra"),), 1)
    assert (b.epoch, b.active, b.free_slots) == (0, (Assignment("q1", 1, "rb"),), 1)
    assert a.seq == b.seq == 2  # each link counts its own (the link's first went at once)


def test_a_router_acts_only_on_its_own_assignments() -> None:
    worker = shared()
    offer_from(worker, "ra", "q1")
    theirs = Assignment("q1", 1, "ra")
    # rb names ra's assignment: nothing happens to it, and the offer is answered no.
    assert worker.handle(FromRouterMessage(Cancel(theirs), "rb"), 0.0) == []
    assert worker.handle(FromRouterMessage(Resend(theirs, 0), "rb"), 0.0) == []
    request = GenerationRequest("q1", (1, 2, 3), 4)
    effects = worker.handle(FromRouterMessage(Offer("w1", 0, theirs, request), "rb"), 0.0)
    [(to, result)] = routed(effects)
    assert to == "rb" and isinstance(result, OfferResult) and result.reason == "wrong_router"
    assert theirs in worker.holds()
    assert worker.statistics().fenced["foreign_assignment"] == 3
    # rb's newer attempt of its own q1 does not supersede ra's q1 either.
    assert answer(offer_from(worker, "rb", "q1", attempt=2)).accepted
    assert theirs in worker.holds()


def test_losing_a_link_ends_that_routers_work_only_and_quietly() -> None:
    worker = shared(slots=3)
    offer_from(worker, "ra", "q1")
    offer_from(worker, "ra", "q2")
    offer_from(worker, "rb", "q1")
    effects = worker.handle(RouterUnlinked("ra", "connection reset"), 0.0)
    stopped = {e.assignment for e in effects if isinstance(e, StopDecode)}
    assert stopped == {Assignment("q1", 1, "ra"), Assignment("q2", 1, "ra")}
    assert not routed(effects)  # nobody is left to hear about ra's work
    assert set(worker.holds()) == {Assignment("q1", 1, "rb")}
    assert worker.links() == {"rb": 0}
    # ra's late frames find no link; rb's decoder output still flows.
    assert offer_from(worker, "ra", "q3", epoch=5) == []
    assert worker.statistics().fenced["unlinked"] == 1
    token = worker.handle(Decoded(Assignment("q1", 1, "rb"), 0, 42), 0.0)
    assert routed(token) == [("rb", Token(Assignment("q1", 1, "rb"), 0, 42, taken_after=1))]
    assert worker.handle(Decoded(Assignment("q1", 1, "ra"), 0, 42), 0.0) == []


def test_a_router_that_registers_the_worker_again_starts_a_new_link() -> None:
    worker = shared()
    offer_from(worker, "ra", "q1")
    effects = worker.handle(RouterLinked("ra", 6), 0.0)
    assert StopDecode(Assignment("q1", 1, "ra")) in effects
    [(to, beat)] = routed(effects)
    assert to == "ra" and isinstance(beat, Heartbeat) and (beat.epoch, beat.active) == (6, ())
    assert answer(offer_from(worker, "ra", "q1", epoch=5)).reason == "stale_epoch"
