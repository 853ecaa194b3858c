"""The seeded network: every packet's delay, and the faults that strike packets.

The cluster hands each packet it sends to `on_send`, which draws its delay
from the `{seed}/net` stream (wide under delay_spread, so messages reorder)
and schedules its landing on the clock, and during the fault phase may lose
it, hold it back (late), deliver it twice (duplicate) or send an old one
again (replay). A packet is cut where it lands by a partition or blackout
(sim/faults.py keeps those), and one for a stalled worker waits until the
worker resumes. The finish_lost fault also acts here, on the Finished of a
completed output and on the acceptance of the continuation that follows it
(its times from the `{seed}/finish` stream). Each disturbance of a packet is
recorded against its worker, and a control message landing after a later
one on its link is noted as the run event "overtake" (sim/disturbances.py
REORDERING).
"""

from __future__ import annotations

from collections import deque
from random import Random

from core.protocol import Assignment, Finished, Offer, OfferResult, Token
from sim.cluster import Cluster, Packet
from sim.faults import Faults
from sim.scenario import Scenario, Swarm
from sim.stage import Stage
from sim.timeline import request_key


class Network:
    def __init__(
        self,
        stage: Stage,
        cluster: Cluster,
        scenario: Scenario,
        swarm: Swarm,
        faults: Faults,
        rng: Random,
        finish_rng: Random,
    ) -> None:
        self.stage = stage
        self.clock = stage.clock
        self.disturbances = stage.disturbances
        self.timeline = stage.timeline
        self.cluster = cluster
        self.scenario = scenario
        self.swarm = swarm
        self.faults = faults
        self._rng = rng
        self._finish_rng = finish_rng  # its own: the other draws stay put
        router = scenario.router
        self._delay_max_s = swarm.delay_max_s
        # A packet this slow can by itself make the router give up on an attempt (an
        # offer's round trip past the offer timeout, ...): it counts as a disturbance.
        self._slow_packet_s = min(router.offer_timeout_s, router.heartbeat_timeout_s) / 2
        self._history: deque[Packet] = deque(maxlen=256)
        # Per directed link (worker, router, direction): the latest-sent control message
        # (anything but a Token) delivered so far, to see one land after a later one.
        self._control_landed: dict[tuple[str, str, str], deque[tuple[int, object]]] = {}
        # finish_lost: when each strikes (at the first completion from then on); the
        # requests whose Finished it took; their continuations, whose acceptance waits.
        window = scenario.fault_end_s
        self._finish_at = sorted(
            self._finish_rng.uniform(0.5, window) for _ in range(swarm.finish_losses)
        )
        self._completing: set[tuple[str, str]] = set()
        self._overtaken: dict[Assignment, Packet | None] = {}
        # Per worker link: the latest Token sent (its assignment, index, when, delay).
        self._last_token: dict[tuple[str, str], tuple[Assignment, int, float, float]] = {}

    def _run_floor(self, packet: Packet) -> float:
        """The least delay of a packet: 0, but a Token that continues a run of its
        assignment sent at the same instant (a speculating decoder's step, written to
        the link at once) lands, and so does a copy of it, no earlier than the token
        before it, as one write does on a TCP connection. Loss and lateness still
        strike each token of a run on its own."""
        message = packet.message
        last = self._last_token.get((packet.source, packet.router))
        if not isinstance(message, Token) or last is None:
            return 0.0
        run = last[:3] == (message.assignment, message.index - 1, self.clock.now)
        return last[3] if run else 0.0

    def _note_token(self, packet: Packet, delay: float) -> None:
        message = packet.message
        if isinstance(message, Token):
            link = (packet.source, packet.router)
            self._last_token[link] = (message.assignment, message.index, self.clock.now, delay)

    def on_send(self, packet: Packet) -> None:
        if (self._finish_at or self._overtaken) and self._finish_lost(packet):
            return
        rng = self._rng
        swarm = self.swarm
        floor = self._run_floor(packet)
        delay = max(rng.uniform(swarm.delay_min_s, swarm.delay_max_s), floor)
        self._note_token(packet, delay)
        worker_id = _worker_of(packet)
        if delay > self._slow_packet_s:
            self.stage.disturb(worker_id, "slow_packet", delay)
        if self.stage.healed:
            self.clock.schedule(self.clock.now + delay, self._deliver, packet, self._sent(packet))
            return
        if rng.random() < swarm.loss_rate:
            self.stage.fault("loss", _brief(packet))
            self.stage.disturb(worker_id, "loss", 0.0)
            if self.timeline is not None:
                self.timeline.lost(self._sent(packet), self.clock.now)
            return
        copy = ""
        if rng.random() < swarm.late_rate:
            delay += rng.uniform(0.5, 3.0)
            self.stage.fault("late", _brief(packet))
            self.stage.disturb(worker_id, "late", delay)
            copy = "late"
        self.clock.schedule(self.clock.now + delay, self._deliver, packet, self._sent(packet, copy))
        if rng.random() < swarm.duplicate_rate:
            self.stage.fault("duplicate", _brief(packet))
            extra = max(rng.uniform(swarm.delay_min_s, swarm.delay_max_s * 2), floor)
            self.stage.disturb(worker_id, "duplicate", extra)
            flight = self._sent(packet, "duplicate")
            self.clock.schedule(self.clock.now + extra, self._deliver, packet, flight)
        if self._history and rng.random() < swarm.replay_rate:
            old = self._history[rng.randrange(len(self._history))]
            self.stage.fault("replay", _brief(old))
            later = rng.uniform(0.01, 2.0)
            self.stage.disturb(_worker_of(old), "replay", later)
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
                    or self.stage.healed
                    or not self.cluster.alive(packet.source)
                ):
                    return False
                self._finish_at.pop(0)
                self.stage.fault("finish_lost", f"{packet.source} {assignment}")
                self.stage.disturb(packet.source, "loss", 0.0)
                if self.timeline is not None:
                    self.timeline.lost(self._sent(packet), now)
                self._completing.add((packet.router, assignment.request_id))
                downtime = self._finish_rng.uniform(0.1, 1.0)
                self.clock.schedule(now, self.faults.crash, packet.source, downtime)
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
                    self.stage.disturb(packet.source, "late", hold_s)
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
        if self.faults.cut(worker_id, direction):
            self.stage.fault("partition_drop", _brief(packet))
            self._landed(flight, "cut by a partition")
            return
        if packet.to is not None and self.cluster.is_paused(packet.to):
            # A stalled process reads its socket only when it resumes.
            self.clock.schedule(self.faults.resume_at[packet.to], self._deliver, packet, flight)
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

    # --- the timeline (only with one: nothing here draws from the run's random streams) ---

    def _sent(self, packet: Packet, copy: str = "") -> int:
        """The timeline's flight for one copy of a packet leaving now (-1: none kept)."""
        timeline = self.timeline
        if timeline is None:
            return -1
        place = f"router {self.cluster.router_place(packet.router)}"
        source, target = (place, packet.to) if packet.to is not None else (packet.source, place)
        about = getattr(packet.message, "assignment", None)
        request = None if about is None else request_key(packet.router, about.request_id)
        return timeline.sent(self.clock.now, source, target, packet.message, request, copy)

    def _landed(self, flight: int, fate: str) -> None:
        if self.timeline is not None and flight >= 0:
            self.timeline.landed(flight, self.clock.now, fate)


def _worker_of(packet: Packet) -> str:
    return packet.source if packet.to is None else packet.to


def _brief(packet: Packet) -> str:
    to = packet.to or "router"
    return f"{packet.source}->{to} {type(packet.message).__name__}"
