"""Deterministic simulation of a fencepost cluster under swarm-drawn faults.

One root seed decides everything: the swarm (which fault kinds are on and how
often they strike), the clients (arrivals, prompts, cancels), the network
(per-message delays, so messages reorder) and the fault schedule. Each random
stream is a stdlib Random seeded from (root seed, stream name), so changing
how one stream is used does not shift the others. One Clock (sim/clock.py)
holds virtual time and every scheduled thing: clients, packets, decoder
steps, faults and the machines' timers; time jumps from one entry to the
next. There is no wall clock and no trio here.

A run has two phases. During the fault phase every fault kind the swarm
switched on may strike. At `fault_end_s` everything heals (crashed workers
restart, stalled ones resume, partitions close, the network stops dropping,
duplicating and delaying extra) and the liveness phase begins: every request
must reach its terminal outcome and every slot must come back within
`liveness_budget_s` of virtual time, plus the time the remaining work would
take if it ran one token at a time on the slowest worker (so a slow, small
cluster is given time to drain, while a stuck one still fails). Safety
oracles (sim.cluster) run after every single event in both phases.

Several routers: a scenario with `routers` > 1 (every fourth seed of the
standard mix runs two or three) has every worker linked to every router and
the clients spread over the routers by a load balancer that skips a router
that is down. Its own fault, drawn from its own random stream so that the
single-router seeds draw as before: router_crash, a router process killed
(its clients' streams are cut, and each cut client sends its request again
through the balancer a moment later), the workers seeing each link close
after a short notice, and a new incarnation of the router starting after a
downtime (or at the heal), with every running worker registering with it.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from random import Random

from core.batching import BatchLimits, StepPlan
from core.protocol import (
    Assignment,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    Finished,
    GenerationRequest,
    Heartbeat,
    Offer,
    OfferResult,
    Sampling,
    Token,
)
from sim.clock import Clock
from sim.cluster import Cluster, Packet
from sim.decoders import MISBEHAVIOURS
from sim.disturbances import Disturbances
from sim.invariants import InvariantViolation
from sim.scenario import (
    KV_BLOCK,
    LONGEST_PROMPT,
    STANDARD,
    Scenario,
    draw_prompt,
    draw_router_faults,
    draw_swarm,
)
from sim.streams import error_causes, outcomes
from sim.timeline import Timeline

MAX_EVENTS = 2_000_000  # a long run takes about 60,000


@dataclass
class SimResult:
    seed: int
    violation: str | None
    requests: int
    tokens_delivered: int
    events: int
    virtual_time_s: float
    outcomes: Counter[str]
    faults: Counter[str]
    fenced: Counter[str]
    resumes: int = 0  # streams continued on another worker after their first token
    attempts_lost: int = 0  # attempts the router let go of (each explained by a fault)
    waste_s: float = 0.0  # assignment-seconds spent on work the router did not want
    errors: Counter[str] = field(default_factory=Counter)  # error outcomes by cause
    most_completed: int = 0  # outputs completed by the busiest worker process
    prefill_tokens: tuple[int, int] = (0, 0)  # context tokens admitted, and computed
    routers: int = 1
    client_retries: int = 0  # requests sent again after their router died
    full_declines: int = 0  # attempts a worker declined for want of a slot
    handoffs: tuple[int, int] = (0, 0)  # streams handed off by draining workers; gone back
    preemptions: tuple[int, int] = (0, 0)  # sequences preempted by recompute; tokens redone
    trace_hash: str | None = None
    trace_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None


class Simulation:
    """One seeded run. `trace` keeps every line (and a hash of them all)."""

    def __init__(
        self,
        seed: int,
        scenario: Scenario | None = None,
        trace: bool = False,
        trace_tail: int = 40,
        echo: bool = False,
        timeline: Timeline | None = None,
    ) -> None:
        self.seed = seed
        self.scenario = (scenario or STANDARD).for_seed(seed)
        self.swarm = draw_swarm(Random(f"{seed}/swarm"), self.scenario)
        self._net = Random(f"{seed}/net")
        self._faults_rng = Random(f"{seed}/faults")
        self._clients_rng = Random(f"{seed}/clients")
        self._decoder_rng = Random(f"{seed}/decoder")
        self._logprobs_rng = Random(f"{seed}/logprobs")  # its own: the other draws stay put
        self._routers_rng = Random(f"{seed}/routers")  # likewise
        self._finish_rng = Random(f"{seed}/finish")  # likewise: the finish_lost fault
        self.router_faults = draw_router_faults(self._routers_rng, self.scenario)
        self.clock = Clock()  # the one clock and event queue: ours and the machines' timers
        self.faults: Counter[str] = Counter()
        self.healed = False
        self._partitions: list[tuple[str, str, float]] = []  # (worker, direction, until)
        self._history: deque[Packet] = deque(maxlen=256)
        # Per directed link (worker, router, direction): the latest-sent control message
        # (anything but a Token) delivered so far, to see one land after a later one.
        self._control_landed: dict[tuple[str, str, str], deque[tuple[int, object]]] = {}
        self._decode_pending: dict[str, bool] = {}
        self._generation: dict[str, int] = {}
        self._resume_at: dict[str, float] = {}
        self._misbehaving_until: dict[str, float] = {}
        self._hung_until: dict[str, float] = {}
        self._hangs: dict[str, list[float | str]] = {}  # worker -> its open disturbance
        self._limits: dict[str, BatchLimits] = {}
        self._draining: dict[str, list[float | str]] = {}  # worker -> its open disturbance
        self._open_crash: dict[str, list[float | str]] = {}
        router = self.scenario.router
        self._delay_max_s = self.swarm.delay_max_s
        # A packet this slow can by itself make the router give up on an attempt (an
        # offer's round trip past the offer timeout, ...): it counts as a disturbance.
        self._slow_packet_s = min(router.offer_timeout_s, router.heartbeat_timeout_s) / 2
        self.disturbances = Disturbances(
            grace_s=router.heartbeat_timeout_s
            + router.offer_timeout_s
            + self.scenario.heartbeat_interval_s
            + 2 * self._delay_max_s
        )
        if "delay_spread" in self.swarm.enabled:
            self.disturbances.note("delay_spread")
        self.disturbances.delay_max_s = self._delay_max_s
        self.disturbances.slow = frozenset(
            f"w{i}" for i, slow in enumerate(self.swarm.slowness) if slow > 1.0
        )
        # How long a worker may keep an assignment the router does not want, once it and
        # its link are undisturbed: a heartbeat reports it, the Cancel comes back.
        self._waste_every_s = 0.05
        # A placed request whose worker stopped producing must be given up within its
        # progress deadline plus this (an offer's timeout, a heartbeat's expiry, delays).
        self._progress_slack_s = (
            router.offer_timeout_s
            + router.heartbeat_timeout_s
            + router.resend_interval_s
            + 2 * self._delay_max_s
            + self._waste_every_s
        )
        self._waste_bound_s = (
            self.scenario.heartbeat_interval_s + 2 * self._delay_max_s + self._waste_every_s + 0.01
        )
        worker_ids = [f"w{i}" for i in range(self.scenario.workers)]
        self._slowness = dict(zip(worker_ids, self.swarm.slowness, strict=True))
        self._hash = hashlib.blake2b(digest_size=16) if trace else None
        self._tail: deque[str] = deque(maxlen=trace_tail)
        self._echo = echo
        self.events = 0
        self.cluster = Cluster(
            [],
            self.scenario.router,
            heartbeat_interval_s=self.scenario.heartbeat_interval_s,
            on_send=self._on_send,
            trace=self._trace if trace else None,
            clock=self.clock,
            disturbances=self.disturbances,
            kv_block_size=KV_BLOCK,
            largest_request=LONGEST_PROMPT + self.scenario.mean_new_tokens * 3 // 2 + 1,
            routers=self.scenario.routers,
        )
        self._pending_clients = 0  # arrivals (and cut clients' retries) still to come
        self._placed: dict[int, tuple[str, str]] = {}  # client -> (router id, request id)
        self._client_retries = 0
        self._router_down: dict[str, float] = {}  # router place -> when it comes back
        self._trace_on = trace
        self._worker_ids = worker_ids
        self.timeline = timeline
        if timeline is not None:
            timeline.seed = seed
            timeline.routers = list(self.cluster.router_names)
            timeline.workers = list(worker_ids)
            self.cluster.on_deliver = self._handed
        # finish_lost: when each strikes (at the first completion from then on); the
        # requests whose Finished it took; their continuations, whose acceptance waits.
        window = self.scenario.fault_end_s
        self._finish_at = sorted(
            self._finish_rng.uniform(0.5, window) for _ in range(self.swarm.finish_losses)
        )
        self._completing: set[tuple[str, str]] = set()
        self._overtaken: dict[Assignment, Packet | None] = {}
        self._plan_clients()
        self._plan_faults(worker_ids)
        for at, which, downtime in self.router_faults.crashes:
            self.clock.schedule(at, self._crash_router, self.cluster.router_names[which], downtime)
        self.clock.schedule(self.scenario.fault_end_s, self._heal)

    # --- the run ---

    def run(self) -> SimResult:
        if self._trace_on:
            self._trace(f"seed {self.seed} swarm {sorted(self.swarm.enabled)}")
        for index, worker_id in enumerate(self._worker_ids):
            slots = self.swarm.slots[index]
            self.cluster.decoders.pool_share[worker_id] = self.swarm.pool_share[index]
            assert self.cluster.start_worker(worker_id, slots=slots)
            chunk = self.swarm.max_prefill_tokens
            self._limits[worker_id] = BatchLimits(
                max_seqs=slots,
                max_context=self.cluster.max_context,
                max_step_tokens=slots + chunk,
                max_prefill_tokens=chunk,
                max_idle_prefill_tokens=2 * chunk,
            )
            self._decode_pending[worker_id] = False
            self._generation[worker_id] = 0
        violation: str | None = None
        self._liveness_deadline = math.inf  # set when everything heals
        try:
            cluster = self.cluster
            while (at := self.clock.next_time()) is not None and at <= self._liveness_deadline:
                self.clock.run_next()
                self.events += 1
                if self.events > MAX_EVENTS:  # a livelock (a timer re-armed in the past...)
                    raise InvariantViolation(f"more than {MAX_EVENTS} events: a livelock")
                cluster.invariants.check_safety()
                now = self.clock.now
                cluster.worker_oracles.check_waste(now, self._waste_bound_s, self._waste_every_s)
                for node in cluster.nodes.values():
                    node.oracles.check_progress(now, self._progress_slack_s)
                self._schedule_decoders()
                if self.healed and self._settled():
                    break
            if not self._settled():
                budget = self._liveness_deadline - self.scenario.fault_end_s
                violation = f"liveness: not settled {budget:.1f}s after heal: "
                violation += (
                    "; ".join(self.cluster.invariants.unsettled_reasons()) or "decoders running"
                )
            else:
                self.cluster.invariants.check_end(self.disturbances.kinds)
        except InvariantViolation as error:
            violation = f"safety: {error}"
        except Exception as error:  # a machine raised: as much a finding as a bad delivery
            violation = f"crash: {type(error).__name__}: {error}"
        if self.timeline is not None:
            self._close_timeline(self.timeline, violation)
        return self._result(violation)

    def _arrive(self, client: int, request: GenerationRequest) -> None:
        """A client's request reaches the load balancer, which sends it to the router
        whose turn it is, or the next live one; with every router down it tries again
        a moment later."""
        cluster = self.cluster
        live = cluster.live_routers()
        if not live:
            self.clock.schedule(self.clock.now + 0.1, self._arrive, client, request)
            return
        self._pending_clients -= 1
        if not cluster.shared:
            router_id = live[0]
        else:
            names = cluster.router_names
            turn = client % len(names)
            places = {cluster.nodes[r].name: r for r in live}
            router_id = next(
                places[names[(turn + k) % len(names)]]
                for k in range(len(names))
                if names[(turn + k) % len(names)] in places
            )
            # Each router numbers its own requests: ids collide across routers.
            node = cluster.nodes[router_id]
            request = request.renamed(node.new_request_id())
        self._placed[client] = (router_id, request.request_id)
        if self.timeline is not None:
            place = cluster.router_place(router_id)
            self.timeline.arrived(
                _key(router_id, request.request_id), client, place, self.clock.now
            )
        cluster.submit(request, router_id)

    def _client_cancel(self, client: int) -> None:
        placed = self._placed.get(client)
        if placed is None:
            return  # not sent yet (every router was down): it gives up before it starts
        router_id, request_id = placed
        if not self.cluster.has_outcome(request_id, router_id):
            self.disturbances.note("client_cancel")
            self.cluster.cancel(request_id, router_id)

    # --- routers (shared-workers runs) ---

    def _crash_router(self, name: str, downtime: float) -> None:
        """kill -9 of a router process: its clients' streams are cut, the workers see
        each link close after a notice, and it comes back as a new incarnation."""
        cluster = self.cluster
        if self.healed or len(cluster.live_routers()) < 2 or name in self._router_down:
            return  # keep one router up: a cluster with none serves nobody to judge
        [router_id] = [r for r in cluster.live_routers() if cluster.nodes[r].name == name]
        self._fault("router_crash", f"{router_id} for {downtime:.2f}s")
        if self.timeline is not None:
            now = self.clock.now
            self.timeline.fault(f"router {name}", now, now + downtime, "router_crash")
        self.disturbances.note("router_crash")  # no worker's disturbance: none is touched
        node = cluster.nodes[router_id]
        cut = [s for s in node.streams.values() if s.outcome is None]
        rng = self._routers_rng
        for worker_id in cluster.crash_router(router_id):
            notice = rng.uniform(0.0, self.router_faults.notice_max_s)
            self.clock.schedule(
                self.clock.now + notice, cluster.router_link_lost, worker_id, router_id
            )
        for stream in cut:  # the client sees its connection drop and sends it again
            self._pending_clients += 1
            self._client_retries += 1
            again = self.clock.now + rng.uniform(0.0, self.router_faults.client_retry_max_s)
            client = -self._client_retries  # a new client: its cancel (if any) is not re-sent
            self.clock.schedule(again, self._arrive, client, stream.request)
        self._router_down[name] = self.clock.now + downtime
        self.clock.schedule(self.clock.now + downtime, self._restart_router, name)

    def _restart_router(self, name: str) -> None:
        if name in self._router_down:
            del self._router_down[name]
            node = self.cluster.start_router(name)
            self._trace_note(f"router {name} starts again as {node.router_id}")

    def _scheduled_restart(self, worker_id: str) -> None:
        if self.cluster.is_down(worker_id):  # the heal may have restarted it already
            self._restart(worker_id)
            if not self.healed and self._faults_rng.random() < 0.25:
                # A crash loop: the new process dies too, often before the router hears it.
                again = self.clock.now + self._faults_rng.uniform(0.0, 0.3)
                self.clock.schedule(again, self._crash, worker_id)

    def _decoder_failure(self, worker_id: str) -> None:
        if not self.healed and self.cluster.alive(worker_id):
            self._fault("decoder_failure", worker_id)
            self._disturb(worker_id, "decoder_failure", 0.0)
            self.cluster.fail_decoder(worker_id)

    def _decoder_misbehaves(self, worker_id: str, duration_s: float) -> None:
        if not self.healed and self.cluster.alive(worker_id):
            self._fault("decoder_misbehaves", f"{worker_id} {duration_s:.2f}s")
            self._disturb(worker_id, "decoder_misbehaves", duration_s)
            self._misbehaving_until[worker_id] = self.clock.now + duration_s

    def _decoder_hang(self, worker_id: str, duration_s: float) -> None:
        """The decoder's forward pass stops returning; the worker machine and its
        heartbeats go on, listing assignments that make no progress."""
        if self.healed or not self.cluster.alive(worker_id) or worker_id in self._hung_until:
            return
        self._fault("decoder_hang", f"{worker_id} {duration_s:.2f}s")
        until = self.clock.now + duration_s
        self._hung_until[worker_id] = until
        self._hangs[worker_id] = self._disturb(worker_id, "decoder_hang", duration_s)
        if until < math.inf:
            self.clock.schedule(until, self._decoder_unhang, worker_id, until)
        elif self._faults_rng.random() < 0.5:  # a supervisor kills and restarts it at once
            rng = self._faults_rng
            at, downtime = self.clock.now + rng.uniform(2.0, 6.0), rng.uniform(0.05, 0.3)
            self.clock.schedule(at, self._crash, worker_id, downtime)

    def _decoder_unhang(self, worker_id: str, until: float) -> None:
        if self._hung_until.get(worker_id) == until:
            del self._hung_until[worker_id]
            hang = self._hangs.pop(worker_id)
            self.disturbances.close(worker_id, hang, self.clock.now)
            self._trace_note(f"decoder of {worker_id} runs again")

    def _impostor(self, worker_id: str) -> None:
        """A second process registers as worker_id (a copy-pasted id), then leaves.

        Refused while the real worker is live. Accepted only when the router had
        already lost the real one (it was crashed, stalled or cut off): then the
        real process's connection is closed by the router and it registers again,
        and the impostor's own connection closes a moment later."""
        if self.healed:
            return
        cluster = self.cluster
        was_disturbed = self.disturbances.explains(worker_id, self.clock.now, self.clock.now)
        router_id = cluster.live_routers()[0]
        epoch = cluster.register(worker_id, router_id)
        if epoch is None:
            self._fault("impostor", f"{worker_id} refused")
            return
        self._fault("impostor", f"{worker_id} accepted as epoch {epoch}")
        if was_disturbed:  # taking over a lost worker's id is fair; a live one's is a bug
            self._disturb(worker_id, "impostor", 0.5)
        if not cluster.is_down(worker_id):
            self._stop_process(worker_id)  # its connection was closed: a new session
            self.clock.schedule(self.clock.now + 0.05, self._scheduled_restart, worker_id)
        leaves = self.clock.now + self._faults_rng.uniform(0.05, 0.5)
        self.clock.schedule(leaves, cluster.worker_gone, worker_id, epoch, router_id)

    def _future_epoch(self, worker_id: str, ahead: int) -> None:
        """A heartbeat under worker_id naming an epoch the router never handed out
        (a process whose idea of its epoch came from a clock running ahead)."""
        if self.healed:
            return
        router_id = self.cluster.live_routers()[0]
        if router_id not in self.cluster.links(worker_id):
            return  # not linked there now (down, or that router just came up)
        self._fault("future_epoch", f"{worker_id} +{ahead}")
        self.disturbances.note("future_epoch")  # explains the fence, disturbs nothing
        epoch = self.cluster.epoch(worker_id, router_id) + ahead
        heartbeat = Heartbeat(worker_id, epoch, 1, 4, 4, 4096)
        self.cluster.inject_heartbeat(heartbeat, router_id)

    def _misbehaviour(self, worker_id: str) -> str | None:
        """How this step of a misbehaving decoder goes wrong, if it does."""
        until = self._misbehaving_until.get(worker_id)
        if until is None or self.healed or self.clock.now >= until:
            return None
        rng = self._decoder_rng
        return rng.choice(MISBEHAVIOURS) if rng.random() < 0.3 else None

    def _settled(self) -> bool:
        return self._pending_clients == 0 and self.cluster.invariants.settled()

    # --- clients ---

    def _plan_clients(self) -> None:
        rng = self._clients_rng
        scenario = self.scenario
        t = 0.0
        mean_gap = scenario.arrival_window_s / scenario.requests
        for index in range(scenario.requests):
            t += rng.expovariate(1.0 / mean_gap)
            t = min(t, scenario.arrival_window_s)
            prompt = draw_prompt(rng)
            mean, spread = scenario.mean_new_tokens, scenario.mean_new_tokens // 2
            max_new = rng.randint(mean - spread, mean + spread)
            seed = rng.randrange(2**32) if rng.random() < 0.7 else None
            temperature = rng.choice((0.0, 0.7))
            asks = self._logprobs_rng
            logprobs = asks.choice((0, 1, 5, 20)) if asks.random() < 0.3 else None
            request = GenerationRequest(
                f"r{index}",
                prompt,
                max(1, max_new),
                Sampling(temperature, 1.0, seed),
                logprobs=logprobs,
            )
            self._pending_clients += 1
            self.clock.schedule(t, self._arrive, index, request)
            if rng.random() < self.swarm.cancel_rate:
                # Some clients give up at once (a stop button, a short client timeout),
                # often while the offer is still on its way; the rest at any moment.
                after = rng.uniform(0.0, 0.1) if rng.random() < 0.3 else rng.uniform(0.0, 3.0)
                self.clock.schedule(t + after, self._client_cancel, index)

    # --- network ---

    def _on_send(self, packet: Packet) -> None:
        if (self._finish_at or self._overtaken) and self._finish_lost(packet):
            return
        rng = self._net
        swarm = self.swarm
        delay = rng.uniform(swarm.delay_min_s, swarm.delay_max_s)
        worker_id = _worker_of(packet)
        if delay > self._slow_packet_s:
            self._disturb(worker_id, "slow_packet", delay)
        if self.healed:
            self.clock.schedule(self.clock.now + delay, self._deliver, packet, self._sent(packet))
            return
        if rng.random() < swarm.loss_rate:
            self._fault("loss", _brief(packet))
            self._disturb(worker_id, "loss", 0.0)
            if self.timeline is not None:
                self.timeline.lost(self._sent(packet), self.clock.now)
            return
        copy = ""
        if rng.random() < swarm.late_rate:
            delay += rng.uniform(0.5, 3.0)
            self._fault("late", _brief(packet))
            self._disturb(worker_id, "late", delay)
            copy = "late"
        self.clock.schedule(self.clock.now + delay, self._deliver, packet, self._sent(packet, copy))
        if rng.random() < swarm.duplicate_rate:
            self._fault("duplicate", _brief(packet))
            extra = rng.uniform(swarm.delay_min_s, swarm.delay_max_s * 2)
            self._disturb(worker_id, "duplicate", extra)
            flight = self._sent(packet, "duplicate")
            self.clock.schedule(self.clock.now + extra, self._deliver, packet, flight)
        if self._history and rng.random() < swarm.replay_rate:
            old = self._history[rng.randrange(len(self._history))]
            self._fault("replay", _brief(old))
            later = rng.uniform(0.01, 2.0)
            self._disturb(_worker_of(old), "replay", later)
            self.clock.schedule(
                self.clock.now + later, self._deliver, old, self._sent(old, "replay")
            )
        self._history.append(packet)

    def _finish_lost(self, packet: Packet) -> bool:
        """The finish_lost fault. A worker's Finished of a completed output is lost and
        the worker dies with it (its last token already sent), so the router resumes a
        stream whose every token the client has; that continuation's acceptance is then
        held back until its own Finished has gone out, which overtakes it. True: the
        packet is taken (lost, or held back)."""
        message, now = packet.message, self.clock.now
        match message:
            case Finished(assignment, reason) if packet.to is None:
                if assignment in self._overtaken:  # the continuation's end: let it overtake
                    held = self._overtaken.pop(assignment)
                    if held is not None:
                        later = now + self._delay_max_s + self._finish_rng.uniform(0.001, 0.01)
                        self.clock.schedule(later, self._deliver, held, self._sent(held, "late"))
                    return False
                if (
                    reason not in ("eos", "length")
                    or not self._finish_at
                    or now < self._finish_at[0]
                    or self.healed
                    or not self.cluster.alive(packet.source)
                ):
                    return False
                self._finish_at.pop(0)
                self._fault("finish_lost", f"{packet.source} {assignment}")
                self._disturb(packet.source, "loss", 0.0)
                if self.timeline is not None:
                    self.timeline.lost(self._sent(packet), now)
                self._completing.add((packet.router, assignment.request_id))
                downtime = self._finish_rng.uniform(0.1, 1.0)
                self.clock.schedule(now, self._crash, packet.source, downtime)
                return True
            case Offer(assignment=assignment, request=request) if request.output_prefix:
                key = (packet.router, assignment.request_id)
                if key in self._completing:
                    self._completing.discard(key)
                    self._overtaken[assignment] = None
            case OfferResult(assignment=assignment, accepted=True):
                if assignment in self._overtaken and self._overtaken[assignment] is None:
                    # Held back until its Finished is sent (or, at the latest, just
                    # within the offer timeout).
                    self._overtaken[assignment] = packet
                    hold_s = 0.8 * self.scenario.router.offer_timeout_s
                    self._disturb(packet.source, "late", hold_s)
                    self.clock.schedule(now + hold_s, self._release_result, assignment)
                    return True
        return False

    def _release_result(self, assignment: Assignment) -> None:
        held = self._overtaken.pop(assignment, None)
        if held is not None:
            self._deliver(held, self._sent(held, "late"))

    def _deliver(self, packet: Packet, flight: int = -1) -> None:
        worker_id = _worker_of(packet)
        direction = "from_worker" if packet.to is None else "to_worker"
        if self._cut(worker_id, direction):
            self._fault("partition_drop", _brief(packet))
            self._landed(flight, "cut by a partition")
            return
        if packet.to is not None and self.cluster.is_paused(packet.to):
            # A stalled process reads its socket only when it resumes.
            self.clock.schedule(self._resume_at[packet.to], self._deliver, packet, flight)
            return
        if "overtake" not in self.disturbances.kinds and not isinstance(packet.message, Token):
            self._note_overtake(packet, (worker_id, packet.router, direction))
        if self.timeline is None:
            self.cluster.deliver_packet(packet)
            return
        before = self.cluster.fences_at(packet)
        self.cluster.deliver_packet(packet)
        after = self.cluster.fences_at(packet) if before is not None else None
        if before is None:
            self._landed(flight, "gone: its process or router had died")
        else:
            machine = "router" if packet.to is None else "worker"
            fenced = [f"{machine}.{k}" for k, n in (after or {}).items() if n > before.get(k, 0)]
            self._landed(flight, "fenced " + ", ".join(fenced) if fenced else "delivered")

    # --- the timeline (only with one: nothing here draws from the run's random streams) ---

    def _sent(self, packet: Packet, copy: str = "") -> int:
        """The timeline's flight for one copy of a packet leaving now (-1: none kept)."""
        timeline = self.timeline
        if timeline is None:
            return -1
        place = f"router {self.cluster.router_place(packet.router)}"
        source, target = (place, packet.to) if packet.to is not None else (packet.source, place)
        about = getattr(packet.message, "assignment", None)
        request = None if about is None else _key(packet.router, about.request_id)
        return timeline.sent(self.clock.now, source, target, packet.message, request, copy)

    def _landed(self, flight: int, fate: str) -> None:
        if self.timeline is not None and flight >= 0:
            self.timeline.landed(flight, self.clock.now, fate)

    def _handed(
        self, router_id: str, delivery: DeliverToken | DeliverFinished | DeliverError
    ) -> None:
        assert self.timeline is not None
        match delivery:
            case DeliverToken():
                what = "token"
            case DeliverFinished(reason=reason) | DeliverError(kind=reason):
                what = reason
        self.timeline.handed(_key(router_id, delivery.request_id), self.clock.now, what)

    def _close_timeline(self, timeline: Timeline, violation: str | None) -> None:
        now = self.clock.now
        timeline.end_s = now
        timeline.swarm = ", ".join(sorted(self.swarm.enabled)) or "no faults"
        for worker_id, intervals in self.disturbances.intervals().items():
            for start, end, kind in intervals:
                timeline.fault(worker_id, start, end, kind)
        if violation is not None:
            timeline.failed(violation, now)

    def _note_overtake(self, packet: Packet, link: tuple[str, str, str]) -> None:
        """Each message draws its own delay, so even a quiet link reorders two messages
        sent within a delay's spread of each other (TCP would not; the simulator does on
        purpose). When a control message (anything but a Token) lands after a related
        one sent later on its link, the run event "overtake" is noted, which explains
        the fences that need reordering (a heartbeat overtaken by its worker's
        Finished, an Offer by its own Cancel). Related: about the same assignment, or
        either one about none (a heartbeat speaks of every assignment). Tokens are
        left out: the fences of one assignment's tokens have causes of their own."""
        about = getattr(packet.message, "assignment", None)
        landed = self._control_landed.setdefault(link, deque(maxlen=64))
        for ident, other in landed:
            if ident > packet.ident and (about is None or other is None or other == about):
                self.disturbances.note("overtake")
                break
        landed.append((packet.ident, about))

    def _cut(self, worker_id: str, direction: str) -> bool:
        now = self.clock.now
        self._partitions = [p for p in self._partitions if p[2] > now]
        return any(w == worker_id and d in (direction, "both") for w, d, _ in self._partitions)

    # --- decoders ---

    def _schedule_decoders(self) -> None:
        """Each worker with work and no step under way plans its next batched step
        (core.batching) and takes it after the time that step costs."""
        cluster, swarm = self.cluster, self.swarm
        for worker_id, decodes in cluster.decoders.each_worker():
            if not decodes or self._decode_pending[worker_id] or not cluster.alive(worker_id):
                continue
            if self._hung_until and self.clock.now < self._hung_until.get(worker_id, 0.0):
                continue  # hung: no step, no token; its worker heartbeats on
            plan = cluster.decoders.plan(worker_id, self._limits[worker_id])
            if not plan.tokens:
                continue
            slow = self._slowness[worker_id]
            step_s = swarm.step_s * (1 + 0.05 * len(plan.decode)) if plan.decode else 0.0
            prefill_s = swarm.prefill_s_per_token * sum(n for _, n in plan.prefill)
            self._decode_pending[worker_id] = True
            at = self.clock.now + (step_s + prefill_s) * slow
            self.clock.schedule(at, self._decode, worker_id, self._generation[worker_id], plan)

    def _decode(self, worker_id: str, generation: int, plan: StepPlan) -> None:
        if generation != self._generation[worker_id]:
            return  # scheduled for a process that has since crashed
        self._decode_pending[worker_id] = False
        if self.cluster.alive(worker_id):
            self.cluster.decoders.run(worker_id, plan, partial(self._misbehaviour, worker_id))

    # --- faults ---

    def _plan_faults(self, worker_ids: list[str]) -> None:
        rng = self._faults_rng
        window = self.scenario.fault_end_s
        for _ in range(self.swarm.crashes):
            self.clock.schedule(rng.uniform(0.5, window), self._crash, rng.choice(worker_ids))
        for _ in range(self.swarm.stalls):
            at, worker_id = rng.uniform(0.5, window), rng.choice(worker_ids)
            self.clock.schedule(at, self._stall, worker_id, rng.uniform(0.2, 3.0))
        for _ in range(self.swarm.partitions):
            at, worker_id = rng.uniform(0.5, window), rng.choice(worker_ids)
            direction = rng.choice(("to_worker", "from_worker", "both"))
            self.clock.schedule(at, self._partition, worker_id, direction, rng.uniform(0.1, 2.5))
        for _ in range(self.swarm.decoder_failures):
            self.clock.schedule(
                rng.uniform(0.5, window), self._decoder_failure, rng.choice(worker_ids)
            )
        self._crash_downtime = [rng.uniform(0.1, 2.0) for _ in range(self.swarm.crashes)]
        # Drawn after everything above, so that those draws stayed as they were.
        for _ in range(self.swarm.drains):
            self.clock.schedule(rng.uniform(0.5, window), self._drain, rng.choice(worker_ids))
        if self.swarm.rolling_restart:
            # after every draw above, from its own stream, so that those stay as they were
            start = Random(rng.random()).uniform(0.5, max(0.5, window / 2))
            self.clock.schedule(start, self._roll, tuple(worker_ids), 0)
        for _ in range(self.swarm.misbehaving_decoders):
            at, worker_id = rng.uniform(0.5, window), rng.choice(worker_ids)
            self.clock.schedule(at, self._decoder_misbehaves, worker_id, rng.uniform(0.2, 2.0))
        for _ in range(self.swarm.blackouts):
            self.clock.schedule(rng.uniform(0.5, window), self._blackout, rng.uniform(0.3, 2.0))
        for _ in range(self.swarm.impostors):
            self.clock.schedule(rng.uniform(0.5, window), self._impostor, rng.choice(worker_ids))
        for _ in range(self.swarm.future_epochs):
            at, worker_id = rng.uniform(0.5, window), rng.choice(worker_ids)
            self.clock.schedule(at, self._future_epoch, worker_id, rng.randint(1, 1000))
        for _ in range(self.swarm.hangs):
            at, worker_id = rng.uniform(0.5, window), rng.choice(worker_ids)
            # for a while, or until everything heals (as good as forever for the run)
            lasts = math.inf if rng.random() < 0.25 else rng.uniform(1.0, 8.0)
            self.clock.schedule(at, self._decoder_hang, worker_id, lasts)

    def _crash(self, worker_id: str, downtime: float | None = None) -> None:
        if self.healed or self.cluster.is_down(worker_id):
            return
        self._fault("crash", worker_id)
        if downtime is None:
            downtime = self._crash_downtime.pop() if self._crash_downtime else 1.0
        self._open_crash[worker_id] = self._disturb(worker_id, "crash", downtime)
        self._stop_process(worker_id)
        notice = self.swarm.crash_notice_s
        if notice is not None and notice < downtime:
            links = self.cluster.links(worker_id)
            self.clock.schedule(self.clock.now + notice, self._crash_notice, worker_id, links)
        self.clock.schedule(self.clock.now + downtime, self._scheduled_restart, worker_id)

    def _stop_process(self, worker_id: str) -> dict[str, int]:
        """The worker's process ends (a crash, or a drained worker exiting)."""
        self.cluster.crash_worker(worker_id)
        self._generation[worker_id] += 1
        self._decode_pending[worker_id] = False
        self._misbehaving_until.pop(worker_id, None)
        until = self._hung_until.get(worker_id)
        if until is not None:  # the process is gone; its successor's decoder is fresh
            self._decoder_unhang(worker_id, until)
        drain = self._draining.pop(worker_id, None)
        if drain is not None:
            self.disturbances.close(worker_id, drain, self.clock.now)
        return self.cluster.links(worker_id)

    def _crash_notice(self, worker_id: str, links: dict[str, int]) -> None:
        """The connections of the crashed process are seen to close (TCP resets): each
        router it was linked to hears of its own."""
        self._fault("crash_notice", worker_id)
        for router_id, epoch in links.items():
            self.cluster.worker_gone(worker_id, epoch, router_id)

    def _restart(self, worker_id: str, backoff_s: float = 0.05) -> None:
        self._trace_note(f"restart {worker_id}")
        self._generation[worker_id] += 1
        self._decode_pending[worker_id] = False
        if not self.cluster.restart_worker(worker_id):
            # Refused: the router still takes the old process for live (no notice of
            # its end yet). Register again with backoff, as a real worker does.
            again = self.clock.now + backoff_s
            self.clock.schedule(again, self._retry_registration, worker_id, min(1.0, 2 * backoff_s))
            return
        crash = self._open_crash.pop(worker_id, None)
        if crash is not None:  # the heal may restart it before its drawn downtime is over
            self.disturbances.close(worker_id, crash, self.clock.now)

    def _retry_registration(self, worker_id: str, backoff_s: float) -> None:
        if self.cluster.is_down(worker_id):
            self._restart(worker_id, backoff_s)

    def _roll(self, worker_ids: tuple[str, ...], index: int) -> None:
        """A rolling restart: drain worker `index`, then, once it is back, the next
        (each worker once; a worker down for another fault is waited for)."""
        if self.healed or index >= len(worker_ids):
            return
        worker_id = worker_ids[index]
        if self._busy(worker_id):
            self.clock.schedule(self.clock.now + 0.1, self._roll, worker_ids, index)
            return
        self._fault("rolling_restart", worker_id)
        self._drain(worker_id)
        self.clock.schedule(self.clock.now + 0.1, self._roll_next, worker_ids, index + 1)

    def _roll_next(self, worker_ids: tuple[str, ...], index: int) -> None:
        if self._busy(worker_ids[index - 1]):  # not back yet
            self.clock.schedule(self.clock.now + 0.1, self._roll_next, worker_ids, index)
            return
        self._roll(worker_ids, index)

    def _busy(self, worker_id: str) -> bool:
        """Draining, down, or not yet restarted."""
        return (
            worker_id in self._draining
            or worker_id in self._open_crash
            or not self.cluster.alive(worker_id)
        )

    def _drain(self, worker_id: str) -> None:
        """Drain (a rolling restart): no new work, the streams handed off to other
        workers (or, in some seeds, finished here); the process exits once idle, the
        transport sees its connection close, and a new epoch starts a moment later."""
        if self.healed or not self.cluster.alive(worker_id) or worker_id in self._draining:
            return
        self._fault("drain", worker_id)
        self._draining[worker_id] = self._disturb(worker_id, "drain", math.inf)
        self.cluster.drain_worker(worker_id, handoff=self.swarm.drain_handoff)
        self._drain_check(worker_id, self._generation[worker_id])

    def _drain_check(self, worker_id: str, generation: int) -> None:
        if generation != self._generation[worker_id]:
            return  # the process crashed meanwhile; its successor is not draining
        if not self.cluster.alive(worker_id) or not self.cluster.idle(worker_id):
            self.clock.schedule(self.clock.now + 0.05, self._drain_check, worker_id, generation)
            return
        self._trace_note(f"drained {worker_id} exits")
        downtime = self._faults_rng.uniform(0.05, 0.5)
        self._open_crash[worker_id] = self._disturb(worker_id, "drain", downtime)
        links = self._stop_process(worker_id)
        for router_id, epoch in links.items():  # a clean exit closes its connections
            self.cluster.worker_gone(worker_id, epoch, router_id)
        self.clock.schedule(self.clock.now + downtime, self._scheduled_restart, worker_id)

    def _stall(self, worker_id: str, duration_s: float) -> None:
        if self.healed or not self.cluster.alive(worker_id):
            return
        self._fault("stall", worker_id)
        self._disturb(worker_id, "stall", duration_s)
        self.cluster.pause_worker(worker_id)
        self._resume_at[worker_id] = self.clock.now + duration_s
        self.clock.schedule(self.clock.now + duration_s, self._resume, worker_id)

    def _resume(self, worker_id: str) -> None:
        if self.cluster.is_paused(worker_id):
            self._trace_note(f"resume {worker_id}")
            self.cluster.resume_worker(worker_id)

    def _partition(self, worker_id: str, direction: str, duration_s: float) -> None:
        if self.healed:
            return
        self._fault("partition", f"{worker_id} {direction} {duration_s:.2f}s")
        self._disturb(worker_id, "partition", duration_s)
        self._partitions.append((worker_id, direction, self.clock.now + duration_s))

    def _blackout(self, duration_s: float) -> None:
        """The router's own link fails: every worker is cut off, both ways, at once."""
        if self.healed:
            return
        self._fault("blackout", f"{duration_s:.2f}s")
        for worker_id in self._worker_ids:
            self._disturb(worker_id, "blackout", duration_s)
            self._partitions.append((worker_id, "both", self.clock.now + duration_s))

    def _heal(self) -> None:
        self.healed = True
        self._liveness_deadline = self.clock.now + self._liveness_budget()
        self._trace_note("heal: faults stop, liveness phase begins")
        self._partitions.clear()
        for worker_id, until in list(self._hung_until.items()):
            self._decoder_unhang(worker_id, until)
        for name in list(self._router_down):
            self._restart_router(name)
        for worker_id in self.cluster.crashed():
            self._restart(worker_id)
        for worker_id in self.cluster.stalled():
            self._resume_at[worker_id] = self.clock.now
            self._resume(worker_id)

    def _liveness_budget(self) -> float:
        """The fixed budget plus a serial upper bound on the work still to do."""
        swarm = self.swarm
        step_s = swarm.step_s * max(swarm.slowness) * (1 + 0.05 * max(swarm.slots))
        prefill_s = swarm.prefill_s_per_token * max(swarm.slowness)
        remaining_s = 0.0
        for request in self.cluster.open_requests():
            remaining_s += request.max_new_tokens * step_s
            remaining_s += len(request.prompt_token_ids) * prefill_s
        return self.scenario.liveness_budget_s + remaining_s

    def _disturb(self, worker_id: str, kind: str, duration_s: float) -> list[float | str]:
        now = self.clock.now
        return self.disturbances.add(worker_id, kind, now, now + duration_s)

    def _fault(self, kind: str, detail: str) -> None:
        self.faults[kind] += 1
        if self._trace_on:
            self._trace(f"{self.clock.now:9.4f} fault   {kind} {detail}")

    # --- bookkeeping ---

    def _trace(self, line: str) -> None:
        assert self._hash is not None
        self._hash.update(line.encode())
        self._tail.append(line)
        if self._echo:
            print(line)

    def _trace_note(self, text: str) -> None:
        if self._trace_on:
            self._trace(f"{self.clock.now:9.4f} sim     {text}")

    def _result(self, violation: str | None) -> SimResult:
        cluster, decoders = self.cluster, self.cluster.decoders
        return SimResult(
            seed=self.seed,
            violation=violation,
            requests=cluster.submitted(),
            tokens_delivered=cluster.tokens_delivered(),
            events=self.events,
            virtual_time_s=self.clock.now,
            outcomes=outcomes(cluster.streams()),
            faults=self.faults,
            fenced=cluster.fenced(),
            resumes=cluster.resumes(),
            attempts_lost=cluster.attempts_lost(),
            waste_s=cluster.waste_s(),
            errors=error_causes(cluster.streams()),
            most_completed=max(cluster.worker_oracles.completions.values(), default=0),
            routers=self.scenario.routers,
            client_retries=self._client_retries,
            full_declines=cluster.full_declines(),
            handoffs=cluster.handoffs(),
            preemptions=(decoders.preemptions, decoders.recomputed_tokens),
            prefill_tokens=(decoders.prefill_tokens[0], decoders.prefill_tokens[1]),
            trace_hash=self._hash.hexdigest() if self._hash is not None else None,
            trace_tail=list(self._tail),
        )


def _key(router_id: str, request_id: str) -> str:
    """A request's name across routers (their ids collide): "r3", or "a1:r3"."""
    return f"{router_id}:{request_id}" if router_id else request_id


def _worker_of(packet: Packet) -> str:
    return packet.source if packet.to is None else packet.to


def _brief(packet: Packet) -> str:
    to = packet.to or "router"
    return f"{packet.source}->{to} {type(packet.message).__name__}"


def run_seed(
    seed: int, scenario: Scenario | None = None, trace: bool = False, echo: bool = False
) -> SimResult:
    return Simulation(seed, scenario, trace=trace, echo=echo).run()
