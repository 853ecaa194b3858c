"""Which moves of the machines' tables a sweep took, and which it never did.

Every state machine in core is a table (core/states.py); a move the
simulator never makes is a blind spot, whatever its oracles say. While a
Coverage is attached, each table counts the moves taken (`Table.recorder`);
the report lists every move with its count. Moves that no run can take are
listed in UNREACHABLE with the reason, and the test suite checks that the
standard sweep takes every other move.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from core.states import TABLES
from sim.scenario import STANDARD

_RETIRED = (
    "handing out a new epoch retires all the id's older ones at once (core/fleet.py register), "
    "so a new epoch's heartbeat always finds the worker gone; the move stays in the "
    "table for workers that heartbeat without registering (the router unit tests)"
)

# (table, state, event) -> why the standard sweep cannot be expected to take that move.
UNREACHABLE: dict[tuple[str, str, str], str] = {
    ("assignment", "active", "decoded"): (
        "the worker's one self-loop, not looked up per token (core/worker.py)"
    ),
    # (healthy -> new_epoch is reachable: a worker that exits while a registration's
    # answer is on its way leaves that epoch live at the router, whose next registration
    # of the id is refused until it falls silent, and a takeover or a heartbeat of a
    # newer epoch meets it healthy; rolling restarts do that, seed 226 of the sweep.)
    ("worker health", "stuck", "new_epoch"): _RETIRED,
    ("worker health", "silent", "new_epoch"): _RETIRED,
    ("slot hold", "missing", "listed"): (
        "a worker lists an assignment in every heartbeat from its take to its end and never "
        "after, and a heartbeat sent before the take is not read as leaving it out (the "
        "OfferResult, the attempt's first Token or a TokenRun from it say after which "
        "heartbeat it was taken), so a hold gone missing is never listed again; the sweeps "
        "took it only through that gap, closed by regression seeds 4292 and 7605 (none in "
        "seeds 0-2999 since). The move stays for a worker that lists again what it left "
        "out, a bug the mutant 'draining worker leaves the streams it hands off out of its "
        "heartbeats' plants"
    ),
    ("sequence", "waiting", "refused"): (
        "a worker declines an offer longer than its max_context before its decoder sees "
        "it, and every simulated pool holds the largest request, so no sequence that can "
        "never fit reaches a scheduler; the engine's tests refuse one "
        "(tests/core/test_scheduler.py)"
    ),
    ("worker health", "silent", "deadline_missed"): (
        "the liveness timer is armed only by a heartbeat, which also makes the worker "
        "healthy, so it never fires on a worker already silent"
    ),
}


# (table, state, event) -> (a seed of the standard mix that takes the move, why it is
# rare): reachable, but too seldom for the default sweep of seeds 0-499 to be sure of it,
# so tests/sim/test_simulation.py runs that seed on its own. A change to the simulator that
# moves the seed's run elsewhere fails that test: find another (sim/coverage.py has
# `seeds_taking`) and write it here.
RARE: dict[tuple[str, str, str], tuple[int, str]] = {
    ("worker health", "healthy", "new_epoch"): (
        5914,
        "a worker that exits while a registration's answer is on its way leaves that epoch "
        "live at the router, and a heartbeat of a newer epoch then meets it healthy; "
        "about one seed in 6,000 since the workers' pools can preempt (issue 34)",
    ),
}


def seeds_taking(move: tuple[str, str, str], seeds: range) -> list[int]:
    """The seeds of the standard mix among `seeds` whose run takes this move."""
    from sim.simulator import Simulation  # the simulator imports nothing of this

    found = []
    table, state, event = move
    for seed in seeds:
        coverage = Coverage()
        coverage.attach()
        try:
            Simulation(seed, STANDARD).run()
        finally:
            coverage.detach()
        if coverage.counts[table][state, event]:
            found.append(seed)
    return found


@dataclass
class Coverage:
    """Move counts per table, gathered while attached."""

    counts: dict[str, Counter[tuple[str, str]]] = field(
        default_factory=lambda: {table.name: Counter() for table in TABLES}
    )
    _live: dict[str, Counter] = field(default_factory=dict)  # type: ignore[type-arg]

    def attach(self) -> None:
        for table in TABLES:
            recorder: Counter = Counter()  # type: ignore[type-arg]
            self._live[table.name] = recorder
            table.recorder = recorder

    def detach(self) -> None:
        for table in TABLES:
            table.recorder = None
            for (state, event), n in self._live.pop(table.name, Counter()).items():
                self.counts[table.name][state.value, event.value] += n

    def rows(self) -> list[tuple[str, str, str, str, int]]:
        """(table, state, event, next state, times taken) for every move of every table."""
        return [
            (table.name, state.value, event.value, nxt.value,
             self.counts[table.name][state.value, event.value])
            for table in TABLES
            for state, event, nxt in table.pairs()
        ]  # fmt: skip

    def never_taken(self) -> list[tuple[str, str, str]]:
        """Moves no run took, the known-unreachable ones left out."""
        return [
            (table, state, event)
            for table, state, event, _, n in self.rows()
            if n == 0 and (table, state, event) not in UNREACHABLE
        ]

    def summary(self) -> str:
        parts = []
        for table in TABLES:
            rows = [r for r in self.rows() if r[0] == table.name]
            taken = sum(1 for r in rows if r[4])
            parts.append(f"{table.name} {taken}/{len(rows)}")
        return ", ".join(parts)
