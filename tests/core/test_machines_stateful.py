"""hypothesis explores (state, input) pairs of each machine, and of a whole cluster.

Each state machine below keeps its own model of what a client or the router
must observe, built only from the effects the machines return, and checks the
contract's invariants after every step.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core.config import RouterConfig
from core.protocol import (
    ArmTimer,
    Assignment,
    Cancel,
    ClientCancel,
    Decoded,
    DecodeDone,
    DecoderFailed,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    DisarmTimer,
    Finished,
    FromRouterMessage,
    FromWorkerMessage,
    GenerationRequest,
    Heartbeat,
    HeartbeatTimer,
    Offer,
    OfferResult,
    Resend,
    RouterEffect,
    SendToRouter,
    SendToWorker,
    StartDecode,
    StopDecode,
    Submit,
    TimerFired,
    TimerKey,
    Token,
    TokenRun,
    WorkerEffect,
)
from core.router import Router
from core.worker import Worker, WorkerConfig
from sim.cluster import Cluster

SETTINGS = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
WORKERS = ("w1", "w2", "w3")
SLOTS = 2


class RouterAlone(RuleBasedStateMachine):
    """The test plays clients and (sometimes misbehaving) workers around one Router."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(RouterConfig(offer_timeout_s=1.0, heartbeat_timeout_s=2.0))
        self.now = 0.0
        self.timers: dict[TimerKey, float] = {}
        self.next_id = 0
        self.submitted: dict[str, GenerationRequest] = {}
        self.offered: dict[Assignment, str] = {}
        self.latest: dict[str, Assignment] = {}
        self.delivered: dict[str, list[int]] = defaultdict(list)
        self.terminal: dict[str, DeliverFinished | DeliverError] = {}
        self.epochs = dict.fromkeys(WORKERS, 0)
        self.seqs = dict.fromkeys(WORKERS, 0)

    def run(self, event: object, cause: object = None) -> list[RouterEffect]:
        effects = self.router.handle(event, self.now)  # type: ignore[arg-type]
        for effect in effects:
            self.observe(effect, cause)
        return effects

    def observe(self, effect: RouterEffect, cause: object) -> None:
        match effect:
            case ArmTimer(key, deadline):
                self.timers[key] = deadline
            case DisarmTimer(key):
                self.timers.pop(key, None)
            case SendToWorker(worker_id, Offer() as offer):
                rid = offer.assignment.request_id
                assert rid not in self.terminal, "offer for a finished request"
                previous = self.latest.get(rid)
                assert previous is None or offer.assignment.attempt > previous.attempt
                assert offer.worker_id == worker_id and offer.epoch == self.epochs[worker_id]
                self.offered[offer.assignment] = worker_id
                self.latest[rid] = offer.assignment
            case DeliverToken(rid, index, token_id):
                assert rid not in self.terminal, "token after the terminal outcome"
                assert index == len(self.delivered[rid]), "out-of-order delivery"
                assert isinstance(cause, Token | TokenRun), "a token delivered without output"
                assert cause.assignment == self.latest[rid], "a stale attempt's token delivered"
                if isinstance(cause, Token):
                    assert (cause.index, cause.token_id) == (index, token_id)
                else:
                    assert cause.token_ids[index - cause.start_index] == token_id
                self.delivered[rid].append(token_id)
        if isinstance(effect, DeliverFinished | DeliverError):
            rid = effect.request_id
            assert rid not in self.terminal, "a second terminal outcome"
            self.terminal[rid] = effect
            if isinstance(effect, DeliverFinished):
                assert effect.completion_tokens == len(self.delivered[rid])
                assert isinstance(cause, Token | TokenRun | Finished), "completed without output"
                assert cause.assignment == self.latest[rid], "a stale attempt completed it"

    @initialize()
    def register_workers(self) -> None:
        for worker in WORKERS:
            self.heartbeat_from(worker)

    def heartbeat_from(self, worker: str, restart: bool = False, stale: bool = False) -> None:
        if restart:
            self.epochs[worker] += 1
            self.seqs[worker] = 0
        self.seqs[worker] += 1
        seq = self.seqs[worker] - 2 if stale else self.seqs[worker]
        held = tuple(a for a, w in self.offered.items() if w == worker)[:SLOTS]
        hb = Heartbeat(worker, self.epochs[worker], max(seq, 0), SLOTS, 0, 4096, held)
        self.run(FromWorkerMessage(worker, hb))

    @rule(max_new=st.integers(1, 4))
    def submit(self, max_new: int) -> None:
        self.next_id += 1
        request = GenerationRequest(f"r{self.next_id}", (1, 2, 3), max_new)
        self.submitted[request.request_id] = request
        self.run(Submit(request))

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if self.submitted:
            rid = data.draw(st.sampled_from(sorted(self.submitted)))
            self.run(ClientCancel(rid))

    @rule(worker=st.sampled_from(WORKERS), restart=st.booleans(), stale=st.booleans())
    def heartbeat(self, worker: str, restart: bool, stale: bool) -> None:
        self.heartbeat_from(worker, restart=restart, stale=stale)

    def pick_assignment(self, data: st.DataObject) -> tuple[Assignment, str]:
        assignment = data.draw(st.sampled_from(sorted(self.offered, key=repr)))
        honest = self.offered[assignment]
        worker = data.draw(st.sampled_from([honest, honest, honest, *WORKERS]))
        return assignment, worker

    @precondition(lambda self: self.offered)
    @rule(data=st.data(), accepted=st.booleans())
    def offer_result(self, data: st.DataObject, accepted: bool) -> None:
        assignment, worker = self.pick_assignment(data)
        result = OfferResult(worker, self.epochs[worker], assignment, accepted, None)
        self.run(FromWorkerMessage(worker, result), result)

    @precondition(lambda self: self.offered)
    @rule(data=st.data(), index=st.integers(0, 5), token=st.integers(0, 9))
    def token(self, data: st.DataObject, index: int, token: int) -> None:
        assignment, worker = self.pick_assignment(data)
        message = Token(assignment, index, token)
        self.run(FromWorkerMessage(worker, message), message)

    @precondition(lambda self: self.offered)
    @rule(data=st.data(), start=st.integers(0, 5), length=st.integers(0, 4))
    def token_run(self, data: st.DataObject, start: int, length: int) -> None:
        assignment, worker = self.pick_assignment(data)
        message = TokenRun(assignment, start, tuple(range(start, start + length)))
        self.run(FromWorkerMessage(worker, message), message)

    @precondition(lambda self: self.offered)
    @rule(
        data=st.data(),
        reason=st.sampled_from(["eos", "length", "failed", "cancelled"]),
        count=st.integers(0, 5),
    )
    def finished(self, data: st.DataObject, reason: str, count: int) -> None:
        assignment, worker = self.pick_assignment(data)
        message = Finished(assignment, reason, count)  # type: ignore[arg-type]
        self.run(FromWorkerMessage(worker, message), message)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        self.now += dt
        for key, deadline in sorted(self.timers.items(), key=lambda kv: kv[1]):
            if deadline <= self.now and self.timers.get(key) == deadline:
                del self.timers[key]
                self.run(TimerFired(key))

    @invariant()
    def every_request_is_tracked_or_terminal(self) -> None:
        stats = self.router.statistics()
        live = len(self.submitted) - len(self.terminal)
        assert sum(stats.requests_by_phase.values()) == live
        for view in stats.workers:
            assert view.held <= view.slots, f"{view.worker_id} over-committed"


class WorkerAlone(RuleBasedStateMachine):
    """The test plays a (sometimes confused) router and the decoder around one Worker."""

    def __init__(self) -> None:
        super().__init__()
        self.worker = Worker(WorkerConfig("w1", epoch=2, slots=SLOTS, max_context=64))
        self.started: set[Assignment] = set()
        self.finished: dict[Assignment, Finished] = {}
        self.sent_tokens: dict[Assignment, list[int]] = defaultdict(list)
        self.answers: dict[Assignment, OfferResult] = {}

    def run(self, event: object) -> list[WorkerEffect]:
        effects = self.worker.handle(event, 0.0)  # type: ignore[arg-type]
        resend = isinstance(event, FromRouterMessage) and isinstance(event.message, Resend)
        for effect in effects:
            match effect:
                case SendToRouter(TokenRun(assignment, start, token_ids)):
                    assert resend, "a token run that nobody asked for"
                    assert list(token_ids) == self.sent_tokens[assignment][start:]
                case SendToRouter(Finished() as again) if resend:
                    assert self.finished[again.assignment] == again, "a resent Finished changed"
                case StartDecode(assignment, _):
                    assert assignment not in self.started, "decoding started twice"
                    self.started.add(assignment)
                case SendToRouter(Token(assignment, index, token_id)):
                    assert assignment in self.started and assignment not in self.finished
                    assert index == len(self.sent_tokens[assignment]), "token index skipped"
                    self.sent_tokens[assignment].append(token_id)
                case SendToRouter(Finished(assignment, _, count) as done):
                    assert assignment in self.started, "finished an assignment never started"
                    assert assignment not in self.finished, "a slot freed twice"
                    assert count == len(self.sent_tokens[assignment])
                    self.finished[assignment] = done
                case SendToRouter(OfferResult() as result):
                    first = self.answers.setdefault(result.assignment, result)
                    assert result == first, "a duplicate offer got another answer"
        for effect in effects:
            if isinstance(effect, StopDecode):
                assert effect.assignment in self.finished, "stopped without a Finished"
        return effects

    assignments = st.builds(Assignment, st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 3))

    @rule(
        assignment=assignments,
        worker_id=st.sampled_from(["w1", "w1", "w1", "w2"]),
        epoch=st.sampled_from([2, 2, 2, 1]),
        max_new=st.integers(1, 70),
    )
    def offer(self, assignment: Assignment, worker_id: str, epoch: int, max_new: int) -> None:
        request = GenerationRequest(assignment.request_id, (1, 2), max_new)
        self.run(FromRouterMessage(Offer(worker_id, epoch, assignment, request)))

    @rule(assignment=assignments)
    def cancel(self, assignment: Assignment) -> None:
        self.run(FromRouterMessage(Cancel(assignment)))

    @rule(assignment=assignments, index=st.integers(0, 6))
    def decoded(self, assignment: Assignment, index: int) -> None:
        self.run(Decoded(assignment, index, 100 * assignment.attempt + index))

    @rule(assignment=assignments, from_index=st.integers(0, 7))
    def resend(self, assignment: Assignment, from_index: int) -> None:
        self.run(FromRouterMessage(Resend(assignment, from_index)))

    @rule(assignment=assignments, reason=st.sampled_from(["eos", "length", "failed"]))
    def decode_done(self, assignment: Assignment, reason: str) -> None:
        self.run(DecodeDone(assignment, reason))  # type: ignore[arg-type]

    @rule()
    def decoder_failed(self) -> None:
        self.run(DecoderFailed("boom"))

    @rule()
    def heartbeat(self) -> None:
        [send, _] = self.run(TimerFired(HeartbeatTimer()))
        assert isinstance(send, SendToRouter) and isinstance(send.message, Heartbeat)
        assert set(send.message.active) == self.started - set(self.finished)

    @invariant()
    def slots_are_never_over_committed(self) -> None:
        active = len(self.started) - len(self.finished)
        assert 0 <= self.worker.free_slots == SLOTS - active


class ClusterOnFaultyLink(RuleBasedStateMachine):
    """Router and workers joined by a link that duplicates, reorders and delays."""

    def __init__(self) -> None:
        super().__init__()
        config = RouterConfig(offer_timeout_s=1.0, heartbeat_timeout_s=1.5, max_attempts=4)
        self.cluster = Cluster(list(WORKERS), config, slots=SLOTS, heartbeat_interval_s=0.5)
        self.next_id = 0

    @rule(max_new=st.integers(1, 6), seed=st.integers(0, 3))
    def submit(self, max_new: int, seed: int) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        self.cluster.submit(GenerationRequest(rid, (seed, 5, 9), max_new))

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        unfinished = self.cluster.unfinished()
        if unfinished:
            self.cluster.cancel(data.draw(st.sampled_from(unfinished)))

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        if self.cluster.in_flight:
            position = data.draw(st.integers(0, len(self.cluster.in_flight) - 1))
            self.cluster.deliver(position)

    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        if self.cluster.in_flight:
            self.cluster.duplicate(data.draw(st.integers(0, len(self.cluster.in_flight) - 1)))

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        running = self.cluster.decoders.running()
        if running:
            self.cluster.decoders.step(*data.draw(st.sampled_from(running)))

    @rule(dt=st.sampled_from([0.2, 0.6, 1.6]))
    def advance(self, dt: float) -> None:
        self.cluster.advance(self.cluster.now + dt)

    @rule(worker=st.sampled_from(WORKERS))
    def crash_and_restart(self, worker: str) -> None:
        self.cluster.crash_worker(worker)
        # Refused while the router still takes the old process for live: it stays
        # down and registers again later (teardown), as a real worker retries.
        self.cluster.restart_worker(worker)

    @invariant()
    def safe(self) -> None:
        self.cluster.invariants.check_safety()

    def teardown(self) -> None:
        """Liveness: with faults over, every request ends and every slot comes back."""
        cluster = self.cluster
        for _ in range(20_000):
            if cluster.in_flight:
                cluster.deliver(0)
            elif cluster.decoders.running():
                cluster.decoders.step(*cluster.decoders.running()[0])
            elif cluster.crashed():
                for worker in cluster.crashed():
                    cluster.restart_worker(worker)
                cluster.advance(cluster.now + 0.25)
            elif cluster.unfinished() or any(v.held for v in cluster.router.statistics().workers):
                cluster.advance(cluster.now + 0.25)
            else:
                break
            cluster.invariants.check_safety()
        assert cluster.unfinished() == [], "requests never reached a terminal outcome"
        assert all(v.held == 0 for v in cluster.router.statistics().workers)
        assert all(w.free_slots == SLOTS for w in cluster.workers.values())


TestRouterAlone = RouterAlone.TestCase
TestRouterAlone.settings = SETTINGS
TestWorkerAlone = WorkerAlone.TestCase
TestWorkerAlone.settings = SETTINGS
TestClusterOnFaultyLink = ClusterOnFaultyLink.TestCase
TestClusterOnFaultyLink.settings = settings(SETTINGS, max_examples=300)
