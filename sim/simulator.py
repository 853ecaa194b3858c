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
oracles (sim/invariants.py and the oracles it raises) run after every single
event in both phases.

Several routers: a scenario with `routers` > 1 (every fourth seed of the
standard mix runs two or three) has every worker linked to every router and
the clients spread over the routers by a load balancer that skips a router
that is down. Its own fault, drawn from its own random stream so that the
single-router seeds draw as before: router_crash, a router process killed
(its clients' streams are cut, and each cut client sends its request again
through the balancer a moment later), the workers seeing each link close
after a short notice, and a new incarnation of the router starting after a
downtime (or at the heal), with every running worker registering with it.

This module is the run: it draws the seed's scenario (sim/scenario.py), builds
the cluster and the parts that act on it, all sharing one Stage
(sim/stage.py): the clients and load balancer (sim/clients.py), the fault
actuators (sim/faults.py), the seeded network (sim/network.py) and the
decoder steps (sim/steps.py). Then it runs the loop: one event, the checks,
the decoders' next steps, until the run settles or its liveness budget ends.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from random import Random

from core.protocol import DeliverError, DeliverFinished, DeliverToken
from sim.clients import Clients
from sim.clock import Clock
from sim.cluster import Cluster
from sim.decoders import Speculation
from sim.disturbances import Disturbances
from sim.faults import Faults
from sim.invariants import InvariantViolation
from sim.network import Network
from sim.scenario import (
    KV_BLOCK,
    LONGEST_PROMPT,
    STANDARD,
    Scenario,
    draw_router_faults,
    draw_swarm,
)
from sim.stage import Stage
from sim.steps import DecoderSteps
from sim.streams import error_causes, outcomes
from sim.timeline import Timeline, request_key
from sim.trace import Trace

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
    # the fake decoders' speculation: verifications, guesses, of them accepted
    speculation: tuple[int, int, int] = (0, 0, 0)
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
        routers_rng = Random(f"{seed}/routers")  # its own: the other draws stay put
        self.router_faults = draw_router_faults(routers_rng, self.scenario)
        self.clock = Clock()  # the one clock and event queue: ours and the machines' timers
        router = self.scenario.router
        delay_max_s = self.swarm.delay_max_s
        self.disturbances = Disturbances(
            grace_s=router.heartbeat_timeout_s
            + router.offer_timeout_s
            + self.scenario.heartbeat_interval_s
            + 2 * delay_max_s
        )
        if "delay_spread" in self.swarm.enabled:
            self.disturbances.note("delay_spread")
        self.disturbances.delay_max_s = delay_max_s
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
            + 2 * delay_max_s
            + self._waste_every_s
        )
        self._waste_bound_s = (
            self.scenario.heartbeat_interval_s + 2 * delay_max_s + self._waste_every_s + 0.01
        )
        worker_ids = [f"w{i}" for i in range(self.scenario.workers)]
        self._worker_ids = worker_ids
        self.trace = Trace(trace_tail, echo) if trace else None
        self.stage = Stage(self.clock, self.disturbances, timeline, self.trace)
        self.events = 0
        speculation = None
        if self.swarm.speculation:  # its own stream: the other draws stay put
            speculation = Speculation(self.swarm.speculation, Random(f"{seed}/speculation"))
        self.cluster = Cluster(
            [],
            self.scenario.router,
            heartbeat_interval_s=self.scenario.heartbeat_interval_s,
            trace=self.trace.write if self.trace is not None else None,
            clock=self.clock,
            disturbances=self.disturbances,
            kv_block_size=KV_BLOCK,
            largest_request=LONGEST_PROMPT + self.scenario.mean_new_tokens * 3 // 2 + 1,
            routers=self.scenario.routers,
            speculation=speculation,
        )
        stage, cluster, scenario, swarm = self.stage, self.cluster, self.scenario, self.swarm
        self.steps = DecoderSteps(stage, cluster, swarm, worker_ids, Random(f"{seed}/decoder"))
        self.clients = Clients(
            stage,
            cluster,
            scenario,
            swarm,
            Random(f"{seed}/clients"),
            Random(f"{seed}/logprobs"),  # its own: the other draws stay put
        )
        self.faults = Faults(
            stage,
            cluster,
            scenario,
            swarm,
            self.steps,
            self.clients,
            worker_ids,
            Random(f"{seed}/faults"),
            routers_rng,
            self.router_faults,
        )
        self.network = Network(
            stage,
            cluster,
            scenario,
            swarm,
            self.faults,
            Random(f"{seed}/net"),
            Random(f"{seed}/finish"),  # its own: the finish_lost fault's times
        )
        cluster.on_send = self.network.on_send  # every packet goes by the seeded network
        self.timeline = timeline
        if timeline is not None:
            timeline.seed = seed
            timeline.routers = list(cluster.router_names)
            timeline.workers = list(worker_ids)
            cluster.on_deliver = self._handed
        self.clients.plan()
        self.faults.plan()
        self.clock.schedule(self.scenario.fault_end_s, self._heal)

    # --- the run ---

    def run(self) -> SimResult:
        if self.trace is not None:
            self.trace.write(f"seed {self.seed} swarm {sorted(self.swarm.enabled)}")
        for index, worker_id in enumerate(self._worker_ids):
            slots = self.swarm.slots[index]
            self.cluster.decoders.pool_share[worker_id] = self.swarm.pool_share[index]
            assert self.cluster.start_worker(worker_id, slots=slots)
            self.steps.add(worker_id, slots)
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
                self.steps.schedule()
                if self.stage.healed and self._settled():
                    break
            if not self._settled():
                budget = self._liveness_deadline - self.scenario.fault_end_s
                violation = f"liveness: not settled {budget:.1f}s after heal: "
                reasons = self.cluster.invariants.unsettled_reasons()
                violation += "; ".join(reasons) or "decoders running"
            else:
                self.cluster.invariants.check_end(self.disturbances.kinds)
        except InvariantViolation as error:
            violation = f"safety: {error}"
        except Exception as error:  # a machine raised: as much a finding as a bad delivery
            violation = f"crash: {type(error).__name__}: {error}"
        if self.timeline is not None:
            self._close_timeline(self.timeline, violation)
        return self._result(violation)

    def _heal(self) -> None:
        """The fault phase ends: the liveness phase gets its budget, everything heals."""
        self._liveness_deadline = self.clock.now + self._liveness_budget()
        self.faults.heal()

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

    def _settled(self) -> bool:
        return self.clients.pending == 0 and self.cluster.invariants.settled()

    # --- the timeline (only with one: nothing here draws from the run's random streams) ---

    def _handed(
        self, router_id: str, delivery: DeliverToken | DeliverFinished | DeliverError
    ) -> None:
        assert self.timeline is not None
        match delivery:
            case DeliverToken():
                what = "token"
            case DeliverFinished(reason=reason) | DeliverError(kind=reason):
                what = reason
        self.timeline.handed(request_key(router_id, delivery.request_id), self.clock.now, what)

    def _close_timeline(self, timeline: Timeline, violation: str | None) -> None:
        now = self.clock.now
        timeline.end_s = now
        timeline.swarm = ", ".join(sorted(self.swarm.enabled)) or "no faults"
        for worker_id, intervals in self.disturbances.intervals().items():
            for start, end, kind in intervals:
                timeline.fault(worker_id, start, end, kind)
        if violation is not None:
            timeline.failed(violation, now)

    # --- the result ---

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
            faults=self.stage.faults,
            fenced=cluster.fenced(),
            resumes=cluster.resumes(),
            attempts_lost=cluster.attempts_lost(),
            waste_s=cluster.waste_s(),
            errors=error_causes(cluster.streams()),
            most_completed=max(cluster.worker_oracles.completions.values(), default=0),
            routers=self.scenario.routers,
            client_retries=self.clients.retries,
            full_declines=cluster.full_declines(),
            handoffs=cluster.handoffs(),
            preemptions=(decoders.preemptions, decoders.recomputed_tokens),
            speculation=decoders.speculation.counts() if decoders.speculation else (0, 0, 0),
            prefill_tokens=(decoders.prefill_tokens[0], decoders.prefill_tokens[1]),
            trace_hash=self.trace.digest() if self.trace is not None else None,
            trace_tail=list(self.trace.tail) if self.trace is not None else [],
        )


def run_seed(
    seed: int, scenario: Scenario | None = None, trace: bool = False, echo: bool = False
) -> SimResult:
    return Simulation(seed, scenario, trace=trace, echo=echo).run()
