"""Virtual time and the one queue of everything that happens in it.

The simulator and the cluster it drives share one Clock: clients arriving,
packets landing, decoder steps, faults, and the machines' timers are all
entries of one heap, and `now` moves only when the next entry runs. Nothing
here reads a wall clock.

Order: entries run by time. At equal times, timers run before anything else
(a timer set for t has expired by the time anything else at t happens),
timers among themselves by the rank their owner gives them, and other
entries in the order they were scheduled. When the next entry is a timer,
every timer due at that same moment runs in the same turn: the machines see
expiries at one instant together, before the world moves on.

Timers can be disarmed or re-armed, which a heap cannot do in place: each
timer entry carries a `live` check, and one that is no longer live (disarmed,
re-armed since, or its owner gone or stalled) is dropped when it reaches the
head instead of running. Timers keeps every machine's timers on one Clock
that way: the cluster (sim/cluster.py) arms and disarms them as the machines'
effects say, and hears each that fires.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container
from dataclasses import dataclass
from functools import partial

from core.protocol import TimerKey

Action = Callable[..., None]
Live = Callable[[], bool]
# (time, 0 for a timer / 1 for anything else, rank, order, live check or None, action, args)
Entry = tuple[float, int, tuple[int, int], int, Live | None, Action, tuple[object, ...]]


class Clock:
    __slots__ = ("_heap", "_order", "now")

    def __init__(self) -> None:
        self.now = 0.0
        # (time, 0 for timers / 1 for the rest, rank, order, live or None, action, args)
        self._heap: list[
            tuple[
                float,
                int,
                tuple[int, int],
                int,
                Callable[[], bool] | None,
                Action,
                tuple[object, ...],
            ]
        ] = []
        self._order = 0

    def schedule(self, time: float, action: Action, *args: object) -> None:
        """Run action(*args) at `time` (or now, if that has passed)."""
        self._order += 1
        heapq.heappush(self._heap, (time, 1, (0, 0), self._order, None, action, args))

    def schedule_timer(self, time: float, rank: tuple[int, int], live: Live, fire: Action) -> None:
        """A timer: fire() at `time` if live() still holds then."""
        self._order += 1
        heapq.heappush(self._heap, (time, 0, rank, self._order, live, fire, ()))

    def next_time(self) -> float | None:
        """When the next entry runs, or None if nothing is scheduled."""
        self._drop_dead_timers()
        return self._heap[0][0] if self._heap else None

    def run_next(self) -> None:
        """Run the next entry; if it is a timer, every other timer due then too."""
        self._drop_dead_timers()
        time, kind, _, _, _, action, args = heapq.heappop(self._heap)
        self.now = max(self.now, time)
        action(*args)
        if kind == 0:
            while self.next_time() == time and self._heap[0][1] == 0:
                heapq.heappop(self._heap)[5]()

    def run_until(self, until: float) -> None:
        """Run everything scheduled up to `until`, in order; then the time is `until`."""
        while (at := self.next_time()) is not None and at <= until:
            self.run_next()
        self.now = max(self.now, until)

    def _drop_dead_timers(self) -> None:
        heap = self._heap
        while heap and (live := heap[0][4]) is not None and not live():
            heapq.heappop(heap)


Owner = str  # a worker id, or "@" + a router id: whose timer it is


@dataclass(slots=True)
class _Armed:
    """One armed timer of one machine."""

    deadline: float
    arm: int  # which arming this is: a clock entry of an older arming is stale
    rank: int  # the key's place among its owner's timers; kept when re-armed


class Timers:
    """Every machine's armed timers, as entries on one Clock.

    An owner's rank is the order it was first seen in (a lone cluster's router
    first, then its workers); a key's rank among its owner's timers is the arming that first
    set it, kept when it is re-armed. A paused owner's timers are not live: they
    are armed again when it resumes."""

    def __init__(
        self,
        clock: Clock,
        fire: Callable[[Owner, TimerKey], None],
        paused: Container[Owner],
    ) -> None:
        self.clock = clock
        self._fire_to = fire  # the owner's machine handles the expiry
        self._paused = paused
        self._timers: dict[Owner, dict[TimerKey, _Armed]] = {}
        self._owner_rank: dict[Owner, int] = {}
        self._arms = 0

    def add_owner(self, owner: Owner) -> None:
        """A machine (a new process, or a new incarnation) starts with no timers."""
        self._timers[owner] = {}
        self._owner_rank.setdefault(owner, len(self._owner_rank))

    def clear(self, owner: Owner) -> None:
        """The machine is gone: its timers with it."""
        self._timers[owner] = {}

    def arm(self, owner: Owner, key: TimerKey, deadline: float) -> None:
        """(Re-)arm a machine's timer; an entry for an earlier arming goes stale."""
        timers = self._timers[owner]
        current = timers.get(key)
        self._arms += 1
        rank = current.rank if current is not None else self._arms
        timers[key] = _Armed(deadline, self._arms, rank)
        self.clock.schedule_timer(
            deadline,
            (self._owner_rank[owner], rank),
            partial(self._live, owner, key, self._arms),
            partial(self._fire, owner, key),
        )

    def disarm(self, owner: Owner, key: TimerKey) -> None:
        self._timers[owner].pop(key, None)

    def resume(self, owner: Owner, now: float) -> None:
        """The owner's stall ends: timers that came due meanwhile fire now, the rest
        when due."""
        for key, armed in list(self._timers[owner].items()):
            self.arm(owner, key, max(armed.deadline, now))

    def _live(self, owner: Owner, key: TimerKey, arm: int) -> bool:
        if owner in self._paused:
            return False  # armed again when it resumes
        armed = self._timers[owner].get(key)
        return armed is not None and armed.arm == arm

    def _fire(self, owner: Owner, key: TimerKey) -> None:
        del self._timers[owner][key]
        self._fire_to(owner, key)
