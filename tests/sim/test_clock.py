"""The simulator's one clock: order of entries, timers' turns, stale timers."""

from __future__ import annotations

from sim.clock import Clock


def test_entries_run_by_time_then_timers_first_then_in_scheduling_order() -> None:
    clock, ran = Clock(), list[str]()
    clock.schedule(2.0, ran.append, "event@2 first")
    clock.schedule(1.0, ran.append, "event@1")
    clock.schedule(2.0, ran.append, "event@2 second")
    clock.schedule_timer(2.0, (1, 5), lambda: True, lambda: ran.append("worker timer@2"))
    clock.schedule_timer(2.0, (0, 9), lambda: True, lambda: ran.append("router timer@2"))
    steps = 0
    while clock.next_time() is not None:
        clock.run_next()
        steps += 1
    assert ran == [
        "event@1",
        "router timer@2",
        "worker timer@2",
        "event@2 first",
        "event@2 second",
    ]
    assert steps == 4  # both timers due at 2.0 ran in one turn
    assert clock.now == 2.0


def test_a_timer_that_is_no_longer_live_never_runs_and_takes_no_turn() -> None:
    clock, ran = Clock(), list[str]()
    live = {"a": False, "b": True}
    clock.schedule_timer(1.0, (0, 1), lambda: live["a"], lambda: ran.append("a"))
    clock.schedule_timer(3.0, (0, 2), lambda: live["b"], lambda: ran.append("b"))
    assert clock.next_time() == 3.0  # the dead one at 1.0 was dropped
    clock.run_until(2.5)
    assert ran == [] and clock.now == 2.5
    clock.run_until(10.0)
    assert ran == ["b"] and clock.now == 10.0


def test_time_never_goes_back() -> None:
    clock, seen = Clock(), list[float]()
    clock.run_until(5.0)
    clock.schedule(1.0, lambda: seen.append(clock.now))  # scheduled in the past: runs now
    clock.run_next()
    assert seen == [5.0]
