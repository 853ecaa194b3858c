"""The fault actuators: what each fault kind the swarm drew does to the processes.

`plan` schedules every fault the seed's swarm drew (sim/scenario.py), at
times drawn from the `{seed}/faults` stream over the fault phase: worker
crashes (a crash loop one time in four), stalls, partitions and blackouts,
decoder failures, drains and rolling restarts, misbehaving and hung
decoders, impostors and heartbeats from a future epoch; and the router
crashes of a shared-workers run (drawn from `{seed}/routers`). Each
actuator strikes only during the fault phase and only where it can, counts
itself (`Stage.fault`), and records the disturbance it causes on its worker
(`Stage.disturb`) for the oracles. The faults that strike packets are
sim/network.py's; it asks here whether a link is cut (`cut`) and when a
stalled worker reads its socket again (`resume_at`). `heal` ends the fault
phase.

Adding a fault kind: append it to FAULT_KINDS and draw its count or rate
after every earlier draw (sim/scenario.py), write its actuator here (or in
sim/network.py for a packet fault) and schedule it in `plan` after the
others, and name it in the tables of sim/disturbances.py for the fences it
may move and the losses it explains.
"""

from __future__ import annotations

import math
from random import Random

from core.protocol import Heartbeat
from sim.clients import Clients
from sim.cluster import Cluster
from sim.scenario import RouterFaults, Scenario, Swarm
from sim.stage import Stage
from sim.steps import DecoderSteps


class Faults:
    def __init__(
        self,
        stage: Stage,
        cluster: Cluster,
        scenario: Scenario,
        swarm: Swarm,
        steps: DecoderSteps,
        clients: Clients,
        worker_ids: list[str],
        rng: Random,
        routers_rng: Random,
        router_faults: RouterFaults,
    ) -> None:
        self.stage = stage
        self.clock = stage.clock
        self.disturbances = stage.disturbances
        self.cluster = cluster
        self.scenario = scenario
        self.swarm = swarm
        self.steps = steps
        self.clients = clients
        self._worker_ids = worker_ids
        self._rng = rng
        self._routers_rng = routers_rng  # its own: the single-router seeds draw as before
        self.router_faults = router_faults
        self._crash_downtime: list[float] = []  # drawn in `plan`
        self._partitions: list[tuple[str, str, float]] = []  # (worker, direction, until)
        self.resume_at: dict[str, float] = {}  # a stalled worker's resume time
        self._hangs: dict[str, list[float | str]] = {}  # worker -> its open disturbance
        self._draining: dict[str, list[float | str]] = {}  # worker -> its open disturbance
        self._open_crash: dict[str, list[float | str]] = {}
        self._router_down: dict[str, float] = {}  # router place -> when it comes back

    def plan(self) -> None:
        """Every fault the swarm drew, scheduled over the fault phase (from the
        `{seed}/faults` stream), then the router crashes (drawn before the run)."""
        rng, worker_ids = self._rng, self._worker_ids
        window = self.scenario.fault_end_s
        for _ in range(self.swarm.crashes):
            self.clock.schedule(rng.uniform(0.5, window), self.crash, rng.choice(worker_ids))
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
        for at, which, downtime in self.router_faults.crashes:
            self.clock.schedule(at, self._crash_router, self.cluster.router_names[which], downtime)

    # --- worker processes ---

    def crash(self, worker_id: str, downtime: float | None = None) -> None:
        if self.stage.healed or self.cluster.is_down(worker_id):
            return
        self.stage.fault("crash", worker_id)
        if downtime is None:
            downtime = self._crash_downtime.pop() if self._crash_downtime else 1.0
        self._open_crash[worker_id] = self.stage.disturb(worker_id, "crash", downtime)
        self._stop_process(worker_id)
        notice = self.swarm.crash_notice_s
        if notice is not None and notice < downtime:
            links = self.cluster.links(worker_id)
            self.clock.schedule(self.clock.now + notice, self._crash_notice, worker_id, links)
        self.clock.schedule(self.clock.now + downtime, self._scheduled_restart, worker_id)

    def _stop_process(self, worker_id: str) -> dict[str, int]:
        """The worker's process ends (a crash, or a drained worker exiting)."""
        self.cluster.crash_worker(worker_id)
        self.steps.new_process(worker_id)
        self.steps.misbehaving_until.pop(worker_id, None)
        until = self.steps.hung_until.get(worker_id)
        if until is not None:  # the process is gone; its successor's decoder is fresh
            self._decoder_unhang(worker_id, until)
        drain = self._draining.pop(worker_id, None)
        if drain is not None:
            self.disturbances.close(worker_id, drain, self.clock.now)
        return self.cluster.links(worker_id)

    def _crash_notice(self, worker_id: str, links: dict[str, int]) -> None:
        """The connections of the crashed process are seen to close (TCP resets): each
        router it was linked to hears of its own."""
        self.stage.fault("crash_notice", worker_id)
        for router_id, epoch in links.items():
            self.cluster.worker_gone(worker_id, epoch, router_id)

    def _restart(self, worker_id: str, backoff_s: float = 0.05) -> None:
        self.stage.note(f"restart {worker_id}")
        self.steps.new_process(worker_id)
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

    def _scheduled_restart(self, worker_id: str) -> None:
        if self.cluster.is_down(worker_id):  # the heal may have restarted it already
            self._restart(worker_id)
            if not self.stage.healed and self._rng.random() < 0.25:
                # A crash loop: the new process dies too, often before the router hears it.
                again = self.clock.now + self._rng.uniform(0.0, 0.3)
                self.clock.schedule(again, self.crash, worker_id)

    def _roll(self, worker_ids: tuple[str, ...], index: int) -> None:
        """A rolling restart: drain worker `index`, then, once it is back, the next
        (each worker once; a worker down for another fault is waited for)."""
        if self.stage.healed or index >= len(worker_ids):
            return
        worker_id = worker_ids[index]
        if self._busy(worker_id):
            self.clock.schedule(self.clock.now + 0.1, self._roll, worker_ids, index)
            return
        self.stage.fault("rolling_restart", worker_id)
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
        if self.stage.healed or not self.cluster.alive(worker_id) or worker_id in self._draining:
            return
        self.stage.fault("drain", worker_id)
        self._draining[worker_id] = self.stage.disturb(worker_id, "drain", math.inf)
        self.cluster.drain_worker(worker_id, handoff=self.swarm.drain_handoff)
        self._drain_check(worker_id, self.steps.generation[worker_id])

    def _drain_check(self, worker_id: str, generation: int) -> None:
        if generation != self.steps.generation[worker_id]:
            return  # the process crashed meanwhile; its successor is not draining
        if not self.cluster.alive(worker_id) or not self.cluster.idle(worker_id):
            self.clock.schedule(self.clock.now + 0.05, self._drain_check, worker_id, generation)
            return
        self.stage.note(f"drained {worker_id} exits")
        downtime = self._rng.uniform(0.05, 0.5)
        self._open_crash[worker_id] = self.stage.disturb(worker_id, "drain", downtime)
        links = self._stop_process(worker_id)
        for router_id, epoch in links.items():  # a clean exit closes its connections
            self.cluster.worker_gone(worker_id, epoch, router_id)
        self.clock.schedule(self.clock.now + downtime, self._scheduled_restart, worker_id)

    def _stall(self, worker_id: str, duration_s: float) -> None:
        if self.stage.healed or not self.cluster.alive(worker_id):
            return
        self.stage.fault("stall", worker_id)
        self.stage.disturb(worker_id, "stall", duration_s)
        self.cluster.pause_worker(worker_id)
        self.resume_at[worker_id] = self.clock.now + duration_s
        self.clock.schedule(self.clock.now + duration_s, self._resume, worker_id)

    def _resume(self, worker_id: str) -> None:
        if self.cluster.is_paused(worker_id):
            self.stage.note(f"resume {worker_id}")
            self.cluster.resume_worker(worker_id)

    def _impostor(self, worker_id: str) -> None:
        """A second process registers as worker_id (a copy-pasted id), then leaves.

        Refused while the real worker is live. Accepted only when the router had
        already lost the real one (it was crashed, stalled or cut off): then the
        real process's connection is closed by the router and it registers again,
        and the impostor's own connection closes a moment later."""
        if self.stage.healed:
            return
        cluster = self.cluster
        was_disturbed = self.disturbances.explains(worker_id, self.clock.now, self.clock.now)
        router_id = cluster.live_routers()[0]
        epoch = cluster.register(worker_id, router_id)
        if epoch is None:
            self.stage.fault("impostor", f"{worker_id} refused")
            return
        self.stage.fault("impostor", f"{worker_id} accepted as epoch {epoch}")
        if was_disturbed:  # taking over a lost worker's id is fair; a live one's is a bug
            self.stage.disturb(worker_id, "impostor", 0.5)
        if not cluster.is_down(worker_id):
            self._stop_process(worker_id)  # its connection was closed: a new session
            self.clock.schedule(self.clock.now + 0.05, self._scheduled_restart, worker_id)
        leaves = self.clock.now + self._rng.uniform(0.05, 0.5)
        self.clock.schedule(leaves, cluster.worker_gone, worker_id, epoch, router_id)

    def _future_epoch(self, worker_id: str, ahead: int) -> None:
        """A heartbeat under worker_id naming an epoch the router never handed out
        (a process whose idea of its epoch came from a clock running ahead)."""
        if self.stage.healed:
            return
        router_id = self.cluster.live_routers()[0]
        if router_id not in self.cluster.links(worker_id):
            return  # not linked there now (down, or that router just came up)
        self.stage.fault("future_epoch", f"{worker_id} +{ahead}")
        self.disturbances.note("future_epoch")  # explains the fence, disturbs nothing
        epoch = self.cluster.epoch(worker_id, router_id) + ahead
        heartbeat = Heartbeat(worker_id, epoch, 1, 4, 4, 4096)
        self.cluster.inject_heartbeat(heartbeat, router_id)

    # --- decoders ---

    def _decoder_failure(self, worker_id: str) -> None:
        if not self.stage.healed and self.cluster.alive(worker_id):
            self.stage.fault("decoder_failure", worker_id)
            self.stage.disturb(worker_id, "decoder_failure", 0.0)
            self.cluster.fail_decoder(worker_id)

    def _decoder_misbehaves(self, worker_id: str, duration_s: float) -> None:
        if not self.stage.healed and self.cluster.alive(worker_id):
            self.stage.fault("decoder_misbehaves", f"{worker_id} {duration_s:.2f}s")
            self.stage.disturb(worker_id, "decoder_misbehaves", duration_s)
            self.steps.misbehaving_until[worker_id] = self.clock.now + duration_s

    def _decoder_hang(self, worker_id: str, duration_s: float) -> None:
        """The decoder's forward pass stops returning; the worker machine and its
        heartbeats go on, listing assignments that make no progress."""
        if (
            self.stage.healed
            or not self.cluster.alive(worker_id)
            or worker_id in self.steps.hung_until
        ):
            return
        self.stage.fault("decoder_hang", f"{worker_id} {duration_s:.2f}s")
        until = self.clock.now + duration_s
        self.steps.hung_until[worker_id] = until
        self._hangs[worker_id] = self.stage.disturb(worker_id, "decoder_hang", duration_s)
        if until < math.inf:
            self.clock.schedule(until, self._decoder_unhang, worker_id, until)
        elif self._rng.random() < 0.5:  # a supervisor kills and restarts it at once
            rng = self._rng
            at, downtime = self.clock.now + rng.uniform(2.0, 6.0), rng.uniform(0.05, 0.3)
            self.clock.schedule(at, self.crash, worker_id, downtime)

    def _decoder_unhang(self, worker_id: str, until: float) -> None:
        if self.steps.hung_until.get(worker_id) == until:
            del self.steps.hung_until[worker_id]
            hang = self._hangs.pop(worker_id)
            self.disturbances.close(worker_id, hang, self.clock.now)
            self.stage.note(f"decoder of {worker_id} runs again")

    # --- links ---

    def _partition(self, worker_id: str, direction: str, duration_s: float) -> None:
        if self.stage.healed:
            return
        self.stage.fault("partition", f"{worker_id} {direction} {duration_s:.2f}s")
        self.stage.disturb(worker_id, "partition", duration_s)
        self._partitions.append((worker_id, direction, self.clock.now + duration_s))

    def _blackout(self, duration_s: float) -> None:
        """The router's own link fails: every worker is cut off, both ways, at once."""
        if self.stage.healed:
            return
        self.stage.fault("blackout", f"{duration_s:.2f}s")
        for worker_id in self._worker_ids:
            self.stage.disturb(worker_id, "blackout", duration_s)
            self._partitions.append((worker_id, "both", self.clock.now + duration_s))

    def cut(self, worker_id: str, direction: str) -> bool:
        """Is the worker's link cut this way now (a partition or a blackout)?"""
        now = self.clock.now
        self._partitions = [p for p in self._partitions if p[2] > now]
        return any(w == worker_id and d in (direction, "both") for w, d, _ in self._partitions)

    # --- routers (shared-workers runs) ---

    def _crash_router(self, name: str, downtime: float) -> None:
        """kill -9 of a router process: its clients' streams are cut, the workers see
        each link close after a notice, and it comes back as a new incarnation."""
        cluster = self.cluster
        if self.stage.healed or len(cluster.live_routers()) < 2 or name in self._router_down:
            return  # keep one router up: a cluster with none serves nobody to judge
        [router_id] = [r for r in cluster.live_routers() if cluster.nodes[r].name == name]
        self.stage.fault("router_crash", f"{router_id} for {downtime:.2f}s")
        if self.stage.timeline is not None:
            now = self.clock.now
            self.stage.timeline.fault(f"router {name}", now, now + downtime, "router_crash")
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
            again = self.clock.now + rng.uniform(0.0, self.router_faults.client_retry_max_s)
            self.clients.send_again(again, stream.request)
        self._router_down[name] = self.clock.now + downtime
        self.clock.schedule(self.clock.now + downtime, self._restart_router, name)

    def _restart_router(self, name: str) -> None:
        if name in self._router_down:
            del self._router_down[name]
            node = self.cluster.start_router(name)
            self.stage.note(f"router {name} starts again as {node.router_id}")

    # --- the heal ---

    def heal(self) -> None:
        """Everything heals: partitions close, hung decoders run, routers and crashed
        workers restart, stalled ones resume; no fault strikes from now on."""
        self.stage.healed = True
        self.stage.note("heal: faults stop, liveness phase begins")
        self._partitions.clear()
        for worker_id, until in list(self.steps.hung_until.items()):
            self._decoder_unhang(worker_id, until)
        for name in list(self._router_down):
            self._restart_router(name)
        for worker_id in self.cluster.crashed():
            self._restart(worker_id)
        for worker_id in self.cluster.stalled():
            self.resume_at[worker_id] = self.clock.now
            self._resume(worker_id)
