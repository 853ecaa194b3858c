"""Several routers sharing workers: real processes on 127.0.0.1, fake workers.

Two `fencepost serve` routers, two `fencepost worker --fake` processes each
linked to both. Requests through either router come out exactly as the fake
model makes them; kill -9 one router while streams run on both, and the other
router's streams finish whole, with no error, while the workers free the dead
router's slots for the living one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import requests
import trio

from adapters.runtime.controller import Controller
from adapters.runtime.tcp_router import serve_workers
from adapters.runtime.tcp_worker import Address, RemoteWorker
from adapters.runtime.worker_host import FakeDecoder
from core.config import RouterConfig
from core.protocol import Heartbeat, Register
from core.wire import encode_frame
from core.worker import WorkerConfig
from tests.support.process_helpers import LogWatcher, fencepost, healthy_workers, metric, wait_for
from tests.support.runtime_helpers import healthy, kill_all, wait_until

SLOTS = 4


def undisturbed(content: str, tokens: int, *, eos: bool = False) -> str:
    """The text a fake worker makes for one user message, greedy; ignoring EOS unless
    `eos` (then the output ends at the fake model's EOS, which has no text)."""
    from adapters.openai.models import FakeChatModel
    from adapters.openai.normalize import ChatMessage
    from core.fake_model import EOS_TOKEN, reference_output, reference_tokens
    from core.protocol import GenerationRequest

    model = FakeChatModel("fake")
    prompt = tuple(model.tokenize_chat([ChatMessage("user", content)]))
    request = GenerationRequest("x", prompt, tokens)
    if eos:
        output, _ = reference_output(request)
        return model.decode([token for token in output if token != EOS_TOKEN])
    return model.decode(reference_tokens(request, tokens))


def start_router(name: str, worker_port: int = 0) -> tuple[subprocess.Popen[str], str, str]:
    """A router; its HTTP base URL and its worker port."""
    serve = fencepost("serve", "--fake", "--port", "0", "--router-id", name,
                      "--worker-listen", f"127.0.0.1:{worker_port}", "--no-local-worker",
                      "--heartbeat-timeout", "5", "--drain-timeout", "2")  # fmt: skip
    log = LogWatcher(serve)
    http_port = log.find(r"serving fake on http://127\.0\.0\.1:(\d+)/v1").group(1)
    bound = log.find(r"accepting workers on 127\.0\.0\.1:(\d+)").group(1)
    log.find(rf"router id {name}-[0-9a-f]{{8}}")
    return serve, f"http://127.0.0.1:{http_port}", bound


def start_worker(name: str, *router_ports: str) -> tuple[subprocess.Popen[str], str]:
    """A fake worker linked to every router port given; its health base URL."""
    connect = [flag for port in router_ports for flag in ("--connect", f"127.0.0.1:{port}")]
    worker = fencepost("worker", *connect, "--fake", "--fake-step-ms", "10",
                       "--fake-ignore-eos", "--worker-id", name, "--slots", str(SLOTS),
                       "--heartbeat-interval", "0.2", "--resolve-interval", "0.5",
                       "--health-listen", "127.0.0.1:0")  # fmt: skip
    log = LogWatcher(worker)
    port = log.find(r"metrics on http://127\.0\.0\.1:(\d+)").group(1)
    return worker, f"http://127.0.0.1:{port}"


def chat(base: str, content: str, tokens: int, headers: dict[str, str] | None = None) -> str:
    body = {"model": "fake", "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens, "temperature": 0}  # fmt: skip
    reply = requests.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


class Stream(threading.Thread):
    """One streamed chat request read to its end: the text, and any error met."""

    def __init__(self, base: str, content: str, tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.content, self.tokens = base, content, tokens
        self.text = ""
        self.chunks = 0
        self.error: str | None = None
        self.done = False
        self.start()

    def run(self) -> None:
        body = {"model": "fake", "messages": [{"role": "user", "content": self.content}],
                "max_tokens": self.tokens, "temperature": 0, "stream": True}  # fmt: skip
        try:
            url = f"{self.base}/v1/chat/completions"
            with requests.post(url, json=body, stream=True, timeout=30) as reply:
                for line in reply.iter_lines():
                    if not line:
                        continue
                    if line == b"data: [DONE]":
                        self.done = True
                        return
                    event = json.loads(line[len(b"data: ") :])
                    if "error" in event:
                        self.error = str(event["error"])
                        return
                    for choice in event["choices"]:
                        self.text += choice["delta"].get("content") or ""
                        self.chunks += 1
        except (requests.RequestException, ValueError) as error:
            self.error = f"{type(error).__name__}: {error}"


def test_two_routers_share_workers_and_a_routers_death_costs_only_its_own_streams() -> None:
    processes: list[subprocess.Popen[str]] = []
    try:
        a, base_a, port_a = start_router("a")
        b, base_b, port_b = start_router("b")
        processes += [a, b]
        workers = [start_worker(f"w{i}", port_a, port_b) for i in (1, 2)]
        processes += [process for process, _ in workers]
        wait_for(lambda: healthy_workers(base_a) == 2 and healthy_workers(base_b) == 2)
        for _, health in workers:
            assert metric(health, "fencepost_worker_linked_routers") == 2

        # both routers serve, with the exact outputs
        assert chat(base_a, "hello from a", 20) == undisturbed("hello from a", 20)
        assert chat(base_b, "hello from b", 20) == undisturbed("hello from b", 20)

        # streams on both; A's would run 20 s, so slots they kept would show
        long_on_a = [Stream(base_a, f"on a {i}", 2000) for i in range(3)]
        on_b = [Stream(base_b, f"on b {i}", 300) for i in range(3)]
        wait_for(lambda: all(s.chunks >= 10 for s in long_on_a + on_b), 60)
        a.send_signal(signal.SIGKILL)
        for stream in on_b:
            stream.join(60)
            assert stream.done and stream.error is None, stream.error
            assert stream.text == undisturbed(stream.content, 300)
        for stream in long_on_a:
            stream.join(30)
            assert not stream.is_alive() and not stream.done  # cut, not hung
        assert a.wait(10) == -signal.SIGKILL

        # the workers let A's slots go: every slot is B's to use
        for _, health in workers:
            wait_for(lambda h=health: metric(h, "fencepost_worker_linked_routers") == 1, 30)
            wait_for(lambda h=health: metric(h, "fencepost_worker_free_slots") == SLOTS, 30)
        # 10 s streams, one per slot: all of them in flight at once, however late each
        # client thread gets going on a busy machine
        every_slot = [Stream(base_b, f"again {i}", 1000) for i in range(2 * SLOTS)]
        wait_for(lambda: metric(base_b, "fencepost_slots_used") == 2 * SLOTS, 60)
        for stream in every_slot:
            stream.join(60)
            assert stream.done and stream.text == undisturbed(stream.content, 1000)
    finally:
        kill_all(processes)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_worker_health_ready_and_metrics_answer() -> None:
    router_port = free_port()
    worker, health = start_worker("w1", str(router_port))
    router = None
    try:
        assert requests.get(f"{health}/health", timeout=5).status_code == 200
        assert requests.get(f"{health}/ready", timeout=5).status_code == 503  # no router yet
        router, base, _ = start_router("r", router_port)
        # the worker retries with a doubling backoff while the router starts: 90 s covers
        # a slow start and the backoff's cap
        wait_for(lambda: requests.get(f"{health}/ready", timeout=5).status_code == 200, 90)
        assert chat(base, "count me", 12) == undisturbed("count me", 12)
        assert metric(health, "fencepost_worker_slots") == SLOTS
        assert metric(health, "fencepost_worker_free_slots") == SLOTS
        assert metric(health, "fencepost_worker_linked_routers") == 1
        assert metric(health, "fencepost_worker_offers_accepted_total") == 1
        assert metric(health, "fencepost_worker_tokens_sent_total") == 12
        assert requests.get(f"{health}/nothing", timeout=5).status_code == 404
        router.kill()
        router.wait(10)
        wait_for(lambda: requests.get(f"{health}/ready", timeout=5).status_code == 503, 30)
    finally:
        kill_all((worker, router))


def test_a_name_standing_for_two_routers_links_the_worker_to_both() -> None:
    """A name resolving to two addresses (a headless Service) is two routers; one that
    appears later is found at the next resolution."""

    async def main() -> None:
        routers = [Controller(RouterConfig(router_id=name)) for name in ("ra", "rb")]
        answers: list[set[Address]] = []

        async def resolve(host: str, port: int) -> set[Address]:
            assert (host, port) == ("routers.example", 9000)
            return answers[-1]

        async with trio.open_nursery() as nursery:
            ports = []
            for controller in routers:
                await nursery.start(controller.run)
                ports.append(await nursery.start(serve_workers, controller, "127.0.0.1", 0))
            answers.append({("127.0.0.1", ports[0])})
            config = WorkerConfig("w1", slots=2)
            remote = RemoteWorker([("routers.example", 9000)], config, FakeDecoder(),
                                  resolve_interval_s=0.1, resolve=resolve)  # fmt: skip
            nursery.start_soon(remote.run)
            await wait_until(routers[0], lambda s: "w1" in healthy(s))
            assert set(remote.links) == {"ra"}
            answers.append({("127.0.0.1", ports[0]), ("127.0.0.1", ports[1])})
            await wait_until(routers[1], lambda s: "w1" in healthy(s))
            assert set(remote.links) == {"ra", "rb"}
            assert remote.host.worker.links() == {"ra": 0, "rb": 0}
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("secure", [False, True], ids=["open", "keys-and-tls"])
def test_the_cluster_command_answers_through_its_balancer_and_stops_cleanly(secure: bool) -> None:
    key = "sk-cluster-test"
    command = [sys.executable, "-m", "adapters.cli", "cluster", "--routers", "2",
               "--workers", "2", "--fake", "--port", "0"]  # fmt: skip
    command += ["--api-key", key, "--tls"] if secure else []
    headers = {"Authorization": f"Bearer {key}"} if secure else {}
    cluster = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True)  # fmt: skip
    try:
        log = LogWatcher(cluster)
        port = log.find(r"cluster ready: http://127\.0\.0\.1:(\d+)/v1", 300).group(1)
        children = [int(m) for m in re.findall(r"pid (\d+)", "".join(log.lines))]
        assert len(children) == 4
        base = f"http://127.0.0.1:{port}"
        for i in range(4):
            content = f"through the balancer {i}"
            assert chat(base, content, 8, headers) == undisturbed(content, 8, eos=True)
        if secure:
            assert requests.get(f"{base}/v1/models", timeout=10).status_code == 401
        logs = Path(log.find(r"logs in (\S+)").group(1))
        answered = []
        for router in ("r1", "r2"):  # round robin: both routers answered
            text = (logs / f"{router}.log").read_text()
            found = re.search(r"serving fake on (http://127\.0\.0\.1:\d+)/v1", text)
            assert found is not None
            page = requests.get(f"{found.group(1)}/metrics", headers=headers, timeout=5).text
            if secure:  # the worker port is TLS, and both workers got through it
                assert "the worker port needs mutual TLS" in text, text
            counts = re.findall(r"^fencepost_requests_total\{.*\} (\S+)$", page, re.MULTILINE)
            answered.append(sum(float(count) for count in counts))
        # two each, unless the balancer skipped a router slow to accept (2 s) on a busy
        # machine: then the other took its turn
        assert sum(answered) == 4 and min(answered) >= 1, answered
        cluster.send_signal(signal.SIGTERM)
        assert cluster.wait(60) == 0
        for pid in children:
            assert not alive(pid), f"child {pid} outlived the cluster"
    finally:
        kill_all((cluster,))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_refusal_by_one_router_stops_only_a_worker_that_serves_no_other() -> None:
    """Refused names no router, so a worker linked elsewhere keeps serving (the refusing
    address may be a second way to a router it has); refused everywhere, it stops."""

    async def main() -> None:
        config = RouterConfig(router_id="rb", heartbeat_timeout_s=30)
        routers = [Controller(RouterConfig(router_id="ra")), Controller(config)]
        async with trio.open_nursery() as nursery:
            ports = []
            for controller in routers:
                await nursery.start(controller.run)
                ports.append(await nursery.start(serve_workers, controller, "127.0.0.1", 0))
            # another process holds the id w1 at router rb
            squatter = await trio.open_tcp_stream("127.0.0.1", ports[1])
            await squatter.send_all(encode_frame(Register("w1")))

            async def heartbeats() -> None:
                for seq in range(1, 200):  # alive for the test's length, at most 20 s
                    await squatter.send_all(encode_frame(Heartbeat("w1", 0, seq, 1, 1, 2048)))
                    await trio.sleep(0.1)

            nursery.start_soon(heartbeats)
            await wait_until(routers[1], lambda s: "w1" in healthy(s))
            both = [("127.0.0.1", ports[0]), ("127.0.0.1", ports[1])]
            linked = RemoteWorker(both, WorkerConfig("w1"), FakeDecoder(), refused_grace_s=0.3)
            nursery.start_soon(linked.run)
            await wait_until(routers[0], lambda s: "w1" in healthy(s))
            alone = RemoteWorker([both[1]], WorkerConfig("w1"), FakeDecoder(), refused_grace_s=0.3)
            with trio.fail_after(20):
                await alone.run()  # returns: refused for the grace, and linked nowhere
            assert alone.refused is not None and not alone.links
            assert linked.refused is None and set(linked.links) == {"ra"}
            nursery.cancel_scope.cancel()
        await squatter.aclose()

    trio.run(main)


def test_a_second_address_of_a_linked_router_is_no_taken_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Refused names the refusing router: a worker that reaches a router it is linked to
    already through another address (a forwarder here, a name with two addresses in a
    cluster) keeps its link and takes the refusal quietly."""
    from adapters.cli.cluster import splice

    async def main() -> None:
        controller = Controller(RouterConfig(router_id="ra"))
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            port = await nursery.start(serve_workers, controller, "127.0.0.1", 0)

            async def forward(stream: trio.SocketStream) -> None:
                upstream = await trio.open_tcp_stream("127.0.0.1", port)
                await splice(stream, upstream)

            serve_forwarder = partial(trio.serve_tcp, forward, 0, host="127.0.0.1")
            [second] = await nursery.start(serve_forwarder)
            other = second.socket.getsockname()[1]
            both = [("127.0.0.1", port), ("127.0.0.1", other)]
            worker = RemoteWorker(both, WorkerConfig("w1"), FakeDecoder(), refused_grace_s=0.3)
            nursery.start_soon(worker.run)
            await wait_until(controller, lambda s: "w1" in healthy(s))
            with trio.fail_after(20):  # past the grace: one of the two addresses was refused
                while not any(quiet in r.message for r in caplog.records):
                    await trio.sleep(0.05)
            assert worker.refused is None and set(worker.links) == {"ra"}
            [view] = controller.statistics().router.workers
            assert view.healthy and view.epoch == 0  # the first link was never replaced
            nursery.cancel_scope.cancel()

    quiet = "linked already through another address"
    with caplog.at_level("INFO", logger="fencepost.tcp"):
        trio.run(main)
    assert any(quiet in r.message for r in caplog.records)
    assert not [r for r in caplog.records if "keeps refusing" in r.message]


def test_a_router_link_ends_when_the_router_stops_acknowledging() -> None:
    """A router host that vanishes sends no FIN: the worker's links ask the kernel to end
    a connection whose bytes stay unacknowledged for router_silence_s (Linux)."""
    from adapters.runtime.tcp_link import TransportLimits
    from adapters.runtime.tcp_worker import notice_silence

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def hold(stream: trio.SocketStream) -> None:
                await stream.receive_some()

            serving = partial(trio.serve_tcp, hold, 0, host="127.0.0.1")
            [listener] = await nursery.start(serving)
            port = listener.socket.getsockname()[1]
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            notice_silence(stream, TransportLimits().router_silence_s)
            assert stream.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                assert stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
                assert stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
            await stream.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
