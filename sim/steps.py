"""When each simulated worker's decoder steps: the simulator's half of the decoders.

sim/decoders.py is what a step computes; this is when one is taken. After
every event, each worker with work and no step under way plans its next
batched step and takes it after the time that step costs: the seed's step
time (scaled by the worker's slowness and, mildly, by its decodes) plus the
prefill time per token. A step is the process's that planned it: a process
that ends or starts (`new_process`, told by sim/faults.py) leaves its step to
land on nothing. Two decoder faults act here, set by their actuators in
sim/faults.py: a hung decoder (`hung_until`) takes no step while its worker
heartbeats on, and a misbehaving one's steps (`misbehaving_until`) go wrong
three times in ten, drawn from the `{seed}/decoder` stream.
"""

from __future__ import annotations

from functools import partial
from random import Random

from core.batching import BatchLimits, StepPlan
from sim.cluster import Cluster
from sim.decoders import MISBEHAVIOURS
from sim.scenario import Swarm
from sim.stage import Stage


class DecoderSteps:
    def __init__(
        self, stage: Stage, cluster: Cluster, swarm: Swarm, worker_ids: list[str], rng: Random
    ) -> None:
        self.stage = stage
        self.clock = stage.clock
        self.cluster = cluster
        self.swarm = swarm
        self._rng = rng
        self._slowness = dict(zip(worker_ids, swarm.slowness, strict=True))
        self._limits: dict[str, BatchLimits] = {}
        self._pending: dict[str, bool] = {}  # a step under way
        self.generation: dict[str, int] = {}  # which process: a step of an older one is void
        self.hung_until: dict[str, float] = {}
        self.misbehaving_until: dict[str, float] = {}

    def add(self, worker_id: str, slots: int) -> None:
        """A worker's first process started: its batching limits, no step under way."""
        chunk = self.swarm.max_prefill_tokens
        self._limits[worker_id] = BatchLimits(
            max_seqs=slots,
            max_context=self.cluster.max_context,
            max_step_tokens=slots + chunk,
            max_prefill_tokens=chunk,
            max_idle_prefill_tokens=2 * chunk,
        )
        self._pending[worker_id] = False
        self.generation[worker_id] = 0

    def new_process(self, worker_id: str) -> None:
        """A worker process ended or starts (sim/faults.py): a step under way was the
        old process's, and lands on nothing."""
        self.generation[worker_id] += 1
        self._pending[worker_id] = False

    def schedule(self) -> None:
        """Each worker with work and no step under way plans its next batched step
        (core.batching) and takes it after the time that step costs."""
        cluster, swarm = self.cluster, self.swarm
        for worker_id, decodes in cluster.decoders.each_worker():
            if not decodes or self._pending[worker_id] or not cluster.alive(worker_id):
                continue
            if self.hung_until and self.clock.now < self.hung_until.get(worker_id, 0.0):
                continue  # hung: no step, no token; its worker heartbeats on
            plan = cluster.decoders.plan(worker_id, self._limits[worker_id])
            if not plan.tokens:
                continue
            slow = self._slowness[worker_id]
            step_s = swarm.step_s * (1 + 0.05 * len(plan.decode)) if plan.decode else 0.0
            prefill_s = swarm.prefill_s_per_token * sum(n for _, n in plan.prefill)
            self._pending[worker_id] = True
            at = self.clock.now + (step_s + prefill_s) * slow
            self.clock.schedule(at, self._decode, worker_id, self.generation[worker_id], plan)

    def _decode(self, worker_id: str, generation: int, plan: StepPlan) -> None:
        if generation != self.generation[worker_id]:
            return  # scheduled for a process that has since crashed
        self._pending[worker_id] = False
        if self.cluster.alive(worker_id):
            self.cluster.decoders.run(worker_id, plan, partial(self._misbehaviour, worker_id))

    def _misbehaviour(self, worker_id: str) -> str | None:
        """How this step of a misbehaving decoder goes wrong, if it does."""
        until = self.misbehaving_until.get(worker_id)
        if until is None or self.stage.healed or self.clock.now >= until:
            return None
        rng = self._rng
        return rng.choice(MISBEHAVIOURS) if rng.random() < 0.3 else None
