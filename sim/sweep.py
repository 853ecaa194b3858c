"""Sweeps: many seeds, one summary, the first failure with its replay command.

A sweep runs seeds start, start+1, ... and stops at the first violation. A
sample of seeds (every `determinism_every`-th, and always the first) is run a
second time with tracing on; both traces must hash the same, or the
simulator itself has become nondeterministic, which is reported as a failure
like any other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from sim.coverage import Coverage
from sim.scenario import STANDARD, Scenario
from sim.simulator import SimResult, Simulation


@dataclass
class SweepSummary:
    runs: int = 0
    requests: int = 0
    tokens_delivered: int = 0
    events: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    fenced: Counter[str] = field(default_factory=Counter)
    resumes: int = 0
    shared_runs: int = 0  # runs with several routers sharing the workers
    client_retries: int = 0
    full_declines: int = 0
    handoffs: int = 0
    handoffs_back: int = 0
    rolling_runs: int = 0
    preemptions: int = 0  # sequences the workers' schedulers preempted by recompute
    recomputed_tokens: int = 0  # output tokens those preemptions computed again
    preempting_runs: int = 0  # runs with at least one preemption
    speculating_runs: int = 0  # runs whose decoders speculated
    verifications: int = 0  # a sequence's guesses checked in one step, every run together
    guessed: int = 0
    guesses_accepted: int = 0
    attempts_lost: int = 0
    waste_s: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    most_completed: int = 0
    prefill_submitted: int = 0
    prefill_computed: int = 0
    determinism_checked: int = 0
    failure: SimResult | None = None
    coverage: Coverage = field(default_factory=Coverage)

    def add(self, result: SimResult) -> None:
        self.runs += 1
        self.requests += result.requests
        self.tokens_delivered += result.tokens_delivered
        self.events += result.events
        self.outcomes.update(result.outcomes)
        self.faults.update(result.faults)
        self.fenced.update(result.fenced)
        self.resumes += result.resumes
        self.shared_runs += result.routers > 1
        self.client_retries += result.client_retries
        self.full_declines += result.full_declines
        self.handoffs += result.handoffs[0]
        self.handoffs_back += result.handoffs[1]
        self.rolling_runs += result.faults["rolling_restart"] > 0
        self.preemptions += result.preemptions[0]
        self.recomputed_tokens += result.preemptions[1]
        self.preempting_runs += result.preemptions[0] > 0
        self.speculating_runs += result.speculation[0] > 0
        self.verifications += result.speculation[0]
        self.guessed += result.speculation[1]
        self.guesses_accepted += result.speculation[2]
        self.attempts_lost += result.attempts_lost
        self.waste_s += result.waste_s
        self.errors.update(result.errors)
        self.most_completed = max(self.most_completed, result.most_completed)
        self.prefill_submitted += result.prefill_tokens[0]
        self.prefill_computed += result.prefill_tokens[1]


def replay_command(seed: int, scenario: Scenario | None = None) -> str:
    """The one-line command that reruns a seed with its trace printed."""
    command = f"fencepost sim --seed {seed} --trace"
    if scenario is not None and scenario != STANDARD:
        command += f" --workers {scenario.workers} --requests {scenario.requests}"
        command += f" --routers {scenario.routers}" if scenario.routers > 1 else ""
    return command


def check_determinism(seed: int, scenario: Scenario | None = None) -> str | None:
    """Run a seed twice with full tracing; a message if the trace hashes differ."""
    first = Simulation(seed, scenario, trace=True).run()
    second = Simulation(seed, scenario, trace=True).run()
    if first.trace_hash != second.trace_hash:
        return f"nondeterminism: seed {seed} traced {first.trace_hash} then {second.trace_hash}"
    return None


def sweep(
    start: int, count: int, scenario: Scenario | None = None, determinism_every: int = 50
) -> Iterator[SweepSummary]:
    """Run the seeds; yields the running summary after each seed (for progress)."""
    summary = SweepSummary()
    for seed in range(start, start + count):
        summary.coverage.attach()
        try:
            result = Simulation(seed, scenario).run()
        finally:
            summary.coverage.detach()
        if result.ok and (seed - start) % determinism_every == 0:
            summary.determinism_checked += 1
            problem = check_determinism(seed, scenario)
            if problem is not None:
                result.violation = problem
        summary.add(result)
        if not result.ok:
            # Re-run with tracing to show how it got there (the run is deterministic).
            summary.failure = Simulation(seed, scenario, trace=True).run()
            summary.failure.violation = result.violation
            yield summary
            return
        yield summary
