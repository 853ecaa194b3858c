"""What a seed draws before its run starts: the shape, the swarm, the router faults, the prompts.

A Scenario is the shape of a run (workers, clients, phases, the router's
config); `Scenario.for_seed` swaps in the long run or a shared-workers run
where the standard mix (STANDARD) puts one. `draw_swarm` draws one seed's
fault mix from the `{seed}/swarm` stream, `draw_router_faults` a
shared-workers run's router crashes from `{seed}/routers`, and `draw_prompt`
one client's prompt from `{seed}/clients`. The actuators that carry the
faults out are sim/faults.py's (worker and router processes) and
sim/network.py's (packets); sim/disturbances.py says which fence each kind
may move and which losses it explains.

The reproducibility contract: a seed keeps its trace only while every draw
it makes stays where it was. So FAULT_KINDS is append-only: `draw_swarm`
draws one switch per kind in the tuple's order, then the rates and counts;
a new kind goes at the end of the tuple, and anything new the swarm draws
goes after every draw already made (Swarm's later fields say which came when),
or in a random stream of its own (`{seed}/routers`, `{seed}/finish`,
`{seed}/logprobs`). Reordering, removing or inserting a kind in the middle
changes every seed's swarm, and with it every trace digest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from random import Random

from core.config import RouterConfig
from core.fake_model import VOCAB

# Append only (see the module docstring): a seed draws one switch per kind, in this order.
FAULT_KINDS = (
    "delay_spread",  # wide per-message delays: heavy reordering
    "duplicate",
    "loss",
    "late",  # an occasional message held back for seconds
    "replay",  # an old message sent again later
    "partition",  # one-way or two-way, heals
    "crash",  # worker process dies, restarts at a new epoch
    "stall",  # worker stops (no heartbeats, no decoding), resumes same epoch
    "slow",  # some workers decode several times slower
    "decoder_failure",  # a worker's decoder breaks: its assignments fail
    "client_cancel",  # clients cancel or disconnect at random moments
    # Drawn after the kinds above, so that adding them left those draws as they were:
    "drain",  # a worker drains, exits once idle, and restarts at a new epoch
    "decoder_misbehaves",  # for a while a decoder repeats, skips or overruns indices
    "blackout",  # the router loses every worker at once, both ways, then heals
    "decoder_hang",  # a decoder stops producing while its worker heartbeats on
    "impostor",  # a second process registers under a live worker's id
    "future_epoch",  # a heartbeat names an epoch the router never handed out
)


@dataclass(frozen=True)
class Scenario:
    """The shape of a run; the seed fills in everything else."""

    workers: int = 3
    requests: int = 20
    mean_new_tokens: int = 50
    arrival_window_s: float = 6.0
    fault_end_s: float = 12.0
    liveness_budget_s: float = 60.0
    heartbeat_interval_s: float = 0.25
    router: RouterConfig = field(
        default_factory=lambda: RouterConfig(
            offer_timeout_s=0.5,
            heartbeat_timeout_s=1.0,
            max_attempts=4,
            queue_limit=64,
            # Above the slowest healthy simulated worker: 8x slow, 4 decodes and a
            # prefill chunk of 99 tokens in one step take about 1.9 s; prefill in
            # chunks of 4 behind three other prompts, about 0.35 s per token.
            first_token_timeout_s=3.0,
            prefill_timeout_per_token_s=0.5,
            token_timeout_s=3.0,
            stuck_probe_s=2.0,
            # Under the heartbeat timeout, so that a healthy worker's report can be
            # too old to trust (two heartbeats lost or late), and placement must see it.
            cache_report_max_age_s=0.6,
        )
    )
    # Every Nth seed (N-1, 2N-1, ...) runs the long-run shape instead (0: never).
    long_run_every: int = 0
    routers: int = 1  # routers sharing the workers
    # Every Nth seed (N-2, 2N-2, ...) runs two or three routers instead (0: never).
    shared_every: int = 0

    def for_seed(self, seed: int) -> Scenario:
        """The shape this seed runs: this one, or the long run or shared-workers run the
        mix puts in its place."""
        every = self.long_run_every
        if every and seed % every == every - 1:
            return replace(self, **LONG_RUN, long_run_every=0, shared_every=0)  # type: ignore[arg-type]
        every = self.shared_every
        if every and seed % every == every - 2:
            routers = 2 + (seed // every) % 2
            # Half again as many clients: the routers' offers must compete for slots.
            requests = self.requests * 3 // 2
            return replace(
                self, routers=routers, requests=requests, long_run_every=0, shared_every=0
            )
        return self


# The long run: two workers each finishing hundreds of assignments, faults all along,
# so that bounded tables (a worker keeps its last 256 outputs) overflow.
LONG_RUN = {"workers": 2, "requests": 700, "arrival_window_s": 100.0, "fault_end_s": 100.0}

# The standard sweep: the default shape, with long runs and shared-workers runs mixed in.
STANDARD = Scenario(long_run_every=40, shared_every=4)


@dataclass(frozen=True)
class Swarm:
    """The fault mix one seed drew: kinds switched on and their rates."""

    enabled: frozenset[str]
    delay_min_s: float
    delay_max_s: float
    duplicate_rate: float
    loss_rate: float
    late_rate: float
    replay_rate: float
    cancel_rate: float
    partitions: int
    crashes: int
    stalls: int
    decoder_failures: int
    slowness: tuple[float, ...]
    slots: tuple[int, ...]
    step_s: float
    prefill_s_per_token: float
    crash_notice_s: float | None  # the transport reports a crash this much later, or never
    drains: int
    misbehaving_decoders: int
    blackouts: int
    hangs: int
    impostors: int
    future_epochs: int
    max_prefill_tokens: int  # the fake decoders' batching limits (core.batching)
    # Drawn after the rest: a drain hands its streams off (most seeds) or lets them
    # finish; and some seeds restart every worker in turn, under load (a rollout).
    drain_handoff: bool = True
    rolling_restart: bool = False
    # Drawn after those: each worker's KV pool as a share of one where every slot's
    # largest request fits at once (1.0); below that, the scheduler preempts by
    # recompute when a step's growth finds the pool out (core/scheduler.py).
    pool_share: tuple[float, ...] = ()
    # Drawn after those: finished outputs whose Finished dies with its worker, so that
    # a continuation with every token delivered runs, and its acceptance is held back
    # until its Finished has overtaken it (the `finish_lost` fault; its times come from
    # their own random stream).
    finish_losses: int = 0
    # Drawn after those: the fake decoders speculate, each guess right with this
    # probability (0: they decode a token a step), so runs of several tokens come out
    # of one step (sim/decoders.py; its draws have their own random stream).
    speculation: float = 0.0


def draw_swarm(rng: Random, scenario: Scenario) -> Swarm:
    enabled = frozenset(kind for kind in FAULT_KINDS if rng.random() < 0.5)

    def rate(kind: str, top: float) -> float:
        # An enabled kind sometimes still draws zero: rare combinations get explored.
        return 0.0 if kind not in enabled or rng.random() < 0.1 else rng.uniform(0.0, top)

    def count(kind: str, top: int) -> int:
        return rng.randint(1, top) if kind in enabled else 0

    spread = "delay_spread" in enabled
    n = scenario.workers
    return Swarm(
        enabled=enabled,
        delay_min_s=0.0005,
        delay_max_s=rng.uniform(0.02, 0.3) if spread else 0.002,
        duplicate_rate=rate("duplicate", 0.2),
        loss_rate=rate("loss", 0.01),
        late_rate=rate("late", 0.05),
        replay_rate=rate("replay", 0.05),
        cancel_rate=rate("client_cancel", 0.4),
        partitions=count("partition", 3),
        crashes=count("crash", 2),
        stalls=count("stall", 2),
        decoder_failures=count("decoder_failure", 1),
        slowness=tuple(
            rng.choice((1.0, 1.0, 3.0, 8.0)) if "slow" in enabled else 1.0 for _ in range(n)
        ),
        slots=tuple(rng.randint(1, 4) for _ in range(n)),
        step_s=rng.uniform(0.005, 0.03),
        prefill_s_per_token=rng.uniform(0.0001, 0.002),
        # Drawn last so that adding it left every earlier draw (and old seeds) as it was.
        crash_notice_s=rng.uniform(0.0, 0.5) if rng.random() < 0.5 else None,
        drains=count("drain", 2),
        misbehaving_decoders=count("decoder_misbehaves", 2),
        blackouts=count("blackout", 1),
        max_prefill_tokens=rng.choice((4, 16, 128)),
        hangs=count("decoder_hang", 2),
        impostors=count("impostor", 2),
        future_epochs=count("future_epoch", 2),
        drain_handoff=rng.random() < 0.8,
        rolling_restart=rng.random() < 0.15,
        pool_share=_pool_shares(rng, n),
        finish_losses=rng.randint(1, 2) if rng.random() < 0.25 else 0,
        speculation=rng.uniform(0.2, 0.95) if rng.random() < 0.4 else 0.0,
    )


def _pool_shares(rng: Random, workers: int) -> tuple[float, ...]:
    if rng.random() < 0.5:
        return (1.0,) * workers
    return tuple(rng.uniform(0.05, 0.7) for _ in range(workers))


@dataclass(frozen=True)
class RouterFaults:
    """A shared-workers run's router crashes (drawn from their own random stream)."""

    crashes: tuple[tuple[float, int, float], ...]  # (when, which router, downtime)
    notice_max_s: float  # each worker sees the link close within this
    client_retry_max_s: float  # a cut client sends again within this


def draw_router_faults(rng: Random, scenario: Scenario) -> RouterFaults:
    if scenario.routers < 2 or rng.random() < 0.25:  # some shared runs have no crash
        return RouterFaults((), 0.0, 0.0)
    window = scenario.fault_end_s
    crashes = tuple(
        (rng.uniform(0.5, window), rng.randrange(scenario.routers), rng.uniform(0.1, 2.0))
        for _ in range(rng.randint(1, 2))
    )
    return RouterFaults(tuple(sorted(crashes)), rng.uniform(0.0, 0.5), rng.uniform(0.05, 0.5))


KV_BLOCK = 4  # the simulated workers' KV block size (tokens)
SYSTEM_PROMPTS = (tuple(range(100, 112)), tuple(range(200, 208)))  # 3 and 2 blocks
MIDDLES = (tuple(range(300, 308)), tuple(range(400, 412)))
LONGEST_PROMPT = 24 + max(map(len, SYSTEM_PROMPTS)) + max(map(len, MIDDLES))


def draw_prompt(rng: Random) -> tuple[int, ...]:
    """Half the prompts are unique; the rest repeat themselves as chat traffic does:
    one of two system prompts, then often one of a few shared middles (the
    same tokens after either system prompt, so only a chain key that covers
    the parent tells them apart), then a short tail of their own."""
    tail = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 24)))
    if rng.random() < 0.5:
        return tail
    head = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
    if rng.random() < 0.6:
        head += MIDDLES[rng.randrange(len(MIDDLES))]
    return head + tail[: rng.randint(1, 6)]
