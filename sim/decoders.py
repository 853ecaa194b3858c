"""The simulated decoders: each worker process's fake model, scheduler and KV cache, checked.

The cluster (sim/cluster.py) runs the worker machines; their StartDecode and
StopDecode effects land here. Each worker process has a core/scheduler.py
Scheduler over its own paged KV cache (sim/kv.py, the real block manager with
every change checked), exactly as the torch engine has, and each assignment
a FakeDecode of core's fake model. A driver asks for a step's plan (`plan`:
the scheduler grows, preempts, admits and plans a batch) and takes it when
it chooses (`run`): prefill chunks land, each decoding entry emits a token,
and the decoder events go back to the worker machine through the cluster.
A misbehaving step (one of MISBEHAVIOURS) is how the simulator's
decoder_misbehaves fault goes wrong.

Some seeds' decoders speculate (`speculation`: each guess right with the
seed's acceptance, drawn from its own random stream), as the torch engine's
speculative decoding does: a decoding sequence takes blocks for a few guessed
positions (Scheduler.lookahead, never preempting), one pass writes them, the
run of accepted guesses plus the model's own next token comes out as several
tokens of one step, and the blocks of rejected positions go back
(Scheduler.settle). The guesses never change a token: what comes out is the
fake model's next tokens, as plain steps would give them, so the fenced
protocol carries runs of consecutive indices from one step.

The decoders run core's fake model (core/fake_model.py), which is deterministic
and autoregressive like a real one, so every attempt of a greedy or seeded
request, on any worker, produces the same output, and the client's stream
must always be a prefix of reference_output(). A continuation (a request
with an output_prefix) takes the prefix as context and so goes on exactly
where the client is. Unseeded sampling (temperature > 0, no seed) is
modelled as what it is on real hardware: each attempt draws a different
sequence (the attempt number salts the function), so a client sees one
attempt's output, or, after a resume, one attempt's prefix continued by a
later attempt given that prefix.

The checks, each reported into the cluster's violations: every plan keeps
core/batching's promises; the scheduler preempts the newest admission and
puts it at the head of the queue; no sequence starves at the head; a decode
step finds every earlier position written and a table of exactly the blocks
its positions need; the scheduler's tokens are the decoder's output; and at
the end every block is back. A pool out of blocks is reported to the
disturbance ledger as `kv_pressure`, which excuses a slowed worker.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView
from dataclasses import dataclass
from random import Random

from core.batching import BatchLimits, Running, StepPlan
from core.blocks import blocks_for
from core.fake_model import FakeDecode
from core.protocol import (
    Assignment,
    Decoded,
    DecodeDone,
    DecoderEvent,
    GenerationRequest,
    WorkerEvent,
)
from core.scheduler import Scheduler
from core.states import SeqState
from sim.clock import Clock
from sim.disturbances import Disturbances
from sim.kv import KvModel, pool_blocks
from sim.streams import diverges

# How a misbehaving decoder can go wrong in one step (sim/steps.py draws one):
# say a token twice, skip an index, emit a token past the end, or end twice.
MISBEHAVIOURS = ("repeat", "skip", "overrun", "end_twice")
MOST_GUESSES = 4  # a speculating step guesses 1..this many tokens of a sequence


@dataclass(slots=True)
class Speculation:
    """A seed's speculating decoders: each guess is right with `acceptance` (the run
    stops at the first wrong one), drawn from `rng`; the counts are for the sweep."""

    acceptance: float
    rng: Random
    verifications: int = 0  # a sequence's guesses checked in one step
    proposed: int = 0
    accepted: int = 0

    def counts(self) -> tuple[int, int, int]:
        return self.verifications, self.proposed, self.accepted


@dataclass(slots=True)
class Decode:
    """One assignment on a fake decoder: its worker's Scheduler (core/scheduler.py)
    has it waiting for a row and blocks, prefilling or decoding."""

    request: GenerationRequest
    started_at: float
    run: FakeDecode
    key: int  # its name in the scheduler and its plans


class Decoders:
    """Every worker process's decoder, for one cluster."""

    def __init__(
        self,
        clock: Clock,
        run_worker: Callable[[str, WorkerEvent], None],
        violation: Callable[[str], None],
        disturbances: Disturbances | None,
        max_context: int,
        kv_block_size: int,
        largest_request: int,
        speculation: Speculation | None = None,
    ) -> None:
        self.clock = clock
        self.speculation = speculation
        self._run_worker = run_worker  # a decoder event, handled by its worker machine
        self._violation = violation
        self.disturbances = disturbances
        self.max_context = max_context
        self.kv_block_size = kv_block_size
        self.largest_request = largest_request
        self.kv: dict[str, KvModel] = {}  # each process's paged KV cache
        self.schedulers: dict[str, Scheduler] = {}  # each process's, over its cache
        # Each worker id's KV pool as a share of one that never preempts (1: that pool).
        self.pool_share: dict[str, float] = {}
        self.preemptions = 0  # sequences preempted by recompute, every process together
        self.recomputed_tokens = 0  # output tokens computed again after a preemption
        self._head_wait: dict[str, tuple[int, int]] = {}  # worker -> (head key, steps)
        self._pressure: dict[str, list[float | str]] = {}  # worker -> its latest interval
        self._admitted: dict[str, dict[int, None]] = {}  # worker -> running keys, in order
        self.prefill_tokens = [0, 0]  # context tokens admitted, and of them not cached
        self.decodes: dict[str, dict[Assignment, Decode]] = {}
        self.decoder_failures = 0
        self.misbehaviours = 0  # decoder steps that went wrong on purpose
        self._decode_keys = 0
        self._keys: dict[int, Assignment] = {}

    # --- a worker process's decoder starts, breaks, dies ---

    def start(self, worker_id: str, slots: int) -> None:
        """A worker process starts: a fresh pool (its worker's share of one that never
        preempts), a scheduler over it, no decodes."""
        size = self.kv_block_size
        blocks = pool_blocks(slots, self.largest_request, size)
        share = self.pool_share.get(worker_id, 1.0)
        if share < 1.0:  # tight: preemption by recompute; one largest request always fits
            blocks = max(blocks_for(self.largest_request, size), int(blocks * share))
        self.kv[worker_id] = KvModel(blocks, size, self._violation, worker_id)
        # until the driver's own limits come with its first plan
        self._new_scheduler(worker_id, BatchLimits(slots, self.max_context, slots + 16, 16, 32))
        self.decodes[worker_id] = {}

    def _new_scheduler(self, worker_id: str, limits: BatchLimits) -> None:
        self.schedulers[worker_id] = Scheduler(self.kv[worker_id], limits)
        self._head_wait.pop(worker_id, None)
        self._admitted[worker_id] = {}

    def fail(self, worker_id: str) -> None:
        """The decoder breaks: its decodes and their blocks are gone (the worker is told
        DecoderFailed by the cluster)."""
        self.decoder_failures += 1
        self.decodes[worker_id] = {}
        self.kv[worker_id].release_all()
        self._new_scheduler(worker_id, self.schedulers[worker_id].limits)

    def lose(self, worker_id: str) -> None:
        """The process died: its decodes are gone (its pool goes at the next start)."""
        self.decodes[worker_id] = {}

    # --- what the worker machine asks of it ---

    def start_decode(
        self, worker_id: str, assignment: Assignment, request: GenerationRequest
    ) -> None:
        """StartDecode: the fake model runs the request, queued in the scheduler."""
        self.drop(worker_id, assignment)  # a start again replaces the old run
        salt = assignment.attempt if diverges(request) else 0
        run = FakeDecode(assignment, request, salt)
        self._decode_keys += 1
        key = self._decode_keys
        self._keys[key] = assignment
        context = request.prompt_token_ids + request.output_prefix
        decode = Decode(request, self.clock.now, run, key)
        self.decodes[worker_id][assignment] = decode
        self.schedulers[worker_id].add(key, context, request.context_tokens)

    def drop(self, worker_id: str, assignment: Assignment) -> None:
        """StopDecode (or a decode's end): it leaves the scheduler, its blocks freed."""
        decode = self.decodes[worker_id].pop(assignment, None)
        if decode is not None:
            self.schedulers[worker_id].remove(decode.key)
            self._admitted[worker_id].pop(decode.key, None)

    # --- a driver plans and takes steps ---

    def plan(self, worker_id: str, limits: BatchLimits) -> StepPlan:
        """What the worker's next batched step computes: its core.scheduler grows,
        preempts, admits and plans, as the torch engine's does."""
        scheduler = self.schedulers[worker_id]
        scheduler.limits = limits
        decodes = self.decodes[worker_id]
        recomputed = scheduler.recomputed_tokens
        schedule = scheduler.schedule()
        self.preemptions += len(schedule.preempted)
        self.recomputed_tokens += scheduler.recomputed_tokens - recomputed
        order = self._admitted[worker_id]
        for key in schedule.preempted:  # each victim the newest of those still running
            newest = next(reversed(order), None)
            if key != newest:
                self._violation(
                    f"{worker_id}: preempted sequence {key}, not the most recently "
                    f"admitted one ({newest})"
                )
            order.pop(key, None)
        for key, cached in schedule.admitted:
            order[key] = None
            context = scheduler.progress(key)[1]
            self.prefill_tokens[0] += context
            self.prefill_tokens[1] += context - cached
        for key in schedule.refused:  # can never fit: the decoder fails it
            assignment = self._keys[key]
            decodes.pop(assignment, None)
            self._run_worker(worker_id, DecodeDone(assignment, "failed"))
        if schedule.preempted:
            last = schedule.preempted[-1]  # the newest victim waits first
            if scheduler.waiting[:1] != (last,) and last not in dict(schedule.admitted):
                self._violation(
                    f"{worker_id}: preempted {last} is not at the head of the queue "
                    f"({scheduler.waiting[:3]})"
                )
        if schedule.preempted or (scheduler.waiting and scheduler.running < limits.max_seqs):
            self._short_of_blocks(worker_id)
        self._check_head(worker_id, scheduler)
        plan = schedule.plan
        self._check_plan(worker_id, list(schedule.batch), plan, limits)
        self.kv[worker_id].check()
        return plan

    def run(
        self, worker_id: str, plan: StepPlan, misbehave: Callable[[], str | None] | None = None
    ) -> None:
        """Carry out a planned step: prefill chunks land, each decoding entry emits a token
        (a run of them where it speculates, within the step's token budget). Entries
        stopped while the step ran are skipped."""
        decodes = self.decodes[worker_id]
        scheduler = self.schedulers[worker_id]
        room = scheduler.limits.max_step_tokens - plan.tokens
        for key, tokens in plan.prefill:
            if self._keys[key] in decodes and scheduler.state(key) is SeqState.PREFILLING:
                scheduler.prefilled(key, tokens)
                prefilled, _ = scheduler.progress(key)
                self.kv[worker_id].wrote(key, scheduler.tokens(key)[:prefilled])
        for key in plan.decode:
            assignment = self._keys[key]
            if assignment in self.decodes[worker_id]:
                how = misbehave() if misbehave else None
                room -= self.step(worker_id, assignment, how, max(room, 0))

    def step(
        self, worker_id: str, assignment: Assignment, misbehave: str | None = None, room: int = 0
    ) -> int:
        """The fake decoder takes one step of one running assignment (and may misbehave;
        with up to `room` guesses, a decoding one may speculate). -> guesses made."""
        decodes = self.decodes[worker_id]
        decode = decodes[assignment]
        scheduler = self.schedulers[worker_id]
        decoding = scheduler.state(decode.key) is SeqState.DECODING
        if decoding:
            self._check_decode(worker_id, decode)
        events: list[DecoderEvent] = []
        over = decode.run.step(events)
        guesses = 0
        if decoding and misbehave is None and not over:
            guesses = self._speculate(worker_id, decode, events, room)
            over = bool(events) and isinstance(events[-1], DecodeDone)
        if misbehave is not None:
            self.misbehaviours += 1
            _misbehave(events, misbehave, decode.request.max_new_tokens)
        if decoding:
            # The step wrote the last token's keys and values and drew the next one.
            tokens = scheduler.tokens(decode.key)
            self.kv[worker_id].wrote(decode.key, tokens)
            output = decode.run.generation.output
            prompt = len(decode.request.prompt_token_ids)
            for token in output[len(tokens) - prompt :]:
                scheduler.emitted(decode.key, token)
            if tokens[prompt:] != output:
                self._violation(
                    f"{worker_id}: {assignment}'s scheduled tokens are not its output "
                    f"({len(tokens) - prompt} against {len(output)}): a token twice or lost"
                )
            if guesses:  # the pass wrote the accepted guesses' positions; the rest go back
                self.kv[worker_id].wrote(decode.key, tokens[:-1])
                scheduler.settle(decode.key)
        for event in events:
            if over and isinstance(event, DecodeDone):
                self.drop(worker_id, assignment)
            self._run_worker(worker_id, event)
        return guesses

    def _speculate(
        self, worker_id: str, decode: Decode, events: list[DecoderEvent], room: int
    ) -> int:
        """After a decoding step's own token: guesses for the positions after it, in
        blocks the scheduler can spare, verified; the accepted ones and the model's
        token after them join the step's events (the fake model's next tokens, as
        plain steps make them). -> how many were guessed (0: it did not speculate)."""
        speculation = self.speculation
        if speculation is None or room <= 0:
            return 0
        rng = speculation.rng
        generation = decode.run.generation
        left = generation.max_new_tokens - generation.next_index  # after the step's token
        wanted = min(rng.randint(1, MOST_GUESSES), room, left)
        if wanted <= 0:
            return 0
        # The step's token is the draw at the sequence's last position; guess k is for
        # the draw at the position after guess k-1, k positions past it.
        guesses = self.schedulers[worker_id].lookahead(decode.key, wanted)
        if guesses <= 0:
            return 0
        kept = 0
        while kept < guesses and rng.random() < speculation.acceptance:
            kept += 1
        speculation.verifications += 1
        speculation.proposed += guesses
        speculation.accepted += kept
        for _ in range(kept):  # each accepted guess: the model's draw after it comes out
            if decode.run.step(events):
                break
        return guesses

    def running(self) -> list[tuple[str, Assignment]]:
        return [(w, a) for w, decodes in self.decodes.items() for a in decodes]

    def each_worker(self) -> ItemsView[str, dict[Assignment, Decode]]:
        """(worker id, its running decodes) for every worker, in worker order (read only)."""
        return self.decodes.items()

    # --- the checks ---

    def _short_of_blocks(self, worker_id: str) -> None:
        """The worker's pool is out: a sequence was preempted, or one waits with a row
        free. Its accepted work is slower than a healthy worker's for as long, so this
        is a disturbance like a slow step: an attempt the router gives up meanwhile
        (its progress deadline passed) is explained by it, and nothing else is."""
        if self.disturbances is None:
            return
        now = self.clock.now
        last = self._pressure.get(worker_id)
        if last is not None and float(last[1]) >= now - 0.5:
            self.disturbances.extend(worker_id, last, now)
        else:
            self._pressure[worker_id] = self.disturbances.add(worker_id, "kv_pressure", now, now)

    def _check_head(self, worker_id: str, scheduler: Scheduler) -> None:
        """No sequence starves: once at the head of the queue it is admitted within as
        many steps as every running sequence needs to finish (each computes at least
        one token a step of at most the largest request's)."""
        head = scheduler.waiting[:1]
        if not head:
            self._head_wait.pop(worker_id, None)
            return
        before = self._head_wait.get(worker_id)
        steps = before[1] + 1 if before is not None and before[0] == head[0] else 0
        self._head_wait[worker_id] = (head[0], steps)
        bound = scheduler.limits.max_seqs * self.largest_request + 2
        if steps > bound:
            self._violation(
                f"{worker_id}: sequence {head[0]} waited at the head of the queue for "
                f"{steps} steps (bound {bound}): starved"
            )

    def _check_decode(self, worker_id: str, decode: Decode) -> None:
        """A decode step writes the last token's position: every earlier one must be
        written (by prefill or by earlier steps since its admission), and its block
        table must cover exactly the positions so far (no block taken early, none
        missing)."""
        tokens = len(self.schedulers[worker_id].tokens(decode.key))
        kv = self.kv[worker_id]
        written, table = kv.written(decode.key), len(kv.table(decode.key))
        if written < tokens - 1:
            self._violation(
                f"{worker_id}: sequence {decode.key} decodes position {tokens - 1} with "
                f"positions {written}..{tokens - 2} never written since its admission"
            )
        if table != blocks_for(tokens, self.kv_block_size):
            self._violation(
                f"{worker_id}: sequence {decode.key} holds {table} blocks for {tokens} "
                f"positions ({blocks_for(tokens, self.kv_block_size)} needed)"
            )

    def _check_plan(
        self, worker_id: str, batch: list[Running], plan: StepPlan, limits: BatchLimits
    ) -> None:
        """core.batching's promises: every decoding entry decodes, no chunk exceeds its
        prompt or the chunk limit, the step stays in its budget, prefill always moves."""
        decoding = {r.key for r in batch if r.decoding}
        budget = limits.max_step_tokens if decoding else limits.max_idle_prefill_tokens
        left = {r.key: r.prompt_tokens - r.prefilled for r in batch if not r.decoding}
        largest = limits.max_prefill_tokens if decoding else limits.max_idle_prefill_tokens
        problem = None
        if set(plan.decode) != decoding:
            problem = f"decodes {sorted(plan.decode)}, decoding {sorted(decoding)}"
        elif len(batch) > limits.max_seqs:
            problem = f"{len(batch)} admitted, {limits.max_seqs} slots"
        elif any(not 0 < n <= min(left.get(k, 0), largest) for k, n in plan.prefill):
            problem = f"prefill chunks {plan.prefill} for {left}"
        elif plan.tokens > budget:
            problem = f"{plan.tokens} tokens in a step of {budget}"
        elif left and not plan.prefill:
            problem = f"nothing prefilled while {left} wait"
        if problem is not None:
            self._violation(f"{worker_id} batch plan broke its limits: {problem}")

    def check_settled(self, down: set[str]) -> None:
        """At the end of a run: every live process's scheduler empty and every block
        back (free or cached), whatever was preempted, cancelled or cut off."""
        for worker_id, kv in self.kv.items():
            if worker_id in down:
                continue
            kv.check()
            if kv.manager.holders() or self.schedulers[worker_id].has_work():
                self._violation(
                    f"{worker_id}: the run settled with {kv.manager.holders()} sequences "
                    f"holding blocks, scheduler waiting {self.schedulers[worker_id].waiting}"
                )


def _misbehave(events: list[DecoderEvent], how: str, max_new_tokens: int) -> None:
    """Turn one step's correct decoder events into a misbehaving decoder's."""
    first = events[0] if events else None
    last = events[-1] if events else None
    match how:
        case "repeat" if isinstance(first, Decoded):
            events.insert(1, first)
        case "skip" if isinstance(first, Decoded):
            events[0] = Decoded(first.assignment, first.index + 1, first.token_id, first.logprob)
        case "overrun" if isinstance(last, DecodeDone):
            # A token past the end: at the budget's index if the budget ended it.
            end = max_new_tokens if last.reason == "length" else None
            if end is not None:
                events.insert(len(events) - 1, Decoded(last.assignment, end, 1))
            else:
                events.append(Decoded(last.assignment, max_new_tokens + 1, 1))
        case "end_twice" if isinstance(last, DecodeDone):
            events.append(last)
