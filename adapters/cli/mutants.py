"""`fencepost mutants`: prove the simulator has teeth.

Each mutant is a small textual patch to core/ that reproduces a bug a real
person could write (accepting a duplicate index, skipping the attempt check,
retrying after the first token, ...). For every mutant the core, sim and
adapters packages are copied to a temporary folder, the patch is applied there
(the working tree is never touched), and a seed sweep runs in a subprocess
against the patched copy. A mutant is killed when the sweep reports a
violation; the number of seeds it took is reported too. The sweep is
`python -m adapters.cli sim` run in the copy, so this module never imports
the simulator itself.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from adapters.cli import natural, positive

ROOT = Path(__file__).resolve().parents[2]  # the folder holding core/, sim/ and adapters/


@dataclass(frozen=True)
class Mutant:
    """A bug: in file `path`, each `original` snippet becomes its `mutated` twin."""

    name: str
    path: str
    original: str
    mutated: str
    also: tuple[tuple[str, str], ...] = ()  # further (original, mutated) pairs, same file

    def patches(self) -> tuple[tuple[str, str], ...]:
        return ((self.original, self.mutated), *self.also)


MUTANTS = (
    Mutant(
        "router accepts a duplicate index",
        "core/requests.py",
        "        if end <= delivered:\n",
        "        if end < delivered:\n",
    ),
    Mutant(
        "router accepts a token past a gap",
        "core/requests.py",
        "        if start > delivered:\n",
        "        if start > delivered + 1:\n",
    ),
    Mutant(
        "router skips the attempt check",
        "core/requests.py",
        "        if req.active != assignment:\n",
        "        if req.active is None:\n",
    ),
    Mutant(
        "router resumes a started stream from scratch",
        "core/placement.py",
        "    if not req.tokens:\n        return req.request\n",
        "    if req.tokens is not None:\n        return req.request\n",
    ),
    Mutant(
        "router resumes at k-1",
        "core/placement.py",
        "output_prefix=tuple(req.tokens))",
        "output_prefix=tuple(req.tokens[:-1]))",
    ),
    Mutant(
        "router resumes at k+1",
        "core/placement.py",
        "output_prefix=tuple(req.tokens))",
        "output_prefix=(*req.tokens, req.tokens[-1]))",
    ),
    Mutant(
        "router resumes without the sampling seed",
        "core/placement.py",
        "output_prefix=tuple(req.tokens))",
        "output_prefix=tuple(req.tokens),\n"
        "                       sampling=replace(req.request.sampling, seed=None))",
    ),
    Mutant(
        "router ignores a heartbeat's new epoch",
        "core/fleet.py",
        "        elif beat.epoch > worker.epoch:\n",
        "        elif False:\n",
    ),
    Mutant(
        "router completes before the last tokens arrive",
        "core/requests.py",
        "        if finished.completion_tokens == req.delivered:\n",
        "        if True:\n",
    ),
    Mutant(
        "router never frees the slot of a completed request",
        "core/ledger.py",
        '        assert finished.reason in ("eos", "length")\n        self._release(req, out)\n',
        '        assert finished.reason in ("eos", "length")\n',
    ),
    Mutant(
        "worker admits without a free slot",
        "core/worker.py",
        "        if self.free_slots <= 0 or self.draining:\n",
        "        if self.free_slots < -1 or self.draining:\n",
    ),
    Mutant(
        "worker resends from the wrong index",
        "core/worker.py",
        "        return TokenRun(assignment, start, tuple(self.tokens[start:]), records, after)\n",
        "        return TokenRun(assignment, start, tuple(self.tokens[start + 1 :]), records[1:], "
        "after)\n",
    ),
    Mutant(
        "router delivers a resent run's logprob records one off",
        "core/requests.py",
        "run.logprobs[at] if run.logprobs else None",
        "run.logprobs[at - 1] if run.logprobs else None",
    ),
    Mutant(
        "worker keeps a continuation's records as if from index 0",
        "core/worker.py",
        "            request.max_new_tokens, prefix, records, len(prefix), link.seq\n",
        "            request.max_new_tokens, prefix, records, 0, link.seq\n",
    ),
    Mutant(
        # Issue 50: how it was until then. Two attempts of an unseeded request then scored
        # one token at one position differently, as no real model does.
        "fake model's logprob records follow its draw (seed and salt), not its context",
        "core/fake_model.py",
        "        mix = ((self.reads ^ self.index ^ (token << 32))",
        "        mix = ((self.state ^ self.index ^ (token << 32))",
    ),
    Mutant(
        "worker keeps decoding after a cancel",
        "core/worker.py",
        'if reason == "cancelled" or event is E.DECODER_SKIPPED:',
        "if event is E.DECODER_SKIPPED:",
    ),
    # The second set: bugs that cost availability or waste rather than a wrong token,
    # which only the simulator's explained-outcome, limit, view and waste oracles see.
    Mutant(
        "worker starts a continuation's index at 0",
        "core/worker.py",
        "        prefix = list(request.output_prefix)\n",
        "        prefix: list[int] = []\n",
    ),
    Mutant(
        "router asks a Resend one index too far",
        "core/ledger.py",
        "Resend(req.active, req.delivered)",
        "Resend(req.active, req.delivered + 1)",
    ),
    Mutant(
        "router offers to workers it holds unhealthy",
        "core/slots.py",
        "if w.healthy and w.max_context >= context_tokens]",
        "if w.max_context >= context_tokens]",
    ),
    Mutant(
        "router arms the offer timer at an absolute time",
        "core/placement.py",
        "ArmTimer(OfferTimer(assignment), self.now + self.config.offer_timeout_s)",
        "ArmTimer(OfferTimer(assignment), self.config.offer_timeout_s)",
    ),
    Mutant(
        "router retries one attempt past max_attempts",
        "core/placement.py",
        "        if req.attempt - req.full_retries >= self.config.max_attempts:\n",
        "        if req.attempt - req.full_retries > self.config.max_attempts:\n",
    ),
    Mutant(
        "router resumes one time past max_resumes",
        "core/placement.py",
        'if kind == "failed" or req.resumes - req.full_resumes >= self.config.max_resumes:',
        'if kind == "failed" or req.resumes - req.full_resumes > self.config.max_resumes:',
    ),
    Mutant(
        "router accepts a heartbeat of an epoch it retired",
        "core/slots.py",
        "            beat.epoch <= self.gone_epoch\n            or beat.epoch < self.epoch\n",
        "            beat.epoch < self.epoch\n",
    ),
    Mutant(
        "router places a dropped attempt again before releasing it",
        "core/requests.py",
        "            return\n        self._release(req, out)\n"
        '        self._attempt_lost(req, "worker_lost", "worker dropped the assignment", out)\n',
        "            return\n"
        '        self._attempt_lost(req, "worker_lost", "worker dropped the assignment", out)\n',
    ),
    Mutant(
        "router does not cancel a late accept",
        "core/slots.py",
        '                self._fenced["orphan"] += 1\n'
        "                out.append(SendToWorker(worker_id, Cancel(assignment)))\n",
        '                self._fenced["orphan"] += 1\n',
    ),
    Mutant(
        "router leaves orphans its heartbeats list running",
        "core/fleet.py",
        '                if state is None:\n                    self._fenced["orphan"] += 1\n'
        "                out.append(SendToWorker(worker.worker_id, Cancel(assignment)))\n",
        '                if state is None:\n                    self._fenced["orphan"] += 1\n'
        "                else:\n"
        "                    out.append(SendToWorker(worker.worker_id, Cancel(assignment)))\n",
    ),
    Mutant(
        "worker evicts its newest retained output",
        "core/worker.py",
        "                self._retained.popitem(last=False)\n",
        "                self._retained.popitem(last=True)\n",
    ),
    Mutant(
        "worker lets a decoder that skipped an index go on",
        "core/worker.py",
        '            self._fenced["gap"] += 1\n'
        '            self._end(assignment, "failed", E.DECODER_SKIPPED, out)\n',
        '            self._fenced["gap"] += 1\n',
    ),
    Mutant(
        "batching forgets the decodes' share of a step",
        "core/batching.py",
        "budget, largest = limits.max_step_tokens - len(decode), limits.max_prefill_tokens",
        "budget, largest = limits.max_step_tokens, limits.max_prefill_tokens",
    ),
    # Issue 16: progress deadlines (a decoder that hangs while its worker heartbeats).
    Mutant(
        "router never arms the progress deadline",
        "core/ledger.py",
        "        out.append(ArmTimer(ProgressTimer(req.active), req.progress_by))\n\n",
        "\n",
    ),
    Mutant(
        "router's progress deadline fires but fences nothing",
        "core/requests.py",
        "        worker_id = req.worker_id\n        assert worker_id is not None\n"
        "        # Its decoder is hung",
        "        return\n        # Its decoder is hung",
    ),
    # Issue 16: worker ids and epochs handed out by the router.
    Mutant(
        "router lets a duplicate id evict the live worker",
        "core/fleet.py",
        "        if live and not takeover:\n",
        "        if False:\n",
    ),
    Mutant(
        "router takes a heartbeat from the future for a restart",
        "core/fleet.py",
        "        if beat.epoch > self.assigned.get(worker_id, beat.epoch):\n",
        "        if False:\n",
    ),
    # Issue 17: the paged KV cache's bookkeeping and cache-aware routing.
    Mutant(
        "block manager frees a block another sequence still holds",
        "core/blocks.py",
        "            if self._refs[block] == 0:\n                if block in self._key_of:",
        "            if self._refs[block] <= 1:\n                if block in self._key_of:",
    ),
    Mutant(
        "block chain key ignores the parent block",
        "core/blocks.py",
        '    digest.update(parent.to_bytes(8, "little"))\n',
        "",
    ),
    Mutant(
        "router trusts a cache report as fresh forever",
        "core/slots.py",
        "        if report is None or self.now - worker.cache_seen_at > "
        "self.config.cache_report_max_age_s:\n",
        "        if report is None:\n",
    ),
    # Several routers sharing workers (issue 19).
    Mutant(
        "worker's lost link ends every router's work",
        "core/worker.py",
        "        for assignment in [a for a in self._active if a.router == router]:\n",
        "        for assignment in list(self._active):\n",
    ),
    Mutant(
        "worker keeps a lost router's work running",
        "core/worker.py",
        "        for assignment in [a for a in self._active if a.router == router]:\n",
        "        for assignment in [a for a in self._active if a.router == router][:0]:\n",
    ),
    Mutant(
        "worker supersedes another router's request of the same id",
        "core/worker.py",
        "            if assignment.request_id == offered.request_id and assignment.router == "
        "offered.router:\n",
        "            if assignment.request_id == offered.request_id:\n",
    ),
    Mutant(
        "worker lists every router's work to each router",
        "core/worker.py",
        "            active=tuple(a for a in self._active if a.router == router),\n",
        "            active=tuple(self._active),\n",
    ),
    Mutant(
        "worker counts free slots per router",
        "core/worker.py",
        "        if self.free_slots <= 0 or self.draining:\n",
        "        mine = sum(a.router == offer.assignment.router for a in self._active)\n"
        "        if self.config.slots - mine <= 0 or self.draining:\n",
    ),
    Mutant(
        "worker checks an offer's epoch against its first link",
        "core/worker.py",
        "        if offer.epoch != link.epoch:\n",
        "        if offer.epoch != next(iter(self._links.values())).epoch:\n",
    ),
    Mutant(
        "router spends an attempt on a full shared worker",
        "core/requests.py",
        '        self._attempt_lost(req, "no_worker", f"declined: {result.reason}", out, '
        "full=full)\n",
        '        self._attempt_lost(req, "no_worker", f"declined: {result.reason}", out)\n',
    ),
    # Issue 39: seed 2003898's cause. An offer landing after its own cancel (a quiet
    # link reorders too) counted as a second copy of one offer, a fence only a
    # duplicating network can move: the accounting lies about what the network did.
    Mutant(
        "worker takes an offer its cancel overtook for a duplicate",
        "core/worker.py",
        '            self._fenced["offer_after_cancel"] += 1\n',
        '            self._fenced["duplicate_offer"] += 1\n',
    ),
    # Issue 35: the fences of a handoff.
    Mutant(
        "router takes tokens from the worker that handed off",
        "core/requests.py",
        '        if req.active != assignment:\n            self._fenced["stale_attempt"] += 1\n',
        "        if req.handoff == (worker_id, assignment):\n            return req\n"
        '        if req.active != assignment:\n            self._fenced["stale_attempt"] += 1\n',
    ),
    Mutant(
        "router cancels a handed-off stream before the new accept",
        "core/requests.py",
        "            req.handoff = (worker_id, assignment)\n",
        "            req.handoff = (worker_id, assignment)\n"
        "            out.append(SendToWorker(worker_id, Cancel(assignment)))\n",
    ),
    Mutant(
        "worker hands a router other routers' assignments",
        "core/worker.py",
        "                held = tuple(a for a in self._active if a.router == router)\n",
        "                held = tuple(self._active)\n",
    ),
    # Issue 34: the decoders' scheduler (core/scheduler.py), which the simulated workers
    # run over pools small enough to preempt.
    Mutant(
        "scheduler preempts the oldest sequence",
        "core/scheduler.py",
        "                victim = next(reversed(self._running))\n",
        "                victim = next(iter(self._running))\n",
    ),
    Mutant(
        "scheduler keeps a preempted sequence's blocks",
        "core/scheduler.py",
        "        entry.state = SEQUENCE.next(entry.state, SeqEvent.PREEMPTED)\n"
        "        self.pool.release(key)\n",
        "        entry.state = SEQUENCE.next(entry.state, SeqEvent.PREEMPTED)\n",
    ),
    Mutant(
        "scheduler re-admits a preempted sequence without its output",
        "core/scheduler.py",
        "        entry.context = len(entry.tokens)\n"
        "        entry.prefilled, entry.chain = 0, None\n",
        "        entry.prefilled, entry.chain = 0, None\n",
    ),
    Mutant(
        "scheduler counts a recomputed output as new output",
        "core/scheduler.py",
        "        entry.context = len(entry.tokens)\n",
        "        entry.tokens += entry.tokens[entry.context :]\n"
        "        entry.context = len(entry.tokens)\n",
    ),
    Mutant(
        "scheduler grows a block before the boundary",
        "core/scheduler.py",
        "            positions = len(entry.tokens)  # the last token's position is written next\n",
        "            positions = len(entry.tokens) + 1\n",
    ),
    Mutant(
        "scheduler puts a preempted sequence at the back of the queue",
        "core/scheduler.py",
        "        self._waiting = {key: entry, **self._waiting}\n",
        "        self._waiting[key] = entry\n",
    ),
    # Issue 34, item 5: each killed only by the oracle or fault named in simulator.md.
    Mutant(
        "block manager shares a whole cached context",
        "core/blocks.py",
        "        usable = (len(tokens) - 1) // self.block_size"
        "  # keep at least one token to compute\n",
        "        usable = len(tokens) // self.block_size\n",
    ),
    Mutant(
        "router gives a missing hold two heartbeat timeouts",
        "core/fleet.py",
        "            if self.now - record.missing_since < self.config.heartbeat_timeout_s:\n",
        "            if self.now - record.missing_since < 2 * self.config.heartbeat_timeout_s:\n",
    ),
    Mutant(
        "router takes a timed-out offer for a stuck decoder",
        "core/requests.py",
        '            self._attempt_lost(req, "no_worker", "offer timed out", out)\n',
        "            self.fleet.progress_missed(req.worker_id)\n"
        '            self._attempt_lost(req, "no_worker", "offer timed out", out)\n',
    ),
    Mutant(
        "draining worker leaves the streams it hands off out of its heartbeats",
        "core/worker.py",
        "            active=tuple(a for a in self._active if a.router == router),\n",
        "            active=tuple(\n"
        "                a for a in self._active if a.router == router and not self.handing_off\n"
        "            ),\n",
    ),
    Mutant(
        "router counts the declined offer's slot as free",
        "core/slots.py",
        "            worker.others = max(worker.others, worker.slots - len(worker.holds))\n",
        "            worker.others = max(worker.others, worker.slots - len(worker.holds) - 1)\n",
    ),
    Mutant(
        "router completes a Finished that overtook its acceptance without accepting",
        "core/requests.py",
        "        if req.phase is P.OFFERED:\n            self._accept(req, out)\n"
        "        if finished.completion_tokens == req.delivered:\n",
        "        if finished.completion_tokens == req.delivered:\n",
    ),
    Mutant(
        "router rate-limits Resend by the offer timeout",
        "core/ledger.py",
        "        if last is not None and self.now - last < self.config.resend_interval_s:\n",
        "        if last is not None and self.now - last < self.config.offer_timeout_s:\n",
    ),
    Mutant(
        "router delivers only the first token of a resent run",
        "core/requests.py",
        "        for index in range(req.delivered, budget_end):\n",
        "        for index in range(req.delivered, min(budget_end, req.delivered + 1)):\n",
    ),
)


@dataclass(frozen=True)
class MutantResult:
    mutant: Mutant
    killed: bool
    seeds_needed: int | None
    violation: str


def _patched_tree(mutant: Mutant, into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("core", "sim", "adapters"):
        shutil.copytree(ROOT / package, into / package, ignore=ignore)
    target = into / mutant.path
    source = target.read_text()
    for original, mutated in mutant.patches():
        if source.count(original) != 1:
            raise RuntimeError(f"mutant {mutant.name!r} no longer applies to {mutant.path}")
        source = source.replace(original, mutated)
    target.write_text(source)


def run_mutant(mutant: Mutant, seeds: int, start: int, timeout_s: float) -> MutantResult:
    with tempfile.TemporaryDirectory(prefix="fencepost-mutant-") as folder:
        tree = Path(folder)
        _patched_tree(mutant, tree)
        command = [sys.executable, "-m", "adapters.cli", "sim", "--seeds", str(seeds)]
        command += ["--start", str(start), "--determinism-every", str(10**9)]
        env = os.environ | {"PYTHONPATH": str(tree)}
        done = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    found = re.search(r"^VIOLATION at seed (\d+): (.*)$", done.stdout, re.MULTILINE)
    if found is None:
        if done.returncode != 0:
            raise RuntimeError(f"mutant {mutant.name!r} crashed the sweep:\n{done.stderr}")
        return MutantResult(mutant, False, None, "")
    seed = int(found.group(1))
    return MutantResult(mutant, True, seed - start + 1, found.group(2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=positive, default=500, help="most seeds per mutant")
    parser.add_argument("--start", type=natural, default=0)
    parser.add_argument("--timeout", type=positive, default=600, help="seconds per mutant")
    parser.add_argument(
        "--only", metavar="TEXT", default="", help="only the mutants whose name contains TEXT"
    )


def run(args: argparse.Namespace) -> int:
    seeds, start = args.seeds, args.start
    chosen = [m for m in MUTANTS if args.only in m.name]
    print(f"mutation check: {len(chosen)} mutants, up to {seeds} seeds each from seed {start}")
    results = []
    for mutant in chosen:
        result = run_mutant(mutant, seeds, start, args.timeout)
        results.append(result)
        if result.killed:
            line = f"killed after {result.seeds_needed} seed(s): {result.violation[:90]}"
        else:
            line = "SURVIVED"
        print(f"  {mutant.name:52} {line}")
    killed = sum(r.killed for r in results)
    print(f"kill rate: {killed}/{len(results)}")
    return 0 if killed == len(results) else 1
