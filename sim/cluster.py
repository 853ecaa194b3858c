"""A cluster of the real core machines joined by a controllable fake network.

Cluster wires core Routers (one, or several sharing the workers) to N core
Workers, each worker linked to every live router. Nothing here decides *when*
things happen: the caller (a hypothesis state machine in the tests, a seeded
scheduler in the simulator) picks which in-flight message to deliver, which
to duplicate, when a decoder makes a step and when time advances. The cluster
executes the machines' effects faithfully and records what every client saw,
so the oracles in check_safety() can judge the run after every step. The
machines' timers go on the caller's clock (sim/clock.py), the one queue of
everything that happens in a run; a caller that brings none gets its own.
What a driver needs to know or do is a method here, so drivers never reach
into the cluster's tables.

Decoders run core's fake model (core/fake_model.py), which is deterministic
and autoregressive like a real one, so every attempt of a greedy or seeded
request, on any worker, produces the same output, and the client's stream
must always be a prefix of reference_output(). A continuation (a request
with an output_prefix) takes the prefix as context and so goes on exactly
where the client is. Unseeded sampling (temperature > 0, no seed) is
modelled as what it is on real hardware: each attempt draws a different
sequence (the attempt number salts the function), so a client sees one
attempt's output, or, after a resume, one attempt's prefix continued by a
later attempt given that prefix.

Several routers: each is a RouterNode with its own clients (streams), its
own timers and its own router-side oracles; request ids are numbered per
router, so the same id names different requests at different routers (as
independent routers would do). A router can crash (its machine, timers
and in-flight messages are gone; its clients' streams are cut) and restart
as a new incarnation with a new router id; workers hear that a router's
link closed (RouterUnlinked) when the caller says so, and register with
a new router when it comes up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, ItemsView, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import cast

from core.batching import BatchLimits, Running, StepPlan
from core.blocks import blocks_for
from core.config import RouterConfig
from core.fake_model import FakeDecode
from core.protocol import (
    ArmTimer,
    Assignment,
    ClientCancel,
    Decoded,
    DecodeDone,
    DecoderEvent,
    DecoderFailed,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    DisarmTimer,
    Drain,
    FromRouterMessage,
    FromWorker,
    FromWorkerMessage,
    GenerationRequest,
    Heartbeat,
    RegisterWorker,
    Registration,
    RouterEffect,
    RouterEvent,
    RouterLinked,
    RouterUnlinked,
    SendToRouter,
    SendToWorker,
    StartDecode,
    StopDecode,
    Submit,
    TimerFired,
    TimerKey,
    ToWorker,
    WorkerEffect,
    WorkerEvent,
    WorkerGone,
    WorkerStart,
)
from core.router import Router
from core.scheduler import Scheduler
from core.states import SeqState
from core.worker import Worker, WorkerConfig
from sim.clock import Clock
from sim.disturbances import Disturbances
from sim.kv import KvModel, pool_blocks
from sim.oracles import Oracles
from sim.streams import ClientStream, StreamOracles, diverges
from sim.worker_oracles import WorkerOracles

# How a misbehaving decoder can go wrong in one step (sim/simulator.py draws one):
# say a token twice, skip an index, emit a token past the end, or end twice.
MISBEHAVIOURS = ("repeat", "skip", "overrun", "end_twice")


class InvariantViolation(AssertionError):
    """An oracle found behaviour the contract forbids."""


@dataclass(slots=True)
class Packet:
    """A message on the fake network. `to` is a worker id, or None for a router:
    the one named by `router` (a worker's messages go on its link to that router,
    a router's messages come from it)."""

    ident: int
    source: str  # worker id of the sender (the router's messages name their target in `to`)
    to: str | None
    message: ToWorker | FromWorker
    router: str = ""  # the router id of the link it travels on


@dataclass(slots=True)
class Decode:
    """One assignment on a fake decoder: its worker's Scheduler (core/scheduler.py)
    has it waiting for a row and blocks, prefilling or decoding."""

    request: GenerationRequest
    started_at: float
    run: FakeDecode
    key: int  # its name in the scheduler and its plans


@dataclass(slots=True)
class _Armed:
    """One armed timer of one machine."""

    deadline: float
    arm: int  # which arming this is: a clock entry of an older arming is stale
    rank: int  # the key's place among its owner's timers; kept when re-armed


Owner = str  # a worker id, or "@" + a router id: whose timer it is


class RouterNode:
    """One router incarnation: its machine, its clients and its router-side oracles."""

    def __init__(
        self, cluster: Cluster, name: str, router_id: str, config: RouterConfig | None
    ) -> None:
        config = config or RouterConfig()
        self.name = name  # the router's place (its address): its incarnations share it
        self.router_id = router_id
        self.router = Router(config, router_id)
        self.owner: Owner = "@" + router_id
        self.streams: dict[str, ClientStream] = {}
        self.next_request = 0  # the next request id this router's clients get: r0, r1, ...
        self.oracles = Oracles(cluster, self, cluster.disturbances)

    def new_request_id(self) -> str:
        self.next_request += 1
        return f"r{self.next_request - 1}"


class Cluster:
    def __init__(
        self,
        worker_ids: list[str],
        router_config: RouterConfig | None = None,
        slots: int = 2,
        max_context: int = 4096,
        heartbeat_interval_s: float = 0.5,
        on_send: Callable[[Packet], None] | None = None,
        trace: Callable[[str], None] | None = None,
        clock: Clock | None = None,
        disturbances: Disturbances | None = None,
        kv_block_size: int = 4,
        largest_request: int | None = None,
        routers: int = 1,
    ) -> None:
        self.clock = clock or Clock()
        self.on_send = on_send or self.in_flight_append
        self.trace = trace
        # Told of every delivery to a client (router id, the delivery): a timeline.
        self.on_deliver: Callable[[str, DeliverToken | DeliverFinished | DeliverError], None]
        self.on_deliver = lambda router_id, delivery: None
        self.disturbances = disturbances
        self.router_config = router_config or RouterConfig()
        self.shared = routers > 1  # several routers share the workers
        self._timers: dict[Owner, dict[TimerKey, _Armed]] = {}
        self._owner_rank: dict[Owner, int] = {}
        # Live router incarnations by router id, and every one there has been. A lone
        # router's id is "" (its assignments name no router), as in a plain deployment.
        self.nodes: dict[str, RouterNode] = {}
        self.all_nodes: list[RouterNode] = []
        self._incarnations: Counter[str] = Counter()
        self._processes: Counter[str] = Counter()  # worker processes started, per id
        self.worker_oracles = WorkerOracles(self, disturbances)
        self.streams_oracle = StreamOracles(self)
        self.slots = slots
        self.max_context = max_context
        self.heartbeat_interval_s = heartbeat_interval_s
        self.kv_block_size = kv_block_size
        self.largest_request = largest_request or max_context
        self.kv: dict[str, KvModel] = {}  # each process's paged KV cache
        self.schedulers: dict[str, Scheduler] = {}  # each process's, over its cache
        # Each worker id's KV pool as a share of one that never preempts (1: that pool).
        self.pool_share: dict[str, float] = {}
        self.preemptions = 0  # sequences preempted by recompute, every process together
        self.recomputed_tokens = 0  # output tokens computed again after a preemption
        self._head_wait: dict[str, tuple[int, int]] = {}  # worker -> (head key, steps)
        self._pressure: dict[str, list[float | str]] = {}  # worker -> its latest interval
        self._admitted: dict[str, dict[int, None]] = {}  # worker -> running keys, in order
        self.prefill_tokens = [0, 0]  # context tokens admitted, and of them not cached
        self.workers: dict[str, Worker] = {}
        self.decodes: dict[str, dict[Assignment, Decode]] = {}
        self.down: set[str] = set()  # crashed: events to them vanish
        self.paused: set[str] = set()  # stalled: their timers wait until they resume
        self._arms = 0
        self.decoder_failures = 0
        self.misbehaviours = 0  # decoder steps that went wrong on purpose
        self.in_flight: list[Packet] = []
        self._packet_ids = 0
        self._decode_keys = 0
        self._keys: dict[int, Assignment] = {}
        self.violations: list[str] = []
        # What ran since the last check_safety: only a machine that handled an event
        # can have changed what the per-event checks read of it.
        self._touched_workers: dict[str, None] = {}  # in order: the same first violation
        self._touched_routers: dict[str, None] = {}
        self.router_names = [chr(ord("a") + i) for i in range(routers)]
        for name in self.router_names:
            self.start_router(name)
        for worker_id in worker_ids:
            self.start_worker(worker_id)

    # --- routers ---

    @property
    def router(self) -> Router:
        """The first live router (the only one, unless several share the workers)."""
        return self._first().router

    @property
    def oracles(self) -> Oracles:
        """The first live router's oracles (the only ones, unless several routers)."""
        return self._first().oracles

    def _first(self) -> RouterNode:
        return next(iter(self.nodes.values()))

    def start_router(self, name: str) -> RouterNode:
        """A router process starts at its place `name`, as a new incarnation (a new id);
        every running worker registers with it."""
        self._incarnations[name] += 1
        router_id = f"{name}{self._incarnations[name]}" if self.shared else ""
        node = RouterNode(self, name, router_id, self.router_config)
        self.nodes[router_id] = node
        self.all_nodes.append(node)
        self._timers[node.owner] = {}
        self._owner_rank.setdefault(node.owner, len(self._owner_rank))
        for worker_id in self.workers:
            if worker_id not in self.down:
                self.link(worker_id, router_id)
        return node

    def crash_router(self, router_id: str) -> list[str]:
        """The router process dies: its state and timers are gone, what is in flight to
        it vanishes, and its clients' streams are cut. Returns the workers linked to it
        (each hears its link close when the caller says: `router_link_lost`)."""
        node = self.nodes.pop(router_id)
        self._timers[node.owner] = {}
        for stream in node.streams.values():
            if stream.outcome is None:
                stream.cut = True
        return [w for w, worker in self.workers.items() if router_id in worker.links()]

    def router_link_lost(self, worker_id: str, router_id: str) -> None:
        """The worker sees its connection to a router close."""
        if worker_id in self.workers:
            self._run_worker(worker_id, RouterUnlinked(router_id, "connection closed"))

    def live_routers(self) -> list[str]:
        return list(self.nodes)

    def router_place(self, router_id: str) -> str:
        """The place (address) of a router incarnation, live or gone."""
        node = self.nodes.get(router_id)
        if node is None:
            node = next(n for n in self.all_nodes if n.router_id == router_id)
        return node.name

    def fences_at(self, packet: Packet) -> dict[str, int] | None:
        """The fence counts of the machine this packet goes to (None: it is gone, so
        the packet vanishes), to tell afterwards whether it was fenced and why."""
        if packet.to is None:
            node = self.nodes.get(packet.router)
            return None if node is None else dict(node.router.fence_counts())
        if packet.to in self.down or packet.router not in self.nodes:
            return None
        return dict(self.workers[packet.to].fence_counts())

    def wants(self, worker_id: str, assignment: Assignment) -> bool | None:
        """Does the assignment's router want it on this worker? None: its router is
        not live (it died; the worker lets go when it hears so)."""
        node = self.nodes.get(assignment.router)
        return None if node is None else node.router.wants(worker_id, assignment)

    # --- driving ---

    def register(self, worker_id: str, router_id: str | None = None) -> int | None:
        """A process connects as worker_id to a router (the first live one unless
        named): it hands out an epoch, or refuses."""
        node = self.nodes[router_id] if router_id is not None else self._first()
        effects = self._run_router(node, RegisterWorker(worker_id))
        [answer] = [e for e in effects if isinstance(e, Registration)]
        return answer.epoch

    def link(self, worker_id: str, router_id: str) -> bool:
        """The running worker connects to a router and registers (False: refused)."""
        epoch = self.register(worker_id, router_id)
        if epoch is None:
            return False
        self._run_worker(worker_id, RouterLinked(router_id, epoch))
        return True

    def start_worker(self, worker_id: str, slots: int | None = None) -> bool:
        """Start a worker process: it registers with every live router, then serves
        each under the epoch it handed out. False if a router refused the id (a live
        worker has it there): the process waits, and is started again later."""
        epochs: dict[str, int] = {}
        for router_id in self.nodes:
            epoch = self.register(worker_id, router_id)
            if epoch is None:
                self.down.add(worker_id)
                return False
            epochs[router_id] = epoch
        config = WorkerConfig(
            worker_id,
            slots=self.slots if slots is None else slots,
            max_context=self.max_context,
            heartbeat_interval_s=self.heartbeat_interval_s,
            router=None,
        )
        self.workers[worker_id] = Worker(config)
        self._processes[worker_id] += 1
        size = self.kv_block_size
        blocks = pool_blocks(config.slots, self.largest_request, size)
        share = self.pool_share.get(worker_id, 1.0)
        if share < 1.0:  # tight: preemption by recompute; one largest request always fits
            blocks = max(blocks_for(self.largest_request, size), int(blocks * share))
        self.kv[worker_id] = KvModel(blocks, size, self.violations.append, worker_id)
        self._new_scheduler(worker_id)
        self._timers[worker_id] = {}
        self._owner_rank.setdefault(worker_id, len(self._owner_rank))
        self.decodes[worker_id] = {}
        self.down.discard(worker_id)
        self._touched_routers.update(dict.fromkeys(self.nodes))  # its slot count is judged anew
        self._run_worker(worker_id, WorkerStart())
        for router_id, epoch in epochs.items():
            self._run_worker(worker_id, RouterLinked(router_id, epoch))
        return True

    def _new_scheduler(self, worker_id: str, limits: BatchLimits | None = None) -> None:
        if limits is None:  # until the driver's own limits come with its first plan
            slots = self.workers[worker_id].config.slots
            limits = BatchLimits(slots, self.max_context, slots + 16, 16, 32)
        self.schedulers[worker_id] = Scheduler(self.kv[worker_id], limits)
        self._head_wait.pop(worker_id, None)
        self._admitted[worker_id] = {}

    def fail_decoder(self, worker_id: str) -> None:
        """The worker's decoder breaks: every running assignment there fails."""
        self.decoder_failures += 1
        self.decodes[worker_id] = {}
        self.kv[worker_id].release_all()
        self._new_scheduler(worker_id, self.schedulers[worker_id].limits)
        self._run_worker(worker_id, DecoderFailed("injected decoder failure"))

    def drain_worker(self, worker_id: str, handoff: bool = True) -> None:
        """The process is asked to drain: no new work, its streams handed off or let
        finish; it exits once idle (the caller's part)."""
        self._run_worker(worker_id, Drain(handoff))

    def idle(self, worker_id: str) -> bool:
        return not self.workers[worker_id].holds()

    def pause_worker(self, worker_id: str) -> None:
        """The process stalls: it handles nothing, its timers wait."""
        self.paused.add(worker_id)

    def resume_worker(self, worker_id: str) -> None:
        """The stall ends: timers that came due meanwhile fire now, the rest when due."""
        self.paused.discard(worker_id)
        for key, armed in list(self._timers[worker_id].items()):
            self._arm(worker_id, key, max(armed.deadline, self.clock.now))

    def crash_worker(self, worker_id: str) -> None:
        """The process dies: its state, timers and decodes are gone."""
        self.down.add(worker_id)
        self.paused.discard(worker_id)
        self._timers[worker_id] = {}
        self.decodes[worker_id] = {}

    def worker_gone(self, worker_id: str, epoch: int, router_id: str | None = None) -> None:
        """The transport tells a router (the first unless named) that this epoch's
        connection is gone; a router that has since died hears nothing."""
        node = self.nodes.get(router_id) if router_id is not None else self._first()
        if node is not None:
            self._run_router(node, WorkerGone(worker_id, epoch, "connection closed"))

    def restart_worker(self, worker_id: str) -> bool:
        """A new process (or a new connection of a live one) registers again."""
        return self.start_worker(worker_id, self.workers[worker_id].config.slots)

    def inject_heartbeat(self, heartbeat: Heartbeat, router_id: str | None = None) -> None:
        """A heartbeat from nowhere (a process with a wrong idea of its epoch)."""
        node = self.nodes[router_id] if router_id is not None else self._first()
        self._run_router(node, FromWorkerMessage(heartbeat.worker_id, heartbeat))

    @property
    def max_salt(self) -> int:
        """The highest attempt number a request can reach (retries, then resumes)."""
        config = self.router_config
        return config.max_attempts + config.max_resumes

    def submit(self, request: GenerationRequest, router_id: str | None = None) -> None:
        """A client sends the request to a router (the first live one unless named)."""
        node = self.nodes[router_id] if router_id is not None else self._first()
        stream = node.streams[request.request_id] = self.streams_oracle.open(request)
        queued = node.router.statistics().queued
        self._run_router(node, Submit(request))
        if isinstance(stream.outcome, DeliverError) and stream.outcome.kind == "overloaded":
            node.oracles.attempts.check_overloaded(request.request_id, queued)

    def cancel(self, request_id: str, router_id: str | None = None) -> None:
        node = self.nodes[router_id] if router_id is not None else self._first()
        node.streams[request_id].cancel_requested = True
        self._run_router(node, ClientCancel(request_id))

    def deliver(self, position: int) -> None:
        """Deliver the in-flight packet at `position` (any order: the network reorders)."""
        self.deliver_packet(self.in_flight.pop(position))

    def deliver_packet(self, packet: Packet) -> None:
        """Hand a packet to its destination; one sent to a crashed worker or router
        vanishes (so does one from a router that has died since: its connection
        closed with it)."""
        node = self.nodes.get(packet.router)
        if node is None:
            return
        if packet.to is None:
            message = cast(FromWorker, packet.message)
            self._run_router(node, FromWorkerMessage(packet.source, message))
        elif packet.to not in self.down:
            order = cast(ToWorker, packet.message)
            self._run_worker(packet.to, FromRouterMessage(order, packet.router))

    def duplicate(self, position: int) -> None:
        packet = self.in_flight[position]
        self._send(packet.source, packet.to, packet.message, packet.router)

    def decode_step(
        self, worker_id: str, assignment: Assignment, misbehave: str | None = None
    ) -> None:
        """The fake decoder takes one step of one running assignment (and may misbehave)."""
        decodes = self.decodes[worker_id]
        decode = decodes[assignment]
        scheduler = self.schedulers[worker_id]
        decoding = scheduler.state(decode.key) is SeqState.DECODING
        if decoding:
            self._check_decode(worker_id, decode)
        events: list[DecoderEvent] = []
        over = decode.run.step(events)
        if misbehave is not None:
            self.misbehaviours += 1
            _misbehave(events, misbehave, decode.request.max_new_tokens)
        if decoding:
            # The step wrote the last token's keys and values and drew the next one.
            tokens = scheduler.tokens(decode.key)
            self.kv[worker_id].wrote(decode.key, tokens)
            output = decode.run.generation.output
            prompt = len(decode.request.prompt_token_ids)
            for token in output[len(tokens) - prompt :]:
                scheduler.emitted(decode.key, token)
            if tokens[prompt:] != output:
                self.violations.append(
                    f"{worker_id}: {assignment}'s scheduled tokens are not its output "
                    f"({len(tokens) - prompt} against {len(output)}): a token twice or lost"
                )
        for event in events:
            if over and isinstance(event, DecodeDone):
                self._drop(worker_id, assignment)
            self._run_worker(worker_id, event)

    def plan_step(self, worker_id: str, limits: BatchLimits) -> StepPlan:
        """What the worker's next batched step computes: its core.scheduler grows,
        preempts, admits and plans, as the torch engine's does."""
        scheduler = self.schedulers[worker_id]
        scheduler.limits = limits
        decodes = self.decodes[worker_id]
        recomputed = scheduler.recomputed_tokens
        schedule = scheduler.schedule()
        self.preemptions += len(schedule.preempted)
        self.recomputed_tokens += scheduler.recomputed_tokens - recomputed
        order = self._admitted[worker_id]
        for key in schedule.preempted:  # each victim the newest of those still running
            newest = next(reversed(order), None)
            if key != newest:
                self.violations.append(
                    f"{worker_id}: preempted sequence {key}, not the most recently "
                    f"admitted one ({newest})"
                )
            order.pop(key, None)
        for key, cached in schedule.admitted:
            order[key] = None
            context = scheduler.progress(key)[1]
            self.prefill_tokens[0] += context
            self.prefill_tokens[1] += context - cached
        for key in schedule.refused:  # can never fit: the decoder fails it
            assignment = self._keys[key]
            decodes.pop(assignment, None)
            self._run_worker(worker_id, DecodeDone(assignment, "failed"))
        if schedule.preempted:
            last = schedule.preempted[-1]  # the newest victim waits first
            if scheduler.waiting[:1] != (last,) and last not in dict(schedule.admitted):
                self.violations.append(
                    f"{worker_id}: preempted {last} is not at the head of the queue "
                    f"({scheduler.waiting[:3]})"
                )
        if schedule.preempted or (scheduler.waiting and scheduler.running < limits.max_seqs):
            self._short_of_blocks(worker_id)
        self._check_head(worker_id, scheduler)
        plan = schedule.plan
        self._check_plan(worker_id, list(schedule.batch), plan, limits)
        self.kv[worker_id].check()
        return plan

    def _short_of_blocks(self, worker_id: str) -> None:
        """The worker's pool is out: a sequence was preempted, or one waits with a row
        free. Its accepted work is slower than a healthy worker's for as long, so this
        is a disturbance like a slow step: an attempt the router gives up meanwhile
        (its progress deadline passed) is explained by it, and nothing else is."""
        if self.disturbances is None:
            return
        now = self.clock.now
        last = self._pressure.get(worker_id)
        if last is not None and float(last[1]) >= now - 0.5:
            self.disturbances.extend(worker_id, last, now)
        else:
            self._pressure[worker_id] = self.disturbances.add(worker_id, "kv_pressure", now, now)

    def _check_head(self, worker_id: str, scheduler: Scheduler) -> None:
        """No sequence starves: once at the head of the queue it is admitted within as
        many steps as every running sequence needs to finish (each computes at least
        one token a step of at most the largest request's)."""
        head = scheduler.waiting[:1]
        if not head:
            self._head_wait.pop(worker_id, None)
            return
        before = self._head_wait.get(worker_id)
        steps = before[1] + 1 if before is not None and before[0] == head[0] else 0
        self._head_wait[worker_id] = (head[0], steps)
        bound = scheduler.limits.max_seqs * self.largest_request + 2
        if steps > bound:
            self.violations.append(
                f"{worker_id}: sequence {head[0]} waited at the head of the queue for "
                f"{steps} steps (bound {bound}): starved"
            )

    def _check_decode(self, worker_id: str, decode: Decode) -> None:
        """A decode step writes the last token's position: every earlier one must be
        written (by prefill or by earlier steps since its admission), and its block
        table must cover exactly the positions so far (no block taken early, none
        missing)."""
        tokens = len(self.schedulers[worker_id].tokens(decode.key))
        kv = self.kv[worker_id]
        written, table = kv.written(decode.key), len(kv.table(decode.key))
        if written < tokens - 1:
            self.violations.append(
                f"{worker_id}: sequence {decode.key} decodes position {tokens - 1} with "
                f"positions {written}..{tokens - 2} never written since its admission"
            )
        if table != blocks_for(tokens, self.kv_block_size):
            self.violations.append(
                f"{worker_id}: sequence {decode.key} holds {table} blocks for {tokens} "
                f"positions ({blocks_for(tokens, self.kv_block_size)} needed)"
            )

    def _check_plan(
        self, worker_id: str, batch: list[Running], plan: StepPlan, limits: BatchLimits
    ) -> None:
        """core.batching's promises: every decoding entry decodes, no chunk exceeds its
        prompt or the chunk limit, the step stays in its budget, prefill always moves."""
        decoding = {r.key for r in batch if r.decoding}
        budget = limits.max_step_tokens if decoding else limits.max_idle_prefill_tokens
        left = {r.key: r.prompt_tokens - r.prefilled for r in batch if not r.decoding}
        largest = limits.max_prefill_tokens if decoding else limits.max_idle_prefill_tokens
        problem = None
        if set(plan.decode) != decoding:
            problem = f"decodes {sorted(plan.decode)}, decoding {sorted(decoding)}"
        elif len(batch) > limits.max_seqs:
            problem = f"{len(batch)} admitted, {limits.max_seqs} slots"
        elif any(not 0 < n <= min(left.get(k, 0), largest) for k, n in plan.prefill):
            problem = f"prefill chunks {plan.prefill} for {left}"
        elif plan.tokens > budget:
            problem = f"{plan.tokens} tokens in a step of {budget}"
        elif left and not plan.prefill:
            problem = f"nothing prefilled while {left} wait"
        if problem is not None:
            self.violations.append(f"{worker_id} batch plan broke its limits: {problem}")

    def run_step(
        self, worker_id: str, plan: StepPlan, misbehave: Callable[[], str | None] | None = None
    ) -> None:
        """Carry out a planned step: prefill chunks land, each decoding entry emits a token.
        Entries stopped while the step ran are skipped."""
        decodes = self.decodes[worker_id]
        scheduler = self.schedulers[worker_id]
        for key, tokens in plan.prefill:
            if self._keys[key] in decodes and scheduler.state(key) is SeqState.PREFILLING:
                scheduler.prefilled(key, tokens)
                prefilled, _ = scheduler.progress(key)
                self.kv[worker_id].wrote(key, scheduler.tokens(key)[:prefilled])
        for key in plan.decode:
            assignment = self._keys[key]
            if assignment in self.decodes[worker_id]:
                self.decode_step(worker_id, assignment, misbehave() if misbehave else None)

    def running_decodes(self) -> list[tuple[str, Assignment]]:
        return [(w, a) for w, decodes in self.decodes.items() for a in decodes]

    @property
    def now(self) -> float:
        return self.clock.now

    def advance(self, until: float) -> None:
        """Move the clock to `until`, running everything due on the way, in order."""
        self.clock.run_until(until)

    # --- what a driver may ask ---

    def alive(self, worker_id: str) -> bool:
        """Running: neither crashed nor stalled."""
        return worker_id not in self.down and worker_id not in self.paused

    def is_down(self, worker_id: str) -> bool:
        return worker_id in self.down

    def is_paused(self, worker_id: str) -> bool:
        return worker_id in self.paused

    def crashed(self) -> list[str]:
        return sorted(self.down)

    def stalled(self) -> list[str]:
        return sorted(self.paused)

    def epoch(self, worker_id: str, router_id: str | None = None) -> int:
        """The epoch the worker serves a router under (the first live one unless named)."""
        router_id = self._first().router_id if router_id is None else router_id
        return self.workers[worker_id].links()[router_id]

    def process(self, worker_id: str) -> int:
        """Which process of this worker id runs now (1 for the first, then each restart)."""
        return self._processes[worker_id]

    def links(self, worker_id: str) -> dict[str, int]:
        """router id -> epoch, for each router the worker process is linked to."""
        return self.workers[worker_id].links()

    def decoders(self) -> ItemsView[str, dict[Assignment, Decode]]:
        """(worker id, its running decodes) for every worker, in worker order (read only)."""
        return self.decodes.items()

    def decodes_on(self, worker_id: str) -> Mapping[Assignment, Decode]:
        return self.decodes[worker_id]

    def has_outcome(self, request_id: str, router_id: str | None = None) -> bool:
        node = self.nodes.get(router_id) if router_id is not None else self._first()
        return node is None or node.streams[request_id].outcome is not None

    def streams(self) -> list[ClientStream]:
        """Every client's stream, at every router there has been."""
        return [s for node in self.all_nodes for s in node.streams.values()]

    def submitted(self) -> int:
        return sum(len(node.streams) for node in self.all_nodes)

    def open_requests(self) -> list[GenerationRequest]:
        return [s.request for s in self.streams() if s.outcome is None and not s.cut]

    def settled(self) -> bool:
        """Every request has its outcome and every slot is back, as all machines see it."""
        if any(self.decodes.values()) or next(self._open_streams(), None) is not None:
            return False
        if any(w.free_slots != w.config.slots for w in self.workers.values()):
            return False
        if self._stale_views():
            return False
        return not any(
            held for node in self.nodes.values() for _, held, _ in node.router.slot_usage()
        )

    def unsettled_reasons(self) -> list[str]:
        parts = []
        if self.unfinished():
            parts.append(f"requests without an outcome {self.unfinished()[:5]}")
        busy = [w for w, worker in self.workers.items() if worker.free_slots != worker.config.slots]
        if busy:
            parts.append(f"workers with slots still taken {busy}")
        for node in self.nodes.values():
            held = [v.worker_id for v in node.router.statistics().workers if v.held]
            if held:
                parts.append(f"router {node.router_id!r} still counts slots on {held}")
        if stale := self._stale_views():
            parts.append(f"a router's view of workers is stale: {stale}")
        return parts

    def _stale_views(self) -> list[str]:
        """Workers a live router does not see as healthy at the epoch the worker serves
        it under (or at all, though the worker runs)."""
        stale = []
        for router_id, node in self.nodes.items():
            actual = {w: worker.links().get(router_id) for w, worker in self.workers.items()}
            seen = set()
            for view in node.router.statistics().workers:
                seen.add(view.worker_id)
                if view.worker_id in actual and (
                    not view.healthy or view.epoch != actual[view.worker_id]
                ):
                    stale.append(
                        f"{view.worker_id} (router {router_id!r}: epoch {view.epoch}, "
                        f"healthy {view.healthy}; worker: epoch {actual[view.worker_id]})"
                    )
            stale += [f"{w} unknown to router {router_id!r}" for w in actual if w not in seen]
        return stale

    def outcomes(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for stream in self.streams():
            match stream.outcome:
                case DeliverFinished(reason=reason) | DeliverError(kind=reason):
                    counts[reason] += 1
                case None if stream.cut:
                    counts["cut"] += 1
        return counts

    def attempts_lost(self) -> int:
        return sum(node.oracles.attempts.attempts_lost for node in self.all_nodes)

    def full_declines(self) -> int:
        return sum(node.oracles.attempts.full_declines for node in self.all_nodes)

    def resends(self) -> int:
        return sum(node.router.statistics().resends_requested for node in self.all_nodes)

    def resumes(self) -> int:
        return sum(node.router.statistics().resumes for node in self.all_nodes)

    def handoffs(self) -> tuple[int, int]:
        """(streams handed off by draining workers, of those gone back to that worker)."""
        stats = [node.router.statistics() for node in self.all_nodes]
        return sum(s.handoffs for s in stats), sum(s.handoffs_back for s in stats)

    def waste_s(self) -> float:
        return self.worker_oracles.waste_s

    def fenced(self) -> Counter[str]:
        """Messages fenced, by machine and reason (router.gap, worker.late_token, ...),
        summed over every router there has been."""
        fenced: Counter[str] = Counter()
        for node in self.all_nodes:
            for reason, n in node.router.statistics().fenced.items():
                fenced[f"router.{reason}"] += n
        for worker in self.workers.values():
            for reason, n in worker.statistics().fenced.items():
                fenced[f"worker.{reason}"] += n
        return fenced

    def error_causes(self) -> Counter[str]:
        """Error outcomes by kind and cause (the message without its particulars)."""
        counts: Counter[str] = Counter()
        for stream in self.streams():
            if isinstance(stream.outcome, DeliverError):
                started = "after tokens" if stream.tokens else "before tokens"
                counts[f"{stream.outcome.kind} {started}: {_cause(stream.outcome.message)}"] += 1
        return counts

    def tokens_delivered(self) -> int:
        return sum(len(s.tokens) for s in self.streams())

    # --- oracles ---

    def check_safety(self) -> None:
        """Raise InvariantViolation if any client saw something the contract forbids, or
        an oracle of sim/oracles.py found a fault it cannot explain. The per-machine
        checks read only the workers and routers that handled an event since the last
        call: nothing else changes what they read."""
        if self.violations:
            raise InvariantViolation(self.violations[0])
        if self.streams_oracle.violations:
            raise InvariantViolation(self.streams_oracle.violations[0])
        for node in self.all_nodes:
            if node.oracles.violations:
                raise InvariantViolation(node.oracles.violations[0])
        if self.worker_oracles.violations:
            raise InvariantViolation(self.worker_oracles.violations[0])
        touched, self._touched_workers = self._touched_workers, {}
        for worker_id in touched:
            if worker_id in self.down:
                continue
            worker = self.workers[worker_id]
            holds = worker.holds()
            if len(holds) > worker.config.slots:
                raise InvariantViolation(f"{worker_id} over-committed its slots")
            linked = worker.links()
            if any(a.router not in linked for a in holds):
                # A lost link's work ends with it: nobody can receive its tokens.
                foreign = [a for a in holds if a.router not in linked]
                raise InvariantViolation(f"{worker_id} holds {foreign} of routers it lost")
            decodes = self.decodes[worker_id]
            if decodes and not decodes.keys() <= holds:
                # Cancelled or ended work must stop at once, not burn a slot's compute.
                raise InvariantViolation(f"{worker_id} decodes assignments it no longer holds")
        routers, self._touched_routers = self._touched_routers, {}
        for router_id in routers:
            router = self.nodes.get(router_id)
            if router is None:
                continue  # crashed since
            for worker_id, held, _ in router.router.slot_usage():
                # Against the worker's own slot count: a draining worker reports none free.
                if held > self.workers[worker_id].config.slots:
                    raise InvariantViolation(f"router {router_id!r} over-committed {worker_id}")

    def check_end(self, fault_kinds: set[str]) -> None:
        """The checks of a finished run: fence counters the faults cannot explain, and
        every live process's scheduler empty with every block back (free or cached),
        whatever was preempted, cancelled, superseded or cut off on the way."""
        self.oracles.check_fences(self.fenced(), fault_kinds)
        for worker_id, kv in self.kv.items():
            if worker_id in self.down:
                continue
            kv.check()
            if kv.manager.holders() or self.schedulers[worker_id].has_work():
                self.violations.append(
                    f"{worker_id}: the run settled with {kv.manager.holders()} sequences "
                    f"holding blocks, scheduler waiting {self.schedulers[worker_id].waiting}"
                )
        self._touched_workers.update(dict.fromkeys(self.workers))
        self._touched_routers.update(dict.fromkeys(self.nodes))
        self.check_safety()

    def unfinished(self) -> list[str]:
        """Requests of live routers still without an outcome (router id: request id)."""
        return [f"{router}:{rid}" if router else rid for router, rid in self._open_streams()]

    def _open_streams(self) -> Iterator[tuple[str, str]]:
        """(router id, request id) of each live router's request without an outcome."""
        for node in self.nodes.values():
            for rid, stream in node.streams.items():
                if stream.outcome is None:
                    yield node.router_id, rid

    # --- effect execution ---

    def in_flight_append(self, packet: Packet) -> None:
        """The default network: hold every packet until the caller delivers it."""
        self.in_flight.append(packet)

    def _send(
        self, source: str, to: str | None, message: ToWorker | FromWorker, router: str
    ) -> None:
        self._packet_ids += 1
        self.on_send(Packet(self._packet_ids, source, to, message, router))

    def _run_router(self, node: RouterNode, event: RouterEvent) -> list[RouterEffect]:
        before = node.oracles.before_router(event)
        self._touched_routers[node.router_id] = None
        effects = node.router.handle(event, self.clock.now)
        if self.trace is not None:
            who = f"router{node.router_id}"
            self.trace(f"{self.now:9.4f} {who:7} {_show(event)} -> {_show_all(effects)}")
        for effect in effects:
            self._apply_router_effect(node, effect)
        node.oracles.after_router(event, effects, before, self.clock.now)
        return effects

    def _apply_router_effect(self, node: RouterNode, effect: RouterEffect) -> None:
        match effect:
            case SendToWorker(worker_id, message):
                self._send("router", worker_id, message, node.router_id)
            case ArmTimer(key, deadline):
                self._arm(node.owner, key, deadline)
            case DisarmTimer(key):
                self._timers[node.owner].pop(key, None)
            case DeliverToken() | DeliverFinished() | DeliverError():
                self.streams_oracle.delivered(node.streams.get(effect.request_id), effect)
                self.on_deliver(node.router_id, effect)

    def _drop(self, worker_id: str, assignment: Assignment) -> None:
        decode = self.decodes[worker_id].pop(assignment, None)
        if decode is not None:
            self.schedulers[worker_id].remove(decode.key)
            self._admitted[worker_id].pop(decode.key, None)

    def _run_worker(self, worker_id: str, event: WorkerEvent) -> None:
        if worker_id in self.down:
            return
        self._touched_workers[worker_id] = None
        if isinstance(event, TimerFired | WorkerStart):  # a heartbeat may go out
            self.workers[worker_id].cache = self.kv[worker_id].report()
        effects = self.workers[worker_id].handle(event, self.clock.now)
        if self.trace is not None:
            self.trace(f"{self.now:9.4f} {worker_id:7} {_show(event)} -> {_show_all(effects)}")
        for effect in effects:
            self._apply_worker_effect(worker_id, effect)
        self.worker_oracles.after_worker(worker_id, event, effects)

    def _apply_worker_effect(self, worker_id: str, effect: WorkerEffect) -> None:
        match effect:
            case SendToRouter(message, router_id):
                self._send(worker_id, None, message, router_id)
            case StartDecode(assignment, request):
                self._drop(worker_id, assignment)  # a start again replaces the old run
                salt = assignment.attempt if diverges(request) else 0
                run = FakeDecode(assignment, request, salt)
                self._decode_keys += 1
                key = self._decode_keys
                self._keys[key] = assignment
                context = request.prompt_token_ids + request.output_prefix
                decode = Decode(request, self.clock.now, run, key)
                self.decodes[worker_id][assignment] = decode
                self.schedulers[worker_id].add(key, context, request.context_tokens)
            case StopDecode(assignment):
                self._drop(worker_id, assignment)
            case ArmTimer(key, deadline):
                self._arm(worker_id, key, deadline)
            case DisarmTimer(key):
                self._timers[worker_id].pop(key, None)

    # --- timers, on the shared clock ---

    def _arm(self, owner: Owner, key: TimerKey, deadline: float) -> None:
        """(Re-)arm a machine's timer; an entry for an earlier arming goes stale."""
        timers = self._timers[owner]
        current = timers.get(key)
        self._arms += 1
        rank = current.rank if current is not None else self._arms
        timers[key] = _Armed(deadline, self._arms, rank)
        self.clock.schedule_timer(
            deadline,
            (self._owner_rank[owner], rank),
            partial(self._timer_live, owner, key, self._arms),
            partial(self._fire, owner, key),
        )

    def _timer_live(self, owner: Owner, key: TimerKey, arm: int) -> bool:
        if owner in self.paused:
            return False  # armed again when it resumes
        armed = self._timers[owner].get(key)
        return armed is not None and armed.arm == arm

    def _fire(self, owner: Owner, key: TimerKey) -> None:
        del self._timers[owner][key]
        if owner.startswith("@"):
            self._run_router(self.nodes[owner[1:]], TimerFired(key))
        else:
            self._run_worker(owner, TimerFired(key))


def _show(item: object) -> str:
    """A compact, stable rendering of an event or effect for traces."""
    text = repr(item)
    for long, short in _ABBREVIATIONS:
        text = text.replace(long, short)
    return text


def _show_all(effects: list[RouterEffect] | list[WorkerEffect]) -> str:
    return "[" + ", ".join(_show(e) for e in effects) + "]"


_ABBREVIATIONS = (
    ("Assignment(request_id=", "A("),
    ("FromWorkerMessage(worker_id=", "From("),
    ("FromRouterMessage(message=", "From("),
    ("SendToWorker(worker_id=", "Send("),
    ("SendToRouter(message=", "Send("),
    (", router_id='')", ")"),
    (", router='')", ")"),
    ("GenerationRequest(request_id=", "Req("),
    ("sampling=Sampling(temperature=0.0, top_p=1.0, seed=", "seed=("),
    (", stop_token_ids=()", ""),
    (", logprobs=None, constraint=None", ""),
    ("prompt_token_ids=", "prompt="),
    ("max_new_tokens=", "max_new="),
    ("assignment=", ""),
    ("attempt=", ""),
    ("request=", ""),
    ("message=", ""),
)


def _cause(message: str) -> str:
    """An error message with its particulars (ids, counts) taken out, to count by."""
    return " ".join(w for w in message.split() if not any(c.isdigit() for c in w))


def _misbehave(events: list[DecoderEvent], how: str, max_new_tokens: int) -> None:
    """Turn one step's correct decoder events into a misbehaving decoder's."""
    first = events[0] if events else None
    last = events[-1] if events else None
    match how:
        case "repeat" if isinstance(first, Decoded):
            events.insert(1, first)
        case "skip" if isinstance(first, Decoded):
            events[0] = Decoded(first.assignment, first.index + 1, first.token_id, first.logprob)
        case "overrun" if isinstance(last, DecodeDone):
            # A token past the end: at the budget's index if the budget ended it.
            end = max_new_tokens if last.reason == "length" else None
            if end is not None:
                events.insert(len(events) - 1, Decoded(last.assignment, end, 1))
            else:
                events.append(Decoded(last.assignment, max_new_tokens + 1, 1))
        case "end_twice" if isinstance(last, DecodeDone):
            events.append(last)
