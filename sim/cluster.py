"""A cluster of the real core machines joined by a controllable fake network.

Cluster wires core Routers (one, or several sharing the workers) to N core
Workers, each worker linked to every live router. Nothing here decides *when*
things happen: the caller (a hypothesis state machine in the tests, a seeded
scheduler in the simulator) picks which in-flight message to deliver, which
to duplicate, when a decoder makes a step and when time advances. The cluster
executes the machines' effects faithfully and records what every client saw,
so the oracles can judge the run after every step (`invariants.check_safety()`,
sim/invariants.py). The machines' timers go on the caller's clock
(sim/clock.py Timers), the one queue of everything that happens in a run; a
caller that brings none gets its own. Each worker process's decoder is one of
`decoders` (sim/decoders.py): the worker machine starts and stops its decodes,
the driver plans and takes its steps. What a driver needs to know or do is a
method here or there, so drivers never reach into the cluster's tables.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

from core.config import RouterConfig
from core.protocol import (
    ArmTimer,
    Assignment,
    ClientCancel,
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
from core.worker import Worker, WorkerConfig
from sim.clock import Clock, Owner, Timers
from sim.decoders import Decoders, Speculation
from sim.disturbances import Disturbances
from sim.invariants import Invariants
from sim.oracles import Oracles
from sim.streams import ClientStream, StreamOracles
from sim.trace import show, show_all
from sim.worker_oracles import WorkerOracles


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
        trace: Callable[[str], None] | None = None,
        clock: Clock | None = None,
        disturbances: Disturbances | None = None,
        kv_block_size: int = 4,
        largest_request: int | None = None,
        routers: int = 1,
        speculation: Speculation | None = None,
    ) -> None:
        self.clock = clock or Clock()
        # Where each packet sent goes: held in `in_flight` until the driver delivers it,
        # unless the driver brings a network of its own (the simulator: sim/network.py).
        self.on_send: Callable[[Packet], None] = self.in_flight_append
        self.trace = trace
        # Told of every delivery to a client (router id, the delivery): a timeline.
        self.on_deliver: Callable[[str, DeliverToken | DeliverFinished | DeliverError], None]
        self.on_deliver = lambda router_id, delivery: None
        self.disturbances = disturbances
        self.router_config = router_config or RouterConfig()
        self.shared = routers > 1  # several routers share the workers
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
        self.workers: dict[str, Worker] = {}
        self.down: set[str] = set()  # crashed: events to them vanish
        self.paused: set[str] = set()  # stalled: their timers wait until they resume
        self.timers = Timers(self.clock, self._timer_fired, self.paused)
        self.in_flight: list[Packet] = []
        self._packet_ids = 0
        self.violations: list[str] = []
        # Each worker process's fake decoder, scheduler and KV cache (sim/decoders.py).
        self.decoders = Decoders(
            self.clock,
            self._run_worker,
            self.violations.append,
            disturbances,
            max_context,
            kv_block_size,
            largest_request or max_context,
            speculation,
        )
        self.invariants = Invariants(self)  # checked after every event (sim/invariants.py)
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
        self.timers.add_owner(node.owner)
        for worker_id in self.workers:
            if worker_id not in self.down:
                self.link(worker_id, router_id)
        return node

    def crash_router(self, router_id: str) -> list[str]:
        """The router process dies: its state and timers are gone, what is in flight to
        it vanishes, and its clients' streams are cut. Returns the workers linked to it
        (each hears its link close when the caller says: `router_link_lost`)."""
        node = self.nodes.pop(router_id)
        self.timers.clear(node.owner)
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
        self.decoders.start(worker_id, config.slots)
        self.timers.add_owner(worker_id)
        self.down.discard(worker_id)
        touched = self.invariants.touched_routers
        touched.update(dict.fromkeys(self.nodes))  # its slot count is judged anew
        self._run_worker(worker_id, WorkerStart())
        for router_id, epoch in epochs.items():
            self._run_worker(worker_id, RouterLinked(router_id, epoch))
        return True

    def fail_decoder(self, worker_id: str) -> None:
        """The worker's decoder breaks: every running assignment there fails."""
        self.decoders.fail(worker_id)
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
        self.timers.resume(worker_id, self.clock.now)

    def crash_worker(self, worker_id: str) -> None:
        """The process dies: its state, timers and decodes are gone."""
        self.down.add(worker_id)
        self.paused.discard(worker_id)
        self.timers.clear(worker_id)
        self.decoders.lose(worker_id)

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

    @property
    def decoder_failures(self) -> int:
        """Decoder failures injected so far (for the stream oracles)."""
        return self.decoders.decoder_failures

    @property
    def misbehaviours(self) -> int:
        """Decoder steps that went wrong on purpose so far (for the stream oracles)."""
        return self.decoders.misbehaviours

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

    def tokens_delivered(self) -> int:
        return sum(len(s.tokens) for s in self.streams())

    def unfinished(self) -> list[str]:
        """Requests of live routers still without an outcome (router id: request id)."""
        return [f"{router}:{rid}" if router else rid for router, rid in self.open_streams()]

    def open_streams(self) -> Iterator[tuple[str, str]]:
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
        self.invariants.touched_routers[node.router_id] = None
        effects = node.router.handle(event, self.clock.now)
        if self.trace is not None:
            who = f"router{node.router_id}"
            self.trace(f"{self.now:9.4f} {who:7} {show(event)} -> {show_all(effects)}")
        for effect in effects:
            self._apply_router_effect(node, effect)
        node.oracles.after_router(event, effects, before, self.clock.now)
        return effects

    def _apply_router_effect(self, node: RouterNode, effect: RouterEffect) -> None:
        match effect:
            case SendToWorker(worker_id, message):
                self._send("router", worker_id, message, node.router_id)
            case ArmTimer(key, deadline):
                self.timers.arm(node.owner, key, deadline)
            case DisarmTimer(key):
                self.timers.disarm(node.owner, key)
            case DeliverToken() | DeliverFinished() | DeliverError():
                self.streams_oracle.delivered(node.streams.get(effect.request_id), effect)
                self.on_deliver(node.router_id, effect)

    def _run_worker(self, worker_id: str, event: WorkerEvent) -> None:
        if worker_id in self.down:
            return
        self.invariants.touched_workers[worker_id] = None
        if isinstance(event, TimerFired | WorkerStart):  # a heartbeat may go out
            self.workers[worker_id].cache = self.decoders.kv[worker_id].report()
        effects = self.workers[worker_id].handle(event, self.clock.now)
        if self.trace is not None:
            self.trace(f"{self.now:9.4f} {worker_id:7} {show(event)} -> {show_all(effects)}")
        for effect in effects:
            self._apply_worker_effect(worker_id, effect)
        self.worker_oracles.after_worker(worker_id, event, effects)

    def _apply_worker_effect(self, worker_id: str, effect: WorkerEffect) -> None:
        match effect:
            case SendToRouter(message, router_id):
                self._send(worker_id, None, message, router_id)
            case StartDecode(assignment, request):
                self.decoders.start_decode(worker_id, assignment, request)
            case StopDecode(assignment):
                self.decoders.drop(worker_id, assignment)
            case ArmTimer(key, deadline):
                self.timers.arm(worker_id, key, deadline)
            case DisarmTimer(key):
                self.timers.disarm(worker_id, key)

    def _timer_fired(self, owner: Owner, key: TimerKey) -> None:
        """A machine's timer fired (sim/clock.py Timers): its machine handles it."""
        if owner.startswith("@"):
            self._run_router(self.nodes[owner[1:]], TimerFired(key))
        else:
            self._run_worker(owner, TimerFired(key))
