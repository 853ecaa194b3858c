"""The decode engine: continuous batching of assignments on one model.

Engine is synchronous and single-threaded: start() and stop() queue work,
step() runs one scheduling step (core.batching decides who runs) and returns
the worker machine's input events, Decoded and DecodeDone. EngineThread
(thread.py) runs steps on a dedicated thread so an event loop never blocks on a
forward pass. adapters/engine/build.py builds one from EngineOptions.

Sampling (adapters/engine/sampling.py, batched over the rows): greedy at
temperature 0; otherwise temperature, then top_p, then an inverse-CDF draw
with a uniform number hashed from (request seed, token index). Each token's
randomness depends on nothing else, so a request reproduces whatever shares its
batch, and a continuation that starts at index k draws exactly what an
uninterrupted run would. A sampled request must carry its seed: the runtime's
controller draws one for every request that comes without (the one place
seeds are drawn), so that every attempt of a request draws alike; the engine
refuses a sampled request without one.

Log probabilities, for rows whose request asks (logprobs k): the
log-softmax of the distribution the token is drawn from, before top_p
truncation: logits / temperature (temperature 1 for greedy rows), with the
tokens a grammar forbids at -inf; the chosen token's value and the k largest,
for all asking rows at once (logprob_records).

What happens to a chosen token (its index, the stop rule, an already-ended
continuation) is core/decoding.py's Generation, shared with the fake decoders.

KV memory is a pool of blocks (adapters/engine/runner.py holds the tensors,
core/blocks.py's BlockManager decides who holds which block). Who waits, who
runs, who is preempted by recompute and what each step computes is
core/scheduler.py's Scheduler, the same one the simulator's workers run: this
engine tells it what a step computed and emitted, and carries out its plans.
A preempted sequence keeps its Generation, so it goes on at the next index
(mostly from the cache, where its committed blocks survive). Every full block
written, prompt or output, is committed to the cache.

Decode steps on a GPU run as CUDA graphs (adapters/engine/static_decode.py):
the step's inputs go into static buffers padded to a captured batch size,
and one replay runs the whole forward pass; attention there reads each row
up to its own length (paged_attention.py, chosen at start by measurement).
`decode` says which: "auto" (graphs on CUDA, the uncaptured fixed-shape step
on the GPU path on a CPU, eager elsewhere), "eager" (the
forward pass of runner.py, shaped by each step), "static" (the fixed-shape
step without capture: the CPU tests' view of what a graph replays) or
"graphs". Prefill steps stay eager: their shapes follow the chunks.

Constrained decoding (adapters/engine/grammar.py): a request with a Constraint
gets a matcher at start (a continuation's matcher replays its output prefix);
each step computes the constrained rows' masks in one batched call on the
grammar thread while the forward pass runs, applies them to the logits before
sampling, and feeds each emitted token to its matcher. A grammar that fails to
compile, or a prefix or token it rejects, fails that request alone.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from llguidance import LLMatcher

from adapters.engine.console import say
from adapters.engine.grammar import GrammarError, Grammars, Penalty, tokenizer_for
from adapters.engine.index_check import check_picks
from adapters.engine.model import LoadedModel
from adapters.engine.options import DEFAULT_KV_CACHE_TOKENS
from adapters.engine.paged_attention import ATTENTIONS, choose_attention, make_attention
from adapters.engine.runner import DEFAULT_BLOCK_SIZE, Chunk, Runner
from adapters.engine.sampling import TokenDraw, sample, sample_whole
from adapters.engine.speculative import (
    DraftProposer,
    NgramProposer,
    Pacer,
    PassCosts,
    SpecStats,
    SpeculativeOptions,
    advanced,
    pass_costs,
    worth_verifying,
)
from adapters.engine.static_decode import StaticDecode
from adapters.engine.weights import NATIVE
from core.batching import BatchLimits
from core.blocks import BlockManager
from core.decoding import Generation
from core.protocol import (
    Assignment,
    CacheReport,
    DecodeDone,
    DecoderEvent,
    GenerationRequest,
    TokenLogprob,
)
from core.scheduler import Scheduler

DECODE_PATHS = ("auto", "eager", "static", "graphs")
# Rows the decode attention is measured with at start (lengths spread up to max_context).
ATTENTION_TRIAL_ROWS = 32
# Below this a reported log probability is a grammar's forbidden token: no real logit
# gap comes near it, and the penalty (grammar.py) puts such tokens near -1.7e38.
FORBIDDEN_LOGPROB = -1e30
REPORTED_KEYS = 256  # chain keys in each CacheReport
# The keys are listed again at most this often: with a full cache the listing costs
# ~0.6 ms, 5% of a one-row step, and heartbeats read them only every 0.5 s.
KEYS_EVERY_S = 0.2
_RATE_WEIGHT = 0.2  # of the newest measurement in the prefill rate's moving average


@dataclass
class _Sequence:
    """What the engine keeps of a scheduled sequence (the Scheduler keeps its tokens,
    context and blocks)."""

    key: int
    request: GenerationRequest
    generation: Generation  # the output so far: a continuation starts with its prefix
    matcher: LLMatcher | None = None  # the grammar's state past the output (constrained only)
    pacer: Pacer | None = None  # how many tokens it proposes (speculative decoding only)

    @property
    def assignment(self) -> Assignment:
        return self.generation.assignment

    @property
    def position(self) -> int:
        """Where a decode step writes: the position of the last output token."""
        return len(self.request.prompt_token_ids) + self.generation.next_index - 1

    def draw(self) -> TokenDraw:
        """The draw for this sequence's next token."""
        sampling = self.request.sampling
        seed = 0 if sampling.seed is None else sampling.seed  # only greedy has none
        return TokenDraw(sampling.temperature, sampling.top_p, seed, self.generation.next_index)


@dataclass
class StepTiming:
    """What the last step did, for benchmarks."""

    decode_rows: int = 0
    prefill_tokens: int = 0  # computed this step (not found cached)
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # of `seconds`, from the end of decoding to the step's end
    cached_tokens: int = 0  # found in the prefix cache by this step's admissions
    preempted: int = 0  # sequences sent back to wait this step


class Engine:
    """weights: a format of adapters/engine/weights.py (adapters/engine/build.py turns
    "auto" into one, by capability, quality and speed at start).

    kv_cache_tokens: positions the KV pool holds, all sequences together (blocks
    of block_size); None: as many as `kv_cache_share` of the memory the weights
    leave free holds (pool_size), up to every slot at the full context, and the
    context is cut to the pool where the pool is smaller; prefix_caching: share
    committed blocks between sequences.

    grammar_tokenizer: llguidance's tokenizer for constrained decoding; by default
    built from the model's tokenizer at the first constrained request (~1 s).

    decode: how decode steps run (DECODE_PATHS, the module's docstring);
    attention: the fixed-shape step's attention (paged_attention.ATTENTIONS), or
    "auto": measured at start on CUDA, "gather" elsewhere.

    gpu_path: run the GPU's code (runner.py's Runner; None: on CUDA). On a CPU
    that is the GPU's dtype, fused kernels and decode attention through triton's
    interpreter, and "auto" decode is the fixed-shape step graphs would capture."""

    def __init__(
        self,
        loaded: LoadedModel,
        limits: BatchLimits | None = None,
        weights: str = "fp32",
        *,
        prefix_caching: bool = True,
        kv_cache_tokens: int | None = DEFAULT_KV_CACHE_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        grammar_tokenizer: Any = None,
        decode: str = "auto",
        attention: str = "auto",
        kv_cache_share: float | None = None,
        gpu_path: bool | None = None,
        speculative: SpeculativeOptions | None = None,
        draft: tuple[LoadedModel, str] | None = None,
    ) -> None:
        limits = limits or BatchLimits(max_context=min(2048, loaded.max_context))
        if limits.max_context > loaded.max_context:
            raise ValueError(f"max_context {limits.max_context} > the model's {loaded.max_context}")
        if kv_cache_tokens is not None and kv_cache_tokens < block_size:
            raise ValueError(f"kv_cache_tokens {kv_cache_tokens} is less than one block")
        self.loaded = loaded
        if weights == "auto":  # choosing builds engines: the builder does it, once
            raise ValueError('weights "auto" is chosen by adapters.engine.build, not here')
        if kv_cache_tokens is None:  # sized from what the weights leave free
            self.runner = Runner(
                loaded, None, block_size, limits.max_context, weights, gpu_path=gpu_path
            )
            tokens, context, line = pool_size(self.runner, limits, kv_cache_share)
            say(line)
            limits = msgspec.structs.replace(limits, max_context=context)
            self.runner.allocate(tokens // block_size, context)
        else:
            blocks = kv_cache_tokens // block_size
            self.runner = Runner(
                loaded, blocks, block_size, limits.max_context, weights, gpu_path=gpu_path
            )
        if self.runner.weight_sources:  # the native format on a GGUF: what ran as shipped
            sources = self.runner.weight_sources.most_common()
            say("weights: " + ", ".join(f"{count} x {source}" for source, count in sources))
        self.limits = limits
        self.blocks = BlockManager(self.runner.num_blocks, block_size, prefix_caching)
        self.device = self.runner.device
        if self.runner.gpu_path:
            fused = self.runner.fused_problem
            say(f"elementwise kernels: {'fused (triton)' if fused is None else f'torch ({fused})'}")
        self.static = self._static_decode(decode, attention)
        self._keys = 0
        self.scheduler = Scheduler(self.blocks, limits)
        self._sequences: dict[int, _Sequence] = {}  # waiting or running, by key
        self._by_assignment: dict[Assignment, int] = {}
        self._ended: list[DecoderEvent] = []  # continuations that were over at start
        self.last_step = StepTiming()
        self._prompt_tokens = 0  # context tokens submitted for prefill, recomputes included
        self._computed_tokens = 0  # of those, prefilled (not found cached)
        self._prefill_rate = 0.0  # tokens/s, moving average over steps that prefilled
        pool = self.blocks.num_blocks
        self._report = CacheReport(block_size, total_blocks=pool, free_blocks=pool)
        self._keys_at = -KEYS_EVERY_S  # when the report's keys were last listed
        self._grammars = None if grammar_tokenizer is None else Grammars(grammar_tokenizer)
        self.speculative = speculative
        self.spec_stats = SpecStats()
        self._proposer = self._make_proposer(speculative, draft)
        self._pass_costs: PassCosts | None = None
        if speculative is not None:
            say(speculative.describe())
            drafting = self._proposer.runner if isinstance(self._proposer, DraftProposer) else None
            costs = speculative.costs or pass_costs(self.runner, speculative.step_budget, drafting)
            how = "as given" if speculative.costs else "measured at start"
            say(f"speculative decoding: {costs.describe()} ({how}); guesses are verified "
                "where they pay for their positions")  # fmt: skip
            self._pass_costs = costs

    def _make_proposer(
        self, options: SpeculativeOptions | None, draft: tuple[LoadedModel, str] | None
    ) -> NgramProposer | DraftProposer | None:
        if options is None:
            if draft is not None:
                raise ValueError("a draft model is given but speculative decoding is off")
            return None
        if options.kind == "ngram":
            return NgramProposer(options)
        if draft is None:
            raise ValueError("speculative decoding by a draft model needs --draft-model")
        model, fmt = draft
        if (problem := draft_problem(self.loaded, model)) is not None:
            raise ValueError(f"the draft model {model.name} cannot draft for "
                             f"{self.loaded.name}: {problem}")  # fmt: skip
        runner = self.runner
        if model.max_context < runner.max_context:
            raise ValueError(f"the draft model {model.name} serves {model.max_context} tokens "
                             f"of context, less than the {runner.max_context} served")  # fmt: skip
        drafting = Runner(model, runner.num_blocks, runner.block_size, runner.max_context, fmt)
        say(f"draft model: {model.name} ({model.family}, {fmt}), {runner.num_blocks} KV blocks")
        return DraftProposer(drafting, runner.vocab_size, sample_rows)

    def _static_decode(self, decode: str, attention: str) -> StaticDecode | None:
        """The fixed-shape decode step `decode` asks for (captured as graphs or not), or
        None for the eager one."""
        if decode not in DECODE_PATHS:
            raise ValueError(f"unknown decode path {decode!r}; one of {', '.join(DECODE_PATHS)}")
        if attention != "auto" and attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}; auto or {', '.join(ATTENTIONS)}")
        cuda = self.device.type == "cuda"
        auto = decode == "auto"
        if auto:  # the GPU path on a CPU: the step graphs capture, run uncaptured
            decode = "graphs" if cuda else "static" if self.runner.gpu_path else "eager"
        if decode == "eager":
            return None
        if decode == "graphs" and not cuda:
            raise ValueError(f"decode graphs need a CUDA device, not {self.device.type}")
        runner = self.runner
        if runner.format in NATIVE:
            raise ValueError(
                f"{runner.format} decodes in one native call; its decode path is eager"
            )
        rows = self.limits.max_seqs
        if attention == "auto":
            chosen = choose_attention(runner, min(rows, ATTENTION_TRIAL_ROWS), say)
        else:
            shape = (runner.heads, runner.kv_heads, runner.head_dim, runner.block_size)
            chosen = make_attention(attention, *shape, runner.max_context)
            if (unfit := chosen.problem(runner.spec)) is not None:
                raise ValueError(
                    f"decode attention {attention} cannot run {loaded_name(self)}: {unfit}"
                )
        if chosen.name == "triton":  # short prefills attend through it too, row by row
            runner.row_attention = chosen
        graphs = decode == "graphs"
        return StaticDecode(runner, rows, chosen, graphs, say, insist=graphs and not auto)

    # --- commands ---

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        if assignment in self._by_assignment:
            raise ValueError(f"{assignment} is already running")
        vocab = self.runner.vocab_size
        context = request.prompt_token_ids + request.output_prefix
        bad = [t for t in context if t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:3]} are outside the vocabulary ({vocab})")
        if request.sampling.sampled and request.sampling.seed is None:
            raise ValueError("a sampled request needs a seed (the controller gives each one)")
        self._keys += 1
        stop_ids = self.loaded.eos_token_ids | frozenset(request.stop_token_ids)
        generation = Generation(assignment, request, stop_ids)
        seq = _Sequence(self._keys, request, generation)
        ended = generation.ended_at_start()
        if ended is not None:  # nothing to add; say so in the next step
            self._ended.append(ended)
            return
        if request.constraint is not None:  # GrammarError is a ValueError: this request fails
            seq.matcher = self.grammars().matcher(request.constraint.grammar, request.output_prefix)
        self.scheduler.add(seq.key, context, request.context_tokens)
        self._sequences[seq.key] = seq
        self._by_assignment[assignment] = seq.key

    def stop(self, assignment: Assignment) -> None:
        """Drop an assignment at once; its slot is free for the next step."""
        key = self._by_assignment.pop(assignment, None)
        if key is None:
            return
        del self._sequences[key]
        self.scheduler.remove(key)
        if self._proposer is not None:
            self._proposer.forget(key)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._ended)

    @property
    def active(self) -> int:
        return self.scheduler.running

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    def grammars(self) -> Grammars:
        """The compiled grammars of this engine's model (built at first use)."""
        if self._grammars is None:
            tokenizer = self.loaded.tokenizer
            if tokenizer is None:
                raise GrammarError(f"{self.loaded.name} has no tokenizer to constrain with")
            eos = self.loaded.eos_token_ids
            self._grammars = Grammars(tokenizer_for(tokenizer, self.runner.vocab_size, eos))
        return self._grammars

    def cache_report(self) -> CacheReport:
        """The prefix cache as of the last step (a snapshot: safe from any thread)."""
        return self._report

    # --- one step ---

    def step(self) -> list[DecoderEvent]:
        began = time.perf_counter()
        events: list[DecoderEvent] = list(self._ended)
        self._ended.clear()
        schedule = self.scheduler.schedule()
        for key in schedule.refused:  # could never run: beyond max_context or the pool
            seq = self._sequences.pop(key)
            del self._by_assignment[seq.assignment]
            events.append(DecodeDone(seq.assignment, "failed"))
        cached = 0
        for key, found in schedule.admitted:
            cached += found
            self._prompt_tokens += self.scheduler.progress(key)[1]
        preempted = len(schedule.preempted)
        plan = schedule.plan
        if plan.decode:
            room = self.limits.max_step_tokens - plan.tokens
            self._decode([self._sequences[key] for key in plan.decode], events, room)
        decoded = time.perf_counter()
        chunks = [(self._sequences[k], n) for k, n in plan.prefill if k in self._sequences]
        if chunks:
            self._prefill(chunks, events)
        ended = time.perf_counter()
        prefilled = plan.tokens - len(plan.decode)
        if prefilled:
            rate = prefilled / max(ended - decoded, 1e-9)
            old = self._prefill_rate
            self._prefill_rate = rate if old == 0 else old + _RATE_WEIGHT * (rate - old)
        self.last_step = StepTiming(
            len(plan.decode), prefilled, ended - began, ended - decoded, cached, preempted
        )
        keys = self._report.keys
        if ended - self._keys_at >= KEYS_EVERY_S:
            keys, self._keys_at = self.blocks.summary(REPORTED_KEYS), ended
        blocks = self.blocks
        self._report = CacheReport(
            blocks.block_size,
            keys,
            self._prefill_rate,
            self._prompt_tokens,
            self._computed_tokens,
            blocks.num_blocks,
            blocks.free_blocks(),
            blocks.cached_blocks(),
            self.spec_stats.verified_rows,
            self.spec_stats.proposed,
            self.spec_stats.accepted,
        )
        return events

    def _decode(self, seqs: list[_Sequence], events: list[DecoderEvent], room: int = 0) -> None:
        guesses = self._propose(seqs, room)
        if guesses is not None:
            self._verify(seqs, guesses, events)
            return
        device = self.device
        where = [seq.position for seq in seqs]
        tables = [self.blocks.table(seq.key) for seq in seqs]
        last = [s.generation.output[-1] for s in seqs]
        masks = self._masks(seqs)
        self.runner.check_step("decode", last, where, tables)  # before padding hides a gap
        if self.static is not None:
            logits = self.static.run(tables, where, last)
        else:
            pages = self.runner.pages(tables, max(where) + 1)
            positions = torch.tensor(where, device=device)
            logits = self.runner.decode(pages, positions, torch.tensor(last, device=device))
        for seq, position in zip(seqs, where, strict=True):
            if (position + 1) % self.blocks.block_size == 0:  # it filled a block
                self.blocks.commit(seq.key, self.scheduler.tokens(seq.key)[: position + 1])
        self._choose(seqs, logits, masks, events)

    def _propose(self, seqs: list[_Sequence], room: int) -> list[list[int]] | None:
        """Each decoding sequence's guesses of its next tokens, or None when no sequence
        has any (the step decodes as it would without speculation). A guess never
        reaches the request's budget (the run's last token is always the target's
        own draw), the context's end, a token the grammar refuses, or past the blocks
        the pool has to spare; all guesses together stay within the step's budget."""
        options, proposer = self.speculative, self._proposer
        if options is None or proposer is None:
            return None
        budget = min(options.step_budget - len(seqs), room)
        if budget <= 0:
            return None
        counts, pacers = [], []
        for seq in seqs:
            if seq.pacer is None:
                seq.pacer = Pacer(options.max_tokens)
            pacers.append(seq.pacer)
            generation = seq.generation
            counts.append(max(0, min(
                seq.pacer.length,
                generation.max_new_tokens - generation.next_index - 1,
                self.limits.max_context - 1 - seq.position,
            )))  # fmt: skip
        # guesses are verified as far as they pay, by the pass costs measured at start
        assert self._pass_costs is not None
        context = sum(seq.position for seq in seqs) // len(seqs)
        costs = self._pass_costs.at(context)
        acceptances = [pacer.acceptance for pacer in pacers]
        drafting = isinstance(proposer, DraftProposer)
        if drafting:  # a draft's guesses cost its steps: decide how many before it makes them
            counts = worth_verifying(costs, len(seqs), counts, acceptances, self._pass_costs.draft)
            if not any(counts):
                for pacer in pacers:
                    pacer.idle()
                return None
        wanted = [
            (seq.key, self.scheduler.tokens(seq.key), count, seq.draw())
            for seq, count in zip(seqs, counts, strict=True)
        ]
        guesses = proposer.propose(wanted)
        vocab = self.runner.vocab_size
        for row, seq in enumerate(seqs):
            guess = guesses[row][:budget]
            # the run stops short of a token out of the vocabulary or one that would end it
            # (an end the model reaches draws that token itself, as the run's last)
            stops = seq.generation.stop_ids
            cut = next((i for i, t in enumerate(guess) if t >= vocab or t in stops), len(guess))
            guesses[row] = guess = guess[:cut]
            if guess and seq.matcher is not None:
                guesses[row] = guess[: seq.matcher.validate_tokens(guess)]
        if not drafting:  # the lookup's guesses came free: now keep those that pay
            counts = worth_verifying(costs, len(seqs), [len(g) for g in guesses], acceptances)
        for row, seq in enumerate(seqs):
            guess = guesses[row][: min(counts[row], budget)]
            if guesses[row] and not guess:
                pacers[row].idle()  # it had guesses, not worth verifying now
            if guess:
                guess = guess[: self.scheduler.lookahead(seq.key, len(guess))]
            budget -= len(guess)
            guesses[row] = guess
        return guesses if any(guesses) else None

    def _verify(
        self, seqs: list[_Sequence], guesses: list[list[int]], events: list[DecoderEvent]
    ) -> None:
        """Every decoding sequence's last token and its guesses in one packed pass (a
        sequence without guesses is a one-token chunk: its decode), a token drawn at
        every position exactly as plain decoding draws it there, and each sequence's
        drawn tokens delivered in order while each equals the guess before it."""
        chunks: list[Chunk] = []
        draws: list[TokenDraw] = []
        tops: list[int | None] = []
        starts: list[int] = []
        for seq, guess in zip(seqs, guesses, strict=True):
            run = [seq.generation.output[-1], *guess]
            table = self.blocks.table(seq.key)
            chunks.append(Chunk(table, seq.position, torch.tensor(run, device=self.device)))
            starts.append(len(draws))
            first = seq.draw()
            draws += [advanced(first, j) for j in range(len(run))]
            tops += [seq.request.logprobs] * len(run)
        masks = self._run_masks(seqs, guesses, starts)
        logits = self.runner.prefill_packed(chunks, range(len(draws)))
        with self._lone_torch():
            if masks is not None:
                logits = self.grammars().apply(logits, *masks)
            picks = sample_rows(logits, draws)
            if self.runner.check_indices:
                check_picks(picks, self.runner.vocab_size)
            records = logprob_records(logits, picks, draws, tops)
        stats = self.spec_stats
        stats.steps += 1
        for seq, guess, start in zip(seqs, guesses, starts, strict=True):
            accepted = 0
            for j in range(len(guess) + 1):
                token = picks[start + j]
                ended = self._emit(seq, token, events, records[start + j])
                kept = j < len(guess) and token == guess[j]
                accepted += kept
                if ended or not kept:
                    break
            if guess:
                stats.verified_rows += 1
                stats.proposed += len(guess)
                stats.accepted += accepted
                stats.emitted += j + 1
            if ended:
                continue
            assert seq.pacer is not None
            seq.pacer.update(len(guess), accepted)
            tokens = self.scheduler.tokens(seq.key)
            self.blocks.commit(seq.key, tokens[: len(tokens) - 1])  # the positions now written
            self.scheduler.settle(seq.key)  # blocks looked ahead for rejected guesses go back

    def _run_masks(
        self, seqs: list[_Sequence], guesses: list[list[int]], starts: list[int]
    ) -> tuple[list[int], Future[Penalty]] | None:
        """The grammar's masks at every verified position of the constrained sequences:
        each matcher is moved through its guesses (which it accepts: _propose checked)
        to mask the position after each, then back."""
        held = [(row, seq.matcher) for row, seq in enumerate(seqs) if seq.matcher is not None]
        if not held:
            return None
        began = time.perf_counter()
        grammars, vocab = self.grammars(), self.runner.vocab_size
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for depth in range(max(len(guesses[row]) for row, _ in held) + 1):
            level = [(row, m) for row, m in held if len(guesses[row]) >= depth]
            parts.append(grammars.penalties([m for _, m in level], vocab).result().penalty)
            rows += [starts[row] + depth for row, _ in level]
            for row, matcher in level:
                if depth < len(guesses[row]):
                    matcher.consume_token(guesses[row][depth])
        for row, matcher in held:
            if guesses[row]:
                matcher.rollback(len(guesses[row]))
        order = sorted(range(len(rows)), key=rows.__getitem__)  # apply() wants rows in order
        penalty = torch.cat(parts)[torch.tensor(order)]
        done: Future[Penalty] = Future()
        done.set_result(Penalty(penalty, time.perf_counter() - began))
        return [rows[i] for i in order], done

    def _prefill(self, chunks: list[tuple[_Sequence, int]], events: list[DecoderEvent]) -> None:
        """Every prefill chunk of the step in one forward pass; the sequences whose
        context it completes draw their first token (logits of their last row only)."""
        scheduler = self.scheduler
        packed, rows, done = [], [], []
        first = 0
        for seq, count in chunks:
            prefilled, context = scheduler.progress(seq.key)
            tokens = scheduler.tokens(seq.key)[prefilled : prefilled + count]
            table = self.blocks.table(seq.key)
            packed.append(Chunk(table, prefilled, torch.tensor(tokens, device=self.device)))
            first += count
            if prefilled + count == context:
                rows.append(first - 1)
                done.append(seq)
        masks = self._masks(done)
        logits = self.runner.prefill_packed(packed, rows)
        for seq, count in chunks:
            scheduler.prefilled(seq.key, count)
            self._computed_tokens += count
            self.blocks.commit(seq.key, scheduler.tokens(seq.key)[: scheduler.progress(seq.key)[0]])
        if done:
            self._choose(done, logits, masks, events)

    def _masks(self, seqs: list[_Sequence]) -> tuple[list[int], Future[Penalty]] | None:
        """Start the grammar masks of the constrained rows among seqs (row numbers, and
        the penalties the grammar thread computes while the forward pass runs)."""
        held = [(row, seq.matcher) for row, seq in enumerate(seqs) if seq.matcher is not None]
        if not held:
            return None
        matchers = [matcher for _, matcher in held]
        return [row for row, _ in held], self.grammars().penalties(matchers, self.runner.vocab_size)

    @contextmanager
    def _lone_torch(self) -> Iterator[None]:
        """torch on one thread for the work between native passes (sampling, logprobs,
        grammar masks on a step's logits): on more, torch's OpenMP threads spin on for a
        while after each parallel op, on the cores the native pass's threads need next
        (a 5-row verification measured 19 ms after a parallel sampling, 8 ms after a
        single-threaded one, on 2 cores)."""
        threads = torch.get_num_threads()
        if not self.runner.native or threads == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _choose(
        self,
        seqs: list[_Sequence],
        logits: torch.Tensor,
        masks: tuple[list[int], Future[Penalty]] | None,
        events: list[DecoderEvent],
    ) -> None:
        """Each row's next token (and logprob record) from its logits [rows, vocab],
        masked first where a grammar holds the row: masked logits are both the
        distribution drawn from and the one reported."""
        with self._lone_torch():
            if masks is not None:
                logits = self.grammars().apply(logits, *masks)
            draws = [seq.draw() for seq in seqs]
            picks = sample_rows(logits, draws)
            if self.runner.check_indices:
                check_picks(picks, self.runner.vocab_size)
            tops = [seq.request.logprobs for seq in seqs]
            records = logprob_records(logits, picks, draws, tops)
        for seq, token, record in zip(seqs, picks, records, strict=True):
            self._emit(seq, token, events, record)

    def _emit(
        self,
        seq: _Sequence,
        token: int,
        events: list[DecoderEvent],
        record: TokenLogprob | None = None,
    ) -> bool:
        """Deliver a sequence's next token; True when its output ended with it (the
        sequence is stopped then)."""
        ended = seq.generation.emit(token, events, record)
        if not ended:
            self.scheduler.emitted(seq.key, token)
        if not ended and seq.matcher is not None and not seq.matcher.consume_token(token):
            # The mask allowed it, so only a broken grammar state gets here: this request fails.
            events.append(DecodeDone(seq.assignment, "failed"))
            ended = True
        if ended:
            self.stop(seq.assignment)  # its row and blocks are free for the next step
        return ended

    def reset(self) -> list[Assignment]:
        """Forget everything (after a failed step); returns what was dropped."""
        dropped = list(self._by_assignment)
        for assignment in dropped:
            self.stop(assignment)
        return dropped


# The share of free memory the KV pool takes when it is sized from memory: on a GPU most
# of it (the weights are in already; the decode graphs and activations need the rest), on
# a CPU half (the machine has other work, and the page cache).
KV_MEMORY_SHARE = {"cuda": 0.85, "cpu": 0.5}


def free_bytes(device: torch.device) -> int:
    """Memory free for the KV pool on `device` right now."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def pool_size(runner: Runner, limits: BatchLimits, share: float | None) -> tuple[int, int, str]:
    """(KV positions, the context it allows, a line for the log): as many positions as
    `share` of the free memory holds (KV_MEMORY_SHARE by device when None), at most
    every slot at the full context; the context is cut to the pool when the pool is
    smaller than one whole sequence."""
    share = KV_MEMORY_SHARE.get(runner.device.type, 0.5) if share is None else share
    free, per_token = free_bytes(runner.device), runner.token_bytes()
    block = runner.block_size
    want = limits.max_seqs * limits.max_context
    tokens = min(want, int(free * share) // per_token) // block * block
    if tokens < block:
        raise MemoryError(
            f"{free / 2**30:.2f} GiB free holds no KV block ({per_token} bytes a position)"
        )
    context = min(limits.max_context, tokens)
    line = (
        f"KV cache: {tokens} positions ({tokens * per_token / 2**30:.2f} GiB, "
        f"{runner.cache_dtype}) for {limits.max_seqs} sequences of up to {context} tokens, "
        f"{share:.0%} of the {free / 2**30:.1f} GiB free after the weights"
    )
    if context < limits.max_context:
        line += f" (context cut from {limits.max_context} to fit)"
    return tokens, context, line + "; --kv-cache-tokens sets it"


def draft_problem(target: LoadedModel, draft: LoadedModel) -> str | None:
    """Why `draft` cannot propose tokens for `target`, or None: its tokens must mean
    what the target's mean (the same tokenizer)."""
    if target.tokenizer is None or draft.tokenizer is None:
        return "both need a tokenizer to compare"
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        return "its tokenizer differs from the target's"
    return None


def loaded_name(engine: Engine) -> str:
    return f"{engine.loaded.name} ({engine.loaded.family})"


def sample_rows(logits: torch.Tensor, draws: list[TokenDraw]) -> list[int]:
    """One token per row of logits [rows, vocab], each chosen as its TokenDraw says
    (adapters/engine/sampling.py: batched, the uniform of each draw computed from
    (seed, index)); one copy to the host, two in the rare step where a row's
    nucleus is wider than the sampler's probe."""
    both: list[list[int]] = sample(logits, draws).tolist()
    picks, short = both
    redo = [row for row, flag in enumerate(short) if flag]
    if redo:
        again = sample_whole(logits[redo], [draws[row] for row in redo]).tolist()
        for row, token in zip(redo, again, strict=True):
            picks[row] = token
    return picks


def logprob_records(
    logits: torch.Tensor,
    picks: list[int],
    draws: list[TokenDraw],
    tops: list[int | None],
) -> list[TokenLogprob | None]:
    """Each row's logprob record, or None for rows whose request asks for none (top None).

    The distribution reported is the one the row's token is drawn from, before
    top_p truncation: log_softmax(logits / temperature), temperature 1 for a
    greedy row. A token a grammar forbids (its logit pushed down by grammar.py's
    penalty) adds nothing to the normaliser, so the rest renormalise among
    themselves, as the draw does, and reads -inf if it is among the top k.

    Cost, for every asking row together: one logsumexp and one topk over the
    scaled logits (the log-probabilities are those minus the logsumexp, so the
    full log_softmax is never written out) and one copy to the host.
    """
    asking = [row for row, top in enumerate(tops) if top is not None]
    if not asking:
        return [None] * len(tops)
    device = logits.device
    scores = logits if len(asking) == len(tops) else logits[torch.tensor(asking, device=device)]
    scores = scores.float()
    scale = [draws[r].temperature if draws[r].sampled else 1.0 for r in asking]
    if any(t != 1.0 for t in scale):
        scores = scores / torch.tensor(scale, device=device)[:, None]
    norm = torch.logsumexp(scores, dim=-1, keepdim=True)
    chosen = scores.gather(1, torch.tensor([[picks[r]] for r in asking], device=device)) - norm
    k = min(max(tops[r] or 0 for r in asking), scores.shape[-1])
    values, ids = torch.topk(scores, k, dim=-1)  # most likely first
    # Ids travel as float32, exact below 2**24 (vocabularies are far smaller).
    table = torch.cat([chosen, values - norm, ids.float()], dim=1).tolist()
    records: list[TokenLogprob | None] = [None] * len(tops)
    for row, line in zip(asking, table, strict=True):
        top = min(tops[row] or 0, k)
        values_ids = zip(line[1 : 1 + top], line[1 + k : 1 + k + top], strict=True)
        pairs = tuple((int(i), _logprob(v)) for v, i in values_ids)
        records[row] = TokenLogprob(_logprob(line[0]), pairs)
    return records


def _logprob(value: float) -> float:
    """A log probability as reported: at most 0 (rounding may pass it), and -inf for a
    token a grammar forbids (its value is then near float32's lowest)."""
    return -math.inf if value <= FORBIDDEN_LOGPROB else min(value, 0.0)
