"""The trio runtime in one process: controller, in-process and TCP workers, timers."""

from __future__ import annotations

import trio
import trio.testing

from adapters.runtime.controller import Controller, with_seed
from adapters.runtime.embedded import run_local_worker
from adapters.runtime.loop import Mailbox, Timers
from adapters.runtime.tcp_link import TransportLimits
from adapters.runtime.tcp_router import serve_workers
from adapters.runtime.tcp_worker import RemoteWorker
from adapters.runtime.worker_host import FakeDecoder
from core.config import RouterConfig
from core.fake_model import reference_output, reference_tokens
from core.protocol import (
    Assignment,
    DeliverError,
    DeliverFinished,
    GenerationRequest,
    Heartbeat,
    Offer,
    Register,
    Registered,
    Sampling,
    Token,
    ToWorker,
)
from core.wire import encode_frame
from core.worker import WorkerConfig
from tests.support.runtime_helpers import collect, healthy, raw_connection, settled, wait_until

FAST = RouterConfig(offer_timeout_s=0.3, heartbeat_timeout_s=0.5, max_attempts=3)
# For the tests of real sockets whose subject is not liveness: a loaded machine's stall
# must not end a healthy link (the link's idle timeout is the heartbeat timeout).
STEADY = RouterConfig(offer_timeout_s=0.3, heartbeat_timeout_s=30.0, max_attempts=3)


def request(i: int, max_new: int = 40) -> GenerationRequest:
    return GenerationRequest(f"req-{i}", (7, 8, i), max_new)


def worker(worker_id: str, slots: int = 4) -> WorkerConfig:
    return WorkerConfig(worker_id, slots=slots, heartbeat_interval_s=0.1)


def test_timers_fire_in_deadline_order_and_rearming_replaces() -> None:
    fired: list[tuple[str, float]] = []

    async def main() -> None:
        timers = Timers(lambda key: fired.append((str(key), trio.current_time())))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timers.run)
            now = trio.current_time()
            timers.arm("b", now + 0.2)
            timers.arm("a", now + 0.1)
            timers.arm("c", now + 0.15)
            timers.disarm("c")
            timers.arm("b", now + 0.3)  # replaces 0.2
            await trio.sleep(0.5)
            assert [key for key, _ in fired] == ["a", "b"]
            assert fired[1][1] >= now + 0.3
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_mailbox_refuses_when_full_and_hands_over_batches() -> None:
    async def main() -> None:
        box: Mailbox[int] = Mailbox(3)
        assert [box.put(i) for i in range(4)] == [True, True, True, False]
        assert await box.take() == [0, 1, 2]
        box.put(9)
        box.close()
        assert not box.put(10)
        assert await box.take() == [9]
        try:
            await box.take()
        except trio.EndOfChannel:
            return
        raise AssertionError("a closed, empty mailbox must end the consumer")

    trio.run(main)


def test_embedded_workers_serve_reference_outputs_and_leave_nothing_behind() -> None:
    async def main() -> None:
        controller = Controller(FAST)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            for name in ("w1", "w2"):
                await nursery.start(run_local_worker, controller, worker(name), FakeDecoder())
            results = {}

            async def client(i: int) -> None:
                async with controller.submit(request(i)) as stream:
                    results[i] = await collect(stream)

            async with trio.open_nursery() as clients:
                for i in range(20):  # more than the 8 slots: some queue
                    clients.start_soon(client, i)
            for i, (tokens, outcome) in results.items():
                expected, reason = reference_output(request(i))
                assert tokens == expected
                assert isinstance(outcome, DeliverFinished) and outcome.reason == reason
            stats = await wait_until(controller, settled)
            assert sum(stats.router.outcomes.values()) == 20
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_controller_gives_every_sampled_request_a_seed_and_only_those() -> None:
    greedy = GenerationRequest("g", (1, 2), 4)
    seeded = GenerationRequest("s", (1, 2), 4, Sampling(0.7, 1.0, 42))
    unseeded = GenerationRequest("u", (1, 2), 4, Sampling(0.7, 0.9, None))
    assert with_seed(greedy) is greedy
    assert with_seed(seeded) is seeded
    drawn = {with_seed(unseeded).sampling.seed for _ in range(20)}
    assert None not in drawn and len(drawn) == 20  # fresh each time
    assert with_seed(unseeded).sampling.top_p == 0.9

    async def main() -> None:
        controller = Controller(FAST)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            await nursery.start(run_local_worker, controller, worker("w1"), FakeDecoder())
            stream = controller.submit(unseeded)
            assert stream.request.sampling.seed is not None  # what the router was given
            tokens, _ = await collect(stream)
            assert tokens == reference_output(stream.request)[0]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_leaving_a_stream_early_cancels_it_and_frees_the_slot() -> None:
    async def main() -> None:
        controller = Controller(FAST)
        decoder = FakeDecoder(step_s=0.01, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            host = await nursery.start(run_local_worker, controller, worker("w1", 1), decoder)
            async with controller.submit(request(1, max_new=1_000)) as stream:
                async for item in stream:
                    if item.index == 2:  # type: ignore[union-attr]
                        break  # the client goes away
            assert stream.outcome == DeliverError("req-1", "cancelled", "cancelled by the client")
            await wait_until(controller, settled)
            assert not host.worker.holds()
            # the freed slot serves the next request at once
            tokens, outcome = await collect(controller.submit(request(2, max_new=5)))
            assert len(tokens) == 5 and isinstance(outcome, DeliverFinished)
            nursery.cancel_scope.cancel()

    trio.run(main)


class SilentLink:
    """A worker connection that swallows everything (a hung peer)."""

    def __init__(self, worker_id: str, limit: int = 1000) -> None:
        self.worker_id, self.epoch = worker_id, 0
        self.sent: list[ToWorker] = []
        self.limit = limit
        self.closed_because: str | None = None

    def send(self, message: ToWorker) -> bool:
        if len(self.sent) >= self.limit:
            return False
        self.sent.append(message)
        return True

    def close(self, reason: str) -> None:
        self.closed_because = reason


def test_offer_timeouts_run_on_the_trio_clock() -> None:
    async def main() -> None:
        controller = Controller(FAST)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            link = SilentLink("w1")
            controller.attach(link)
            controller.from_worker("w1", Heartbeat("w1", 0, 1, 4, 4, 2048))

            async def heartbeats() -> None:  # alive, but never answers an offer
                for seq in range(2, 1000):
                    controller.from_worker("w1", Heartbeat("w1", 0, seq, 4, 4, 2048))
                    await trio.sleep(0.1)

            nursery.start_soon(heartbeats)
            began = trio.current_time()
            tokens, outcome = await collect(controller.submit(request(1)))
            # three attempts on the one worker, each offer timing out after 0.3 s
            assert tokens == [] and isinstance(outcome, DeliverError)
            assert outcome.kind == "no_worker", outcome
            assert trio.current_time() - began >= 3 * FAST.offer_timeout_s, outcome
            assert [type(m) for m in link.sent].count(Offer) == 3
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_worker_whose_send_queue_fills_is_dropped_and_its_requests_fail_over() -> None:
    async def main() -> None:
        controller = Controller(STEADY)  # a-stuck heartbeats once: it must stay live
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            stuck = SilentLink("a-stuck", limit=1)  # sorts first: gets the first offer
            controller.attach(stuck)
            controller.from_worker("a-stuck", Heartbeat("a-stuck", 0, 1, 8, 8, 2048))
            await nursery.start(run_local_worker, controller, worker("w2"), FakeDecoder())
            first = controller.submit(request(1))  # offered to a-stuck: its queue is now full
            second = controller.submit(request(2))  # w2 has fewer holds now
            third = controller.submit(request(3))  # a-stuck again: refused, so it is dropped
            for i, stream in ((1, first), (2, second), (3, third)):
                tokens, outcome = await collect(stream)
                assert tokens == reference_output(request(i))[0]
                assert isinstance(outcome, DeliverFinished)
            assert stuck.closed_because is not None and "send queue full" in stuck.closed_because
            stats = controller.statistics()
            assert healthy(stats) == {"w2": 0}
            assert stats.dropped_sends == {"queue_full": 1}
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_draining_refuses_new_requests_and_cancels_what_outlives_the_grace() -> None:
    async def main() -> None:
        controller = Controller(FAST)
        decoder = FakeDecoder(step_s=0.01, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            await nursery.start(run_local_worker, controller, worker("w1"), decoder)
            short = controller.submit(request(1, max_new=5))
            long = controller.submit(request(2, max_new=1_000))
            await controller.drain(grace_s=3.0)  # 5 tokens fit; 10 s of them do not
            assert isinstance(short.outcome, DeliverFinished)
            assert long.outcome is not None and long.outcome.kind == "cancelled"  # type: ignore[union-attr]
            assert "shut down" in long.outcome.message  # type: ignore[union-attr]
            late = controller.submit(request(3))
            assert isinstance(late.outcome, DeliverError) and late.outcome.kind == "overloaded"
            await wait_until(controller, settled)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_tcp_worker_serves_and_bad_connections_leave_running_streams_alone() -> None:
    async def main() -> None:
        controller = Controller(STEADY)
        limits = TransportLimits(registration_timeout_s=2.0)
        decoder = FakeDecoder(step_s=0.005, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0, limits)
            remote = RemoteWorker([("127.0.0.1", port)], worker("r1"), decoder)
            nursery.start_soon(remote.run)
            await wait_until(controller, lambda s: "r1" in healthy(s))
            streams = [controller.submit(request(i, max_new=1000)) for i in range(4)]  # 5 s
            await wait_until(controller, lambda s: s.router.requests_by_phase.get("streaming") == 4)

            async def abuse(payload: bytes) -> bytes:
                return await raw_connection(port, payload, timeout_s=30)

            assert await abuse(b"\xff\x00garbage" * 50) == b""  # malformed: closed
            assert await abuse(b"") == b""  # silent: closed after the registration timeout
            token = Token(Assignment("req-0", 1), 0, 5)
            assert await abuse(encode_frame(token)) == b""  # opens without a heartbeat
            current = controller.statistics().links["r1"]
            stale = Heartbeat("r1", current - 1, 1, 4, 4, 2048)  # an older epoch of r1
            assert await abuse(encode_frame(stale) + encode_frame(token)) == b""
            assert controller.statistics().links == {"r1": current}

            for i, stream in enumerate(streams):
                tokens, outcome = await collect(stream)
                assert tokens == reference_tokens(request(i), 1000)
                assert isinstance(outcome, DeliverFinished)
            stats = await wait_until(controller, settled)
            assert stats.router.fenced.get("wrong_worker", 0) == 0
            assert remote.sessions == 1  # r1 was never disturbed
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_worker_port_bounds_what_unregistered_and_silent_peers_can_hold() -> None:
    """Caps on connections, small frames before registration, and silent links closed.

    "At once" is told apart from "by a timer" with timers far longer than any delay a
    busy machine adds: a refusal that waited for the 30 s registration timeout, or a
    silent link never closed, fails; a scheduler that lags by seconds does not."""

    async def main() -> None:
        controller = Controller(FAST)
        limits = TransportLimits(
            registration_timeout_s=30.0, max_unregistered=2, idle_timeout_s=0.3
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0, limits)
            # a frame header announcing 1 MiB before registering: closed at once
            began = trio.current_time()
            header = (1024 * 1024 - 1).to_bytes(4, "big")
            assert await raw_connection(port, header, timeout_s=60) == b""
            assert trio.current_time() - began < 10
            # two silent newcomers hold the unregistered places; a third is closed at once
            first = await trio.open_tcp_stream("127.0.0.1", port)
            second = await trio.open_tcp_stream("127.0.0.1", port)
            await trio.sleep(0.1)  # this loop accepts them meanwhile (no wall-clock race)
            began = trio.current_time()
            assert await raw_connection(port, b"", timeout_s=60) == b""
            assert trio.current_time() - began < 10
            await first.aclose()
            await second.aclose()
            await trio.sleep(0.1)
            # a registered link that goes silent is closed after idle_timeout_s, not before
            began = trio.current_time()
            reply = await raw_connection(port, encode_frame(Register("quiet")), timeout_s=60)
            assert reply == encode_frame(Registered("quiet", 0))  # the router's epoch
            assert 0.25 < trio.current_time() - began < 10
            await wait_until(controller, lambda s: "quiet" not in s.links, 30)
            nursery.cancel_scope.cancel()

    trio.run(main)
