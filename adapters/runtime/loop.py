"""Two trio building blocks the runtime is made of: Mailbox and Timers.

A Mailbox is a bounded FIFO whose producers never wait: put() either takes the
item or says no at once, so a peer that cannot keep up is noticed (and dropped)
instead of growing memory or stalling whoever produces. Its one consumer takes
everything queued in one batch, which keeps task switches per message low.

Timers carries out the machines' ArmTimer and DisarmTimer effects: one task
sleeps until the earliest deadline; arming a key again replaces its deadline.

Serial hands events to a machine one at a time. Carrying out one event's
effects can produce another event for the same machine (a full send queue
becomes WorkerGone); Serial queues it and handles it after the current one,
so a machine is never re-entered and effects run in the order returned.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import trio

T = TypeVar("T")
E = TypeVar("E")


class Serial(Generic[E]):
    def __init__(self, step: Callable[[E], None]) -> None:
        self._step = step
        self._pending: deque[E] = deque()
        self._running = False

    def __call__(self, event: E) -> None:
        self._pending.append(event)
        if self._running:
            return  # the loop below is running further up this call stack
        self._running = True
        try:
            while self._pending:
                self._step(self._pending.popleft())
        finally:
            self._running = False


class Mailbox(Generic[T]):
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a mailbox holds at least one item")
        self.limit = limit
        self._items: deque[T] = deque()
        self._lot = trio.lowlevel.ParkingLot()
        self._drained = trio.lowlevel.ParkingLot()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> bool:
        """Queue an item; False (and nothing queued) when full or closed."""
        if self.closed or len(self._items) >= self.limit:
            return False
        self._items.append(item)
        self._lot.unpark_all()
        return True

    async def take(self) -> list[T]:
        """Everything queued, waiting for at least one item; EndOfChannel once closed."""
        while not self._items:
            if self.closed:
                raise trio.EndOfChannel
            await self._lot.park()
        batch = list(self._items)
        self._items.clear()
        self._drained.unpark_all()
        return batch

    async def wait_below(self, count: int) -> None:
        """Wait until fewer than `count` items are queued (a producer's pacing)."""
        while len(self._items) >= count and not self.closed:
            await self._drained.park()

    def close(self) -> None:
        """Take nothing more; the consumer gets what is queued, then EndOfChannel."""
        self.closed = True
        self._lot.unpark_all()
        self._drained.unpark_all()


class Timers:
    """Deadlines on the trio clock for keys; `on_fire(key)` runs when one is due."""

    def __init__(self, on_fire: Callable[[Hashable], None]) -> None:
        self._on_fire = on_fire
        self._armed: dict[Hashable, int] = {}  # key -> sequence number of its live entry
        self._heap: list[tuple[float, int, Hashable]] = []
        self._sequence = 0
        self._scope: trio.CancelScope | None = None

    def __len__(self) -> int:
        return len(self._armed)

    def arm(self, key: Hashable, deadline: float) -> None:
        self._sequence += 1
        self._armed[key] = self._sequence
        heapq.heappush(self._heap, (deadline, self._sequence, key))
        if self._scope is not None and deadline < self._scope.deadline:
            self._scope.deadline = deadline

    def disarm(self, key: Hashable) -> None:
        self._armed.pop(key, None)  # its heap entry is skipped when it comes up

    async def run(self) -> None:
        while True:
            while self._heap and self._armed.get(self._heap[0][2]) != self._heap[0][1]:
                heapq.heappop(self._heap)  # disarmed or re-armed since
            deadline = self._heap[0][0] if self._heap else math.inf
            with trio.CancelScope(deadline=deadline) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                _, sequence, key = heapq.heappop(self._heap)
                if self._armed.get(key) == sequence:
                    del self._armed[key]
                    self._on_fire(key)
