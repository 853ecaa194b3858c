"""What the run disturbed, and what each kind of disturbance can explain.

The simulator records every disturbance it causes, per worker, as an interval
(Disturbances): a crash until the restart, a stall, a partition, a drain until
the process exits, a decoder failure, a hung or misbehaving decoder, a pool
out of blocks, and each packet to or from the worker that was lost, held
back, duplicated, replayed or delayed past half the shortest router timeout.
Kinds that strike the whole network rather than one worker (delay spread, a
client's cancel, a router's crash, the run event "overtake") are only noted.
The oracles (sim/oracles.py and the modules beside it) ask it whether a
fault explains what they see.

The tables here say which kinds explain what: DECODER_FAULTS a `failed`
outcome, PROGRESS_STOPS and LINK_CUTS a worker the router calls stuck,
HEARTBEAT_STOPS a missing hold kept longer, and FENCE_CAUSES each fence
counter. A new fault kind (sim/scenario.py FAULT_KINDS) is named here in
every table whose effect it can have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

DECODER_FAULTS = frozenset({"decoder_failure", "decoder_misbehaves"})
# What stops or slows a decoder's progress, so that the router may rightly call its worker
# stuck (besides a worker the swarm made slow): a hung decoder, a stalled process, a pool
# out of blocks (a preemption, or a sequence waiting for blocks with a row free).
PROGRESS_STOPS = frozenset({"decoder_hang", "stall", "kv_pressure"})
# What cuts a worker's link to the router (one way or both): while it lasts, a token that
# was lost or dropped after a gap cannot be asked for again, so an attempt may miss its
# deadline with the decoder running. It calls the worker stuck rightly only when the cut
# lasted through the whole missed deadline (bar one network delay).
LINK_CUTS = frozenset({"partition", "blackout"})
# What stops a worker's heartbeats from reaching the router for a while (a lost or late
# one only costs an interval: the next one comes).
HEARTBEAT_STOPS = frozenset({"stall", "partition", "blackout", "crash", "drain", "impostor"})

# Which fault kinds (or run events: "attempt_lost", "resend", "overtake", "handoff_back")
# can move each fence counter. A counter above zero in a run that had none of them is a
# bug; an empty set means only a bug can move it. Counters not listed (router.late,
# router.duplicate_result) also move in a run without faults. REORDERING: the faults
# that deliver a message after later ones, or twice (a stalled worker's inbox is
# delivered when it resumes, and a heal that ends the stall early can reorder it), and
# the run event "overtake": a control message that landed after one sent later on its
# link, which the small per-message delays of a quiet network also cause now and then
# (sim/network.py _note_overtake).
REORDERING = frozenset({"late", "delay_spread", "duplicate", "replay", "stall", "overtake"})
FENCE_CAUSES: dict[str, frozenset[str]] = {
    "router.wrong_worker": frozenset(),
    "router.over_budget": frozenset(),
    # Also the draining worker's tokens for an attempt it handed off, until the
    # router's Cancel reaches it.
    "router.stale_attempt": frozenset({"attempt_lost", "drain"}),
    # A HandOff that reaches the router after it let the worker's epoch go; only a
    # draining worker sends one.
    "router.stale_handoff": frozenset({"drain"}),
    "router.duplicate": frozenset({"duplicate", "replay", "resend"}),
    # Also a handoff gone back: while the continuation was offered, the draining worker's
    # tokens were stale and dropped, so its next one after the stream comes back lies
    # past them (the Resend the router sends on taking it back asks for them again).
    "router.gap": frozenset(
        {"loss", "late", "partition", "blackout", "delay_spread", "handoff_back"}
    ),
    "router.stale_heartbeat": REORDERING | {"crash", "drain"},
    "router.orphan": REORDERING | {"attempt_lost", "client_cancel"},
    "router.unknown_epoch": frozenset({"future_epoch"}),
    "worker.late_token": frozenset({"decoder_misbehaves"}),
    "worker.duplicate": frozenset({"decoder_misbehaves"}),
    "worker.gap": frozenset({"decoder_misbehaves"}),
    "worker.over_budget": frozenset({"decoder_misbehaves"}),
    "worker.late_finish": frozenset({"decoder_misbehaves"}),
    "worker.missing_logprob": frozenset(),  # the fake decoder always sends a record
    # A Resend crossing the end of an output it cannot keep (cancelled, failed, a lost
    # process); one for a completed output is judged exactly, by _check_resend.
    "worker.resend_unknown": DECODER_FAULTS | {"crash", "drain", "client_cancel", "attempt_lost"},
    # The router sends each assignment's offer once: a second copy needs the network.
    "worker.duplicate_offer": frozenset({"duplicate", "replay"}),
    # An offer landing after its own cancel: the Cancel overtook it (or a stall held both).
    "worker.offer_after_cancel": REORDERING,
    "worker.late_cancel": REORDERING | {"attempt_lost", "client_cancel"},
    # Each router's messages travel on its own link and name its own assignments.
    "worker.foreign_assignment": frozenset(),
}


class Disturbances:
    """Every disturbance the run caused, per worker, as [start, end] intervals.

    An interval may be opened before its end is known (a drain lasts until the
    process exits); `close` sets the end. `grace_s` is how long after an
    interval its consequences may still surface.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.kinds: set[str] = set()  # every kind that struck anywhere in the run
        self._intervals: dict[str, list[list[float | str]]] = {}
        self._quiet_after: dict[str, float] = {}  # latest end of an interval begun so far
        self.delay_max_s = 0.0  # the seed's largest network delay (the simulator sets it)
        self.slow: frozenset[str] = frozenset()  # workers the swarm made decode slower

    def add(self, worker_id: str, kind: str, start: float, end: float) -> list[float | str]:
        interval: list[float | str] = [start, end, kind]
        self._intervals.setdefault(worker_id, []).append(interval)
        self.kinds.add(kind)
        self._quiet_after[worker_id] = max(self._quiet_after.get(worker_id, -math.inf), end)
        return interval

    def extend(self, worker_id: str, interval: list[float | str], end: float) -> None:
        """A disturbance still going on: its interval now lasts until `end`."""
        interval[1] = max(float(interval[1]), end)
        self._quiet_after[worker_id] = max(self._quiet_after.get(worker_id, -math.inf), end)

    def close(self, worker_id: str, interval: list[float | str], end: float) -> None:
        interval[1] = end
        ends = (float(i[1]) for i in self._intervals[worker_id])
        self._quiet_after[worker_id] = max(ends, default=-math.inf)

    def intervals(self) -> dict[str, list[tuple[float, float, str]]]:
        """Every interval so far, per worker: (start, end, kind)."""
        return {
            w: [(float(s), float(e), str(k)) for s, e, k in intervals]
            for w, intervals in self._intervals.items()
        }

    def note(self, kind: str) -> None:
        """A kind that struck the whole network rather than one worker (delay spread)."""
        self.kinds.add(kind)

    def explains(
        self, worker_id: str, since: float, until: float, kinds: Iterable[str] | None = None
    ) -> bool:
        """Did a disturbance of this worker (of these kinds) overlap [since, until]?"""
        wanted = None if kinds is None else frozenset(kinds)
        for start, end, kind in self._intervals.get(worker_id, ()):
            if wanted is not None and kind not in wanted:
                continue
            if float(start) <= until and float(end) + self.grace_s >= since:
                return True
        return False

    def covers(self, worker_id: str, since: float, until: float, kinds: Iterable[str]) -> bool:
        """Did disturbances of this worker of these kinds last through all of [since, until]
        (one after another, overlapping or touching)?"""
        wanted = frozenset(kinds)
        reached = since
        for start, end, kind in sorted(
            (float(i[0]), float(i[1]), i[2]) for i in self._intervals.get(worker_id, ())
        ):
            if kind in wanted and start <= reached:
                reached = max(reached, end)
        return reached >= until

    def quiet_since(self, worker_id: str) -> float:
        """When the worker's last disturbance so far ended (-inf: never disturbed)."""
        return self._quiet_after.get(worker_id, -math.inf)
