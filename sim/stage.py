"""What the parts of one simulation share: the clock, the ledger, the phase, the log.

A Simulation (sim/simulator.py) is cut into parts that act on one cluster:
the clients (sim/clients.py), the fault actuators (sim/faults.py), the seeded
network (sim/network.py) and the decoder steps (sim/steps.py). Each is given
the Stage: the one clock, the disturbance ledger the oracles read
(sim/disturbances.py), the timeline if one listens, whether the faults have
healed (the liveness phase), and the run's log: the faults injected, counted
by kind, and (in a traced run) a line for each fault and note.
"""

from __future__ import annotations

from collections import Counter

from sim.clock import Clock
from sim.disturbances import Disturbances
from sim.timeline import Timeline
from sim.trace import Trace


class Stage:
    def __init__(
        self,
        clock: Clock,
        disturbances: Disturbances,
        timeline: Timeline | None,
        trace: Trace | None,
    ) -> None:
        self.clock = clock  # the one clock and event queue: ours and the machines' timers
        self.disturbances = disturbances
        self.timeline = timeline
        self.trace = trace
        self.faults: Counter[str] = Counter()  # injected, by kind
        self.healed = False  # the faults have stopped: the liveness phase runs

    def fault(self, kind: str, detail: str) -> None:
        """A fault of this kind struck (counted, and traced)."""
        self.faults[kind] += 1
        if self.trace is not None:
            self.trace.write(f"{self.clock.now:9.4f} fault   {kind} {detail}")

    def note(self, text: str) -> None:
        """A line of the simulator's own in the trace (a restart, a drained exit, ...)."""
        if self.trace is not None:
            self.trace.write(f"{self.clock.now:9.4f} sim     {text}")

    def disturb(self, worker_id: str, kind: str, duration_s: float) -> list[float | str]:
        """The worker is disturbed from now for duration_s: an interval of the ledger."""
        now = self.clock.now
        return self.disturbances.add(worker_id, kind, now, now + duration_s)
