"""`fencepost sim`: run one seed (optionally traced) or sweep many, and report.

The report is this module's: timing and printing live here, since sim/ never
reads a clock. The simulator is imported inside `run`, so building the
command line (for `fencepost serve`, say) never loads it; for the same reason
--workers and --requests default to None here, which `run` reads as the
Scenario's own defaults.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from adapters.cli import natural, positive

if TYPE_CHECKING:
    from sim.scenario import Scenario
    from sim.simulator import SimResult, Simulation
    from sim.sweep import SweepSummary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=natural, help="run this one root seed")
    which.add_argument("--seeds", type=positive, metavar="COUNT", help="sweep COUNT seeds")
    parser.add_argument("--start", type=natural, default=0, help="first seed of a sweep")
    parser.add_argument("--trace", action="store_true", help="print every event of the run")
    parser.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        default=None,
        help="with --seed: write the run as a timeline, one self-contained HTML file "
        "(lanes for clients, routers and workers; messages, faults, the violation)",
    )
    parser.add_argument("--workers", type=positive, default=None)
    parser.add_argument("--requests", type=positive, default=None)
    parser.add_argument(
        "--routers",
        type=positive,
        default=None,
        help="routers sharing the workers, for every seed (default: the standard mix, "
        "where every 4th seed runs two or three)",
    )
    parser.add_argument(
        "--coverage",
        action="store_true",
        help="after a sweep, list every move of every machine table with its count",
    )
    parser.add_argument(
        "--determinism-every",
        type=positive,
        default=50,
        help="run every Nth seed of a sweep twice and compare trace hashes",
    )


def run(args: argparse.Namespace) -> int:
    from sim.scenario import STANDARD, Scenario

    scenario = STANDARD  # the default shape with long runs and shared-workers runs mixed in
    if args.workers or args.requests or args.routers:  # a shape of its own: no mix
        scenario = Scenario(
            workers=args.workers or Scenario.workers,
            requests=args.requests or Scenario.requests,
            routers=args.routers or 1,
        )
    if args.seed is not None:
        return run_one(args.seed, scenario, args.trace, args.html)
    if args.html is not None:
        print("fencepost sim: --html draws one run: give --seed, not --seeds")
        return 2
    return run_sweep(args.start, args.seeds, scenario, args.determinism_every, args.coverage)


def run_one(seed: int, scenario: Scenario, trace: bool, html: Path | None = None) -> int:
    from sim.simulator import Simulation
    from sim.timeline import Timeline

    print(f"root seed {seed}")
    timeline = Timeline() if html is not None else None
    simulation = Simulation(seed, scenario, trace=trace, echo=trace, timeline=timeline)
    print(f"swarm: {_swarm_line(simulation)}")
    result = simulation.run()
    _print_result_line(result)
    if timeline is not None and html is not None:
        from adapters.cli import timeline as page

        size = page.write(timeline.data(), html)
        print(f"timeline: {html} ({size / 1e6:.1f} MB; open it in a browser)")
    if not result.ok:
        _print_failure(result, scenario, show_tail=not trace)
        return 1
    return 0


def run_sweep(
    start: int, count: int, scenario: Scenario, determinism_every: int, coverage: bool = False
) -> int:
    from sim.scenario import LONG_RUN
    from sim.sweep import SweepSummary, sweep

    print(f"root seeds {start}..{start + count - 1} ({count} runs)")
    print(
        f"scenario: {scenario.workers} workers, {scenario.requests} requests of about "
        f"{scenario.mean_new_tokens} tokens, faults until t={scenario.fault_end_s}s"
        + (f", {scenario.routers} routers sharing the workers" if scenario.routers > 1 else "")
    )
    if scenario.long_run_every:
        print(
            f"  every {scenario.long_run_every}th seed a long run instead: "
            f"{LONG_RUN['workers']} workers, {LONG_RUN['requests']} requests over "
            f"{LONG_RUN['arrival_window_s']:.0f}s, faults until t={LONG_RUN['fault_end_s']:.0f}s"
        )
    if scenario.shared_every:
        print(
            f"  every {scenario.shared_every}th seed (from seed {scenario.shared_every - 2}) "
            "two or three routers share the workers, and routers crash and restart"
        )
    began = time.perf_counter()
    summary = SweepSummary()
    for progress in sweep(start, count, scenario, determinism_every):
        summary = progress
    elapsed = time.perf_counter() - began
    _print_summary(summary, elapsed)
    if coverage:
        _print_coverage(summary)
    if summary.failure is not None:
        _print_failure(summary.failure, scenario, show_tail=True)
        return 1
    return 0


def _swarm_line(simulation: Simulation) -> str:
    swarm = simulation.swarm
    kinds = ", ".join(sorted(swarm.enabled)) or "no faults"
    return f"{kinds}; slots {list(swarm.slots)}; slowness {list(swarm.slowness)}"


def _print_result_line(result: SimResult) -> None:
    print(
        f"seed {result.seed}: {'ok' if result.ok else 'FAILED'}; {result.requests} requests, "
        f"{result.tokens_delivered} tokens delivered, {result.events} events, "
        f"virtual time {result.virtual_time_s:.2f}s"
    )
    print(
        f"  outcomes: {_counts(result.outcomes)}; streams resumed: {result.resumes}; "
        f"handed off by draining workers: {result.handoffs[0]} ({result.handoffs[1]} back); "
        f"preempted: {result.preemptions[0]} ({result.preemptions[1]} tokens recomputed)"
    )
    checks, guessed, accepted = result.speculation
    if checks:
        print(
            f"  decoders speculated: {checks} verifications, {accepted} of {guessed} "
            f"guesses accepted"
        )
    if result.routers > 1:
        print(
            f"  {result.routers} routers share the workers; offers declined for want of "
            f"a slot: {result.full_declines}; requests sent again after their router died: "
            f"{result.client_retries}"
        )
    print(f"  faults injected: {_counts(result.faults)}")
    print(f"  messages fenced: {_counts(result.fenced)}")


def _print_summary(summary: SweepSummary, elapsed_s: float) -> None:
    rate = summary.runs / elapsed_s if elapsed_s > 0 else float("inf")
    failed = 1 if summary.failure is not None else 0
    print(f"runs {summary.runs}, failed {failed}")
    print(f"requests {summary.requests}, tokens delivered {summary.tokens_delivered}")
    print(f"events {summary.events}")
    print(f"outcomes: {_counts(summary.outcomes)}")
    print(f"streams resumed after their first token: {summary.resumes}")
    print(
        f"streams handed off by draining workers: {summary.handoffs} ({summary.handoffs_back} "
        f"went back when the continuation failed); rolling restarts: {summary.rolling_runs} runs"
    )
    print(
        f"runs with routers sharing the workers: {summary.shared_runs}; offers declined for "
        f"want of a slot: {summary.full_declines}; requests sent again after their router "
        f"died: {summary.client_retries}"
    )
    print(f"attempts given up and explained by a fault on their worker: {summary.attempts_lost}")
    print(f"errors by cause: {_counts(summary.errors)}")
    print(f"faults injected by kind: {_counts(summary.faults)}")
    print(f"messages fenced by kind: {_counts(summary.fenced)}")
    print(f"work the router no longer wanted, kept by workers: {summary.waste_s:.1f} slot-s")
    print(f"most outputs completed by one worker process: {summary.most_completed}")
    submitted, computed = summary.prefill_submitted, summary.prefill_computed
    print(
        f"prefill tokens: {submitted} admitted, {computed} computed "
        f"({1 - computed / max(1, submitted):.0%} found in the prefix caches)"
    )
    print(
        f"preempted by recompute: {summary.preemptions} sequences in "
        f"{summary.preempting_runs} runs ({summary.preempting_runs / max(1, summary.runs):.0%}), "
        f"{summary.recomputed_tokens} output tokens computed again"
    )
    print(
        f"speculating decoders: {summary.speculating_runs} runs, {summary.verifications} "
        f"verifications, {summary.guesses_accepted} of {summary.guessed} guesses accepted "
        f"(each a token that came out in a run from one step)"
    )
    never = summary.coverage.never_taken()
    print(f"machine moves taken: {summary.coverage.summary()}")
    print(f"moves never taken: {', '.join('/'.join(m) for m in never) or 'none'}")
    print(f"determinism: {summary.determinism_checked} seeds ran twice, trace hashes compared")
    print(f"seeds per second: {rate:.1f} ({rate * 60:.0f} per minute, one core)")


def _print_coverage(summary: SweepSummary) -> None:
    from sim.coverage import UNREACHABLE

    print("coverage (table: state --event--> next: times taken):")
    for table, state, event, nxt, n in summary.coverage.rows():
        why = UNREACHABLE.get((table, state, event))
        note = f"  (unreachable: {why})" if why else ""
        print(f"  {table}: {state} --{event}--> {nxt}: {n}{note}")


def _print_failure(result: SimResult, scenario: Scenario, show_tail: bool) -> None:
    from sim.sweep import replay_command

    print(f"VIOLATION at seed {result.seed}: {result.violation}")
    if show_tail and result.trace_tail:
        print("last trace lines:")
        for line in result.trace_tail:
            print(f"  {line}")
    print(f"replay: {replay_command(result.seed, scenario)}")


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"
