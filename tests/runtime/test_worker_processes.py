"""Real worker processes over real TCP on 127.0.0.1: kill -9, restart, garbage, SIGTERM.

The router (Controller plus the TCP listener) runs in the test process; each
worker is a `fencepost worker --fake` process. The fake decoder makes a token
every 10 ms after a 1.5 s "prefill", ignoring EOS, so a test can catch requests
that were accepted but have no token yet, and streams that are mid-way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from adapters.runtime.controller import Controller
from adapters.runtime.tcp_router import serve_workers
from core.config import RouterConfig
from core.fake_model import reference_tokens
from core.protocol import (
    Assignment,
    DeliverError,
    DeliverFinished,
    GenerationRequest,
    Heartbeat,
    Token,
)
from core.wire import encode_frame
from tests.support.runtime_helpers import collect, healthy, raw_connection, settled, wait_until

# Wide enough that a busy machine's stall of a worker (or of this test's loop) is no
# loss; a killed worker is seen at once by its closed connection anyway.
HEARTBEAT_TIMEOUT_S = 3.0
# Resuming is off here: these tests pin down the plain contract (a started stream
# that loses its worker ends with worker_lost). Resumes: test_serve_process.py.
CONFIG = RouterConfig(offer_timeout_s=1.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, max_resumes=0)
PREFILL_MS = 3000  # the window in which accepted requests have no token yet
# A killed worker's streams end by its lost connection (at once) or its heartbeats'
# silence (0.5 s); the next mechanism that would end them, the token deadline, takes
# 10 s. Anything under that bound shows the first two worked, however busy the machine.
LOSS_BOUND_S = CONFIG.token_timeout_s - 1.0


class Workers:
    """Spawns worker processes and makes sure none outlives the test."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(
        self,
        port: int,
        worker_id: str,
        slots: int = 8,
        prefill_ms: int = PREFILL_MS,
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "adapters.cli", "worker",
            "--connect", f"127.0.0.1:{port}", "--worker-id", worker_id,
            "--slots", str(slots), "--heartbeat-interval", "0.1", "--drain-timeout", "5",
            "--fake", "--fake-step-ms", "10", "--fake-prefill-ms", str(prefill_ms),
            "--fake-ignore-eos", *extra,
        ]  # fmt: skip
        log = (self.log_dir / f"{worker_id}-{len(self.processes)}.log").open("wb")
        process = subprocess.Popen(command, stderr=log, stdout=log)
        self.processes[f"{worker_id}-{len(self.processes)}"] = process
        return process

    def cleanup(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    spawned = Workers(tmp_path)
    yield spawned
    spawned.cleanup()


def request(name: str, max_new: int) -> GenerationRequest:
    return GenerationRequest(name, (3, 1, 4, len(name)), max_new)


def expected(req: GenerationRequest) -> list[int]:
    return reference_tokens(req, req.max_new_tokens)


def live_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


Results = dict[str, tuple[list[int], DeliverFinished | DeliverError]]


async def _kill_w1_under_load(
    controller: Controller, port: int, w1: subprocess.Popen[bytes], results: Results
) -> tuple[list[GenerationRequest], list[GenerationRequest], float, set[str]]:
    """4 long streams running and 4 short requests accepted but in prefill when w1
    gets SIGKILL; returns (long, short, how long until w1's streams ended, the ids
    the router had placed on w1: asked of it, not assumed)."""

    async def client(req: GenerationRequest) -> None:
        results[req.request_id] = await collect(controller.submit(req))

    long = [request(f"long-{i}", 700) for i in range(4)]  # 7 s of tokens each
    short = [request(f"short-{i}", 30) for i in range(4)]
    async with trio.open_nursery() as clients:
        for req in long:
            clients.start_soon(client, req)
        # every long stream has its first token (after the 3 s prefill) ...
        await wait_until(controller, lambda s: s.router.requests_by_phase.get("streaming") == 4, 30)
        for req in short:
            clients.start_soon(client, req)
        # ... and the short ones are accepted, still in prefill, no token yet
        await wait_until(controller, lambda s: s.router.requests_by_phase.get("assigned") == 4, 20)
        # garbage on the worker port while all of this runs
        assert await raw_connection(port, os.urandom(64) + b"\x00" * 8) == b""
        placed = {r.request_id: controller.router.placement(r.request_id) for r in long + short}
        on_w1 = {rid for rid, where in placed.items() if where is not None and where[0] == "w1"}
        long_on_w1 = sum(r.request_id in on_w1 for r in long)
        assert long_on_w1 and on_w1 - {r.request_id for r in long}  # both kinds on w1
        killed_at = trio.current_time()
        w1.send_signal(signal.SIGKILL)
        lost_by = None
        while lost_by is None:  # how long until w1's streams end
            await trio.sleep(0.01)
            lost = [r for r in results.values() if r[1].kind == "worker_lost"]  # type: ignore[union-attr]
            if len(lost) == long_on_w1:
                lost_by = trio.current_time() - killed_at
            # before any token deadline (10 s) could have ended them: the lost connection
            # or the heartbeats did, with room for a busy machine's lag
            assert trio.current_time() - killed_at < LOSS_BOUND_S, "streams hung after the kill"
        # new requests keep succeeding meanwhile
        fresh = request("after-kill", 20)
        tokens, outcome = await collect(controller.submit(fresh))
        assert tokens == expected(fresh) and isinstance(outcome, DeliverFinished)
    return long, short, lost_by, on_w1


def _check_outcomes_after_the_kill(
    long: list[GenerationRequest],
    short: list[GenerationRequest],
    results: Results,
    on_w1: set[str],
) -> None:
    for req in long:  # those on w1: lost mid-stream, with what they had so far
        tokens, outcome = results[req.request_id]
        assert tokens == expected(req)[: len(tokens)]
        if req.request_id in on_w1:
            assert isinstance(outcome, DeliverError), outcome
            assert outcome.kind == "worker_lost" and len(tokens) > 0
        else:
            assert isinstance(outcome, DeliverFinished) and tokens == expected(req)
    for req in short:  # no token yet when w1 died: completed on w2
        tokens, outcome = results[req.request_id]
        assert isinstance(outcome, DeliverFinished), outcome
        assert tokens == expected(req)


async def _w1_returns_and_serves(
    controller: Controller, workers: Workers, port: int, first_epoch: int
) -> None:
    """w1 comes back: a new process, a new (larger) epoch, serving again."""
    workers.spawn(port, "w1")
    stats = await wait_until(controller, lambda s: "w1" in healthy(s), 30)
    assert healthy(stats)["w1"] > first_epoch
    # frames from the dead epoch are refused at the door and change nothing
    old = Heartbeat("w1", first_epoch, 99, 8, 8, 2048)
    late_token = Token(Assignment("long-0", 1), 5, 1)
    assert await raw_connection(port, encode_frame(old) + encode_frame(late_token)) == b""
    assert controller.statistics().links["w1"] == healthy(stats)["w1"]
    results: Results = {}

    async def client(req: GenerationRequest) -> None:
        results[req.request_id] = await collect(controller.submit(req))

    async with trio.open_nursery() as clients:
        again = [request(f"again-{i}", 20) for i in range(16)]
        for req in again:
            clients.start_soon(client, req)
        await wait_until(
            controller,
            lambda s: all(w.held > 0 for w in s.router.workers if w.worker_id == "w1"),
            10,
        )
    for req in again:
        tokens, outcome = results[req.request_id]
        assert tokens == expected(req) and isinstance(outcome, DeliverFinished)


def test_kill_9_mid_stream_then_restart_with_a_new_epoch(workers: Workers) -> None:
    async def main() -> None:
        controller = Controller(CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)
            w1 = workers.spawn(port, "w1")
            workers.spawn(port, "w2")
            stats = await wait_until(controller, lambda s: len(healthy(s)) == 2, 30)
            first_epoch = healthy(stats)["w1"]
            baseline_tasks = live_tasks()

            results: Results = {}
            long, short, lost_by, on_w1 = await _kill_w1_under_load(controller, port, w1, results)
            assert lost_by < LOSS_BOUND_S
            _check_outcomes_after_the_kill(long, short, results, on_w1)
            stats = await wait_until(controller, settled, 30)
            assert healthy(stats) == {"w2": healthy(stats)["w2"]}
            assert set(stats.links) == {"w2"}

            await _w1_returns_and_serves(controller, workers, port, first_epoch)
            await wait_until(controller, settled, 30)
            with trio.fail_after(30):  # no task outlives its connection or request
                while live_tasks() != baseline_tasks:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_hung_decoder_is_left_behind_and_its_streams_finish_elsewhere(
    workers: Workers,
) -> None:
    """w1's decoder wedges after 20 steps while w1 heartbeats on: its streams miss the
    token deadline, resume on w2 from the exact delivered prefix, and w1 gets no new
    work while it is stuck."""
    token_timeout_s = 3.0  # w2's healthy streams never wait that long for a token
    config = RouterConfig(
        # Wide offer and first-token deadlines: on a loaded machine a 1 s offer
        # timeout once gave up on w1's attempts before their first token (a
        # retry, not the resume this test is about).
        offer_timeout_s=3.0,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        first_token_timeout_s=4.0,
        prefill_timeout_per_token_s=0.0,
        token_timeout_s=token_timeout_s,
        stuck_probe_s=60.0,
    )

    async def main() -> None:
        controller = Controller(config)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)
            workers.spawn(port, "w1", prefill_ms=0, extra=("--fake-hang-after", "20"))
            workers.spawn(port, "w2", prefill_ms=0)
            await wait_until(controller, lambda s: len(healthy(s)) == 2, 30)
            results: Results = {}
            began = trio.current_time()

            async def client(req: GenerationRequest) -> None:
                results[req.request_id] = await collect(controller.submit(req))

            streams = [request(f"hang-{i}", 400) for i in range(4)]  # 4 s of tokens each
            # Without the token deadline the hung streams would wait forever (w1
            # heartbeats on): they must end, resumed, well within this.
            with trio.fail_after(60):
                async with trio.open_nursery() as clients:
                    for req in streams:
                        clients.start_soon(client, req)
                    # w1 takes half of them, then wedges; the router gives up on it
                    await wait_until(controller, lambda s: "w1" not in healthy(s), 10)
            took = trio.current_time() - began
            for req in streams:
                tokens, outcome = results[req.request_id]
                assert isinstance(outcome, DeliverFinished), outcome
                assert tokens == expected(req)  # resumed from exactly where it stopped
            stats = controller.statistics()
            assert stats.router.resumes == 2
            # the undisturbed run takes 4 s; the resumed ones lose one deadline on top
            # (3 s), and a busy machine may add seconds: bounded, not exact
            assert took < 30
            # w1 is stuck (heartbeating, no progress): new work goes to w2 only
            assert "w1" in stats.links and set(healthy(stats)) == {"w2"}
            fresh = request("after-hang", 30)
            tokens, outcome = await collect(controller.submit(fresh))
            assert tokens == expected(fresh) and isinstance(outcome, DeliverFinished)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_second_process_with_a_live_worker_id_is_refused_once_and_exits(
    workers: Workers,
) -> None:
    """Two processes claiming one id: the newcomer is refused (it exits 2, naming the
    id), the live one keeps its epoch and its streams; with --take-over the newcomer
    replaces it, and the replaced one, refused in turn, exits instead of fighting."""

    async def main() -> None:
        controller = Controller(CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)
            original = workers.spawn(port, "w1", prefill_ms=0, extra=("--refused-grace", "2"))
            stats = await wait_until(controller, lambda s: "w1" in healthy(s), 30)
            epoch = healthy(stats)["w1"]
            # 15 s of tokens on w1: still streaming when the twin, however slow to
            # start, has been refused and gone
            during = request("during", 1500)
            stream = controller.submit(during)
            await wait_until(controller, lambda s: s.router.requests_by_phase.get("streaming"), 30)
            twin = workers.spawn(port, "w1", prefill_ms=0, extra=("--refused-grace", "2"))
            with trio.fail_after(60):
                while twin.poll() is None:
                    await trio.sleep(0.05)
            assert twin.returncode == 2
            assert controller.statistics().router.requests_by_phase.get("streaming") == 1
            log = (workers.log_dir / "w1-1.log").read_text()
            assert "refused worker id w1" in log
            stream.cancel()  # it ran undisturbed through the twin's attempt: enough
            tokens, outcome = await collect(stream)
            assert isinstance(outcome, DeliverError) and outcome.kind == "cancelled"
            assert tokens and tokens == expected(during)[: len(tokens)]
            assert healthy(controller.statistics()) == {"w1": epoch}  # never disturbed
            # a few refusals over its 2 s of grace (0.5-1 s apart, doubling), not a storm
            assert 1 <= controller.refusals["w1"] <= 4
            refused = controller.refusals["w1"]

            taker = workers.spawn(port, "w1", prefill_ms=0, extra=("--take-over",))
            await wait_until(controller, lambda s: healthy(s).get("w1", epoch) > epoch, 60)
            with trio.fail_after(60):  # the replaced process reconnects, is refused, exits
                while original.poll() is None:
                    await trio.sleep(0.05)
            assert original.returncode == 2 and taker.poll() is None
            assert 1 <= controller.refusals["w1"] - refused <= 4
            fresh = request("after-takeover", 20)
            tokens, outcome = await collect(controller.submit(fresh))
            assert tokens == expected(fresh) and isinstance(outcome, DeliverFinished)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_sigterm_drains_a_worker_and_it_exits_0(workers: Workers) -> None:
    """--drain-mode finish: its streams run to their end there."""

    async def main() -> None:
        controller = Controller(CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)
            finish = ("--drain-mode", "finish")
            leaving = workers.spawn(port, "a-leaving", slots=2, extra=finish)  # first by id
            await wait_until(controller, lambda s: len(healthy(s)) == 1, 30)
            workers.spawn(port, "b-staying", slots=2)
            await wait_until(controller, lambda s: len(healthy(s)) == 2, 30)
            results = {}

            async def client(req: GenerationRequest) -> None:
                results[req.request_id] = await collect(controller.submit(req))

            async with trio.open_nursery() as clients:
                running = [request(f"run-{i}", 100) for i in range(2)]  # one on each worker
                for req in running:
                    clients.start_soon(client, req)
                await wait_until(
                    controller, lambda s: s.router.requests_by_phase.get("streaming") == 2, 30
                )
                leaving.send_signal(signal.SIGTERM)
                await wait_until(
                    controller,
                    lambda s: any(w.slots == 0 for w in s.router.workers),  # draining
                    30,
                )
                later = request("later", 10)  # must not go to the draining worker
                clients.start_soon(client, later)
            for req in [*running, later]:
                tokens, outcome = results[req.request_id]
                assert isinstance(outcome, DeliverFinished), outcome
                assert tokens == expected(req)
            code = await trio.to_thread.run_sync(leaving.wait, 60)
            assert code == 0
            stats = await wait_until(controller, lambda s: set(s.links) == {"b-staying"}, 30)
            assert settled(stats)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_sigterm_hands_the_streams_off_and_the_worker_exits_while_they_go_on(
    workers: Workers,
) -> None:
    """--drain-mode handoff (the default): the streams continue on the other worker at
    the exact token, the draining worker exits long before they end (its drain timeout
    is far past them), and no resume is spent (resumes are off in CONFIG)."""

    async def main() -> None:
        controller = Controller(CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)
            drain = ("--drain-timeout", "120")
            leaving = workers.spawn(port, "a-leaving", slots=4, prefill_ms=0, extra=drain)
            await wait_until(controller, lambda s: len(healthy(s)) == 1, 30)
            results: Results = {}

            async def client(req: GenerationRequest) -> None:
                results[req.request_id] = await collect(controller.submit(req))

            async with trio.open_nursery() as clients:
                running = [request(f"long-{i}", 800) for i in range(3)]  # 8 s of tokens
                for req in running:
                    clients.start_soon(client, req)
                await wait_until(
                    controller, lambda s: s.router.requests_by_phase.get("streaming") == 3, 30
                )
                workers.spawn(port, "b-staying", slots=4, prefill_ms=0)
                await wait_until(controller, lambda s: len(healthy(s)) == 2, 30)
                leaving.send_signal(signal.SIGTERM)
                code = await trio.to_thread.run_sync(leaving.wait, 60)
                assert code == 0
                assert not results, "the worker waited for its streams to end"
            for req in running:
                tokens, outcome = results[req.request_id]
                assert isinstance(outcome, DeliverFinished), outcome
                assert tokens == expected(req)
            stats = await wait_until(controller, lambda s: set(s.links) == {"b-staying"}, 30)
            assert (stats.router.handoffs, stats.router.resumes) == (3, 0)
            assert settled(stats)
            log = (workers.log_dir / "a-leaving-0.log").read_text()
            assert "handing off 3 stream(s)" in log and "0 stream(s) still held" in log
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_sigterm_stops_a_worker_whose_router_is_gone_at_once(workers: Workers) -> None:
    """A worker between connections holds nothing, so draining it has nothing to wait for
    (it used to wait the whole --drain-timeout, 120 s here, while trying to reconnect)."""

    async def main() -> None:
        controller = Controller(CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)
            # a drain timeout far past the bound below: waiting it out would fail
            orphan = workers.spawn(port, "orphan", extra=("--drain-timeout", "120"))
            await wait_until(controller, lambda s: len(healthy(s)) == 1, 30)
            nursery.cancel_scope.cancel()  # the router and its listener go away
        log = workers.log_dir / "orphan-0.log"
        with trio.fail_after(60):  # the worker saw the connection close and is reconnecting
            while "cannot reach the router" not in log.read_text():
                await trio.sleep(0.05)
        assert orphan.poll() is None
        orphan.send_signal(signal.SIGTERM)
        began = trio.current_time()
        code = await trio.to_thread.run_sync(orphan.wait, 90)
        assert code == 0
        assert trio.current_time() - began < 60

    trio.run(main)
