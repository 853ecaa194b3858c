"""The simulator's oracles beyond the stream: they judge what they should, and only that."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from core.ledger import Ledger
from core.protocol import (
    Assignment,
    Finished,
    GenerationRequest,
    Heartbeat,
    Resend,
    SendToRouter,
    StartDecode,
    Token,
    TokenRun,
    WorkerStart,
)
from sim.cluster import Cluster, Packet
from sim.disturbances import FENCE_CAUSES, Disturbances
from sim.scenario import FAULT_KINDS


def test_a_disturbance_explains_losses_during_it_and_for_a_grace_period_after() -> None:
    seen = Disturbances(grace_s=1.0)
    seen.add("w0", "stall", 5.0, 6.0)
    assert seen.explains("w0", since=4.0, until=5.5)  # the attempt lived through it
    assert seen.explains("w0", since=6.5, until=8.0)  # offered just after: consequences
    assert not seen.explains("w0", since=7.5, until=9.0)  # offered after the grace
    assert not seen.explains("w0", since=1.0, until=4.9)  # lost before it began
    assert not seen.explains("w1", since=0.0, until=10.0)  # another worker's fault
    assert not seen.explains("w0", 4.0, 5.5, kinds={"decoder_failure"})


def test_an_open_disturbance_lasts_until_it_is_closed() -> None:
    seen = Disturbances(grace_s=0.5)
    drain = seen.add("w0", "drain", 2.0, math.inf)
    assert seen.quiet_since("w0") == math.inf
    assert seen.explains("w0", 100.0, 101.0)
    seen.close("w0", drain, 3.0)
    assert seen.quiet_since("w0") == 3.0
    assert not seen.explains("w0", 100.0, 101.0)
    assert seen.quiet_since("w1") == -math.inf


def test_fence_counters_need_one_of_their_causes() -> None:
    cluster = Cluster(["w0"], disturbances=Disturbances(grace_s=1.0))
    oracles = cluster.oracles
    oracles.check_fences(Counter({"router.late": 3, "router.duplicate_result": 1}), set())
    assert oracles.violations == []  # these move without any fault
    oracles.check_fences(Counter({"router.gap": 2}), {"loss"})
    assert oracles.violations == []
    oracles.check_fences(Counter({"router.gap": 2}), {"crash"})
    assert "router.gap" in oracles.violations[0]
    oracles.check_fences(Counter({"router.over_budget": 1}), set(FAULT_KINDS))
    assert "only a bug" in oracles.violations[1]


def test_every_cause_named_is_a_fault_the_simulator_injects_or_a_run_event() -> None:
    known = set(FAULT_KINDS) | {"attempt_lost", "resend", "overtake", "handoff_back"}
    for reason, causes in FENCE_CAUSES.items():
        assert causes <= known, (reason, causes - known)


def test_a_release_for_absence_needs_a_heartbeat_sent_after_the_worker_ended_it() -> None:
    cluster = Cluster(["w0"])
    seen = cluster.worker_oracles
    assignment = Assignment("r0", 1)
    request = GenerationRequest("r0", (1, 2, 3), 4)

    def beat(seq: int) -> Heartbeat:
        return Heartbeat("w0", 0, seq, 2, 2, 4096)

    seen.after_worker("w0", WorkerStart(), [SendToRouter(beat(10))])
    seen.after_worker("w0", WorkerStart(), [StartDecode(assignment, request)])
    seen.after_worker("w0", WorkerStart(), [SendToRouter(beat(11))])
    seen.after_worker("w0", WorkerStart(), [SendToRouter(Finished(assignment, "eos", 3))])
    seen.after_worker("w0", WorkerStart(), [SendToRouter(beat(12))])
    assert seen.ended_before("w0", "", beat(10), assignment) is False  # before it took it
    assert seen.ended_before("w0", "", beat(11), assignment) is False  # while it ran
    assert seen.ended_before("w0", "", beat(12), assignment) is True
    assert seen.ended_before("w0", "", beat(13), assignment) is None  # no worker sent it


def _streaming(cluster: Cluster, tokens: int) -> list[Packet]:
    """One request on w0, accepted, with `tokens` decoded: their Token packets,
    taken off the wire (everything else delivered)."""
    while cluster.in_flight:  # the worker's first heartbeat: the router knows it
        cluster.deliver(0)
    cluster.submit(GenerationRequest("r0", (5, 6, 7), 8))
    taken: list[Packet] = []
    for _ in range(200):
        if cluster.in_flight:
            packet = cluster.in_flight.pop(0)
            if isinstance(packet.message, Token):
                taken.append(packet)
            else:
                cluster.deliver_packet(packet)
        elif len(taken) < tokens and cluster.decoders.running():
            cluster.decoders.step(*cluster.decoders.running()[0])
        else:
            break
    assert len(taken) == tokens
    return taken


def _oracles_with_a_lazy_router(monkeypatch: pytest.MonkeyPatch, lazy: bool) -> Cluster:
    if lazy:  # the bug: a gap is fenced and never asked again
        monkeypatch.setattr(Ledger, "_ask_resend", lambda self, req, out: None)
    return Cluster(["w0"], disturbances=Disturbances(grace_s=1.0))


@pytest.mark.parametrize("lazy", [False, True])
def test_a_fenced_gap_is_asked_again_at_once(monkeypatch: pytest.MonkeyPatch, lazy: bool) -> None:
    cluster = _oracles_with_a_lazy_router(monkeypatch, lazy)
    first, second = _streaming(cluster, 2)
    cluster.deliver_packet(second)  # token 1 past the lost token 0: a gap
    resends = [p.message for p in cluster.in_flight if isinstance(p.message, Resend)]
    if lazy:
        assert resends == []
        assert "asked for nothing (last Resend never" in cluster.oracles.violations[0]
    else:
        assert resends == [Resend(first.message.assignment, 0)]
        assert cluster.oracles.violations == []


def test_a_gap_within_the_rate_limit_needs_no_second_resend() -> None:
    cluster = Cluster(["w0"], disturbances=Disturbances(grace_s=1.0))
    _, second, third = _streaming(cluster, 3)
    cluster.deliver_packet(second)
    cluster.advance(cluster.now + cluster.router.config.resend_interval_s / 2)
    cluster.deliver_packet(third)  # the same gap, inside the interval: nothing asked
    resends = [p for p in cluster.in_flight if isinstance(p.message, Resend)]
    assert len(resends) == 1
    assert cluster.oracles.violations == []


@pytest.mark.parametrize("explained", [False, True])
def test_a_resent_run_reaches_the_client_within_a_network_delay(explained: bool) -> None:
    disturbances = Disturbances(grace_s=0.5)
    disturbances.delay_max_s = 0.01
    cluster = Cluster(["w0"], disturbances=disturbances)
    _, second = _streaming(cluster, 2)
    cluster.deliver_packet(second)
    [resend] = [p for p in cluster.in_flight if isinstance(p.message, Resend)]
    cluster.in_flight.remove(resend)
    cluster.deliver_packet(resend)  # the worker answers with tokens 0 and 1 ...
    [run] = [p for p in cluster.in_flight if isinstance(p.message, TokenRun)]
    cluster.in_flight.remove(run)  # ... which never reach the router
    if explained:
        disturbances.add("w0", "loss", cluster.now, cluster.now)
    cluster.advance(cluster.now + 0.2)
    cluster.oracles.check_progress(cluster.now, slack_s=1.0)
    if explained:
        assert cluster.oracles.violations == []
    else:
        assert "w0 resent" in cluster.oracles.violations[0]
        assert "the client has 0 tokens" in cluster.oracles.violations[0]
