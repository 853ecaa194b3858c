"""The decode step at fixed shapes, replayed as CUDA graphs on a GPU.

On a GPU the eager decode step is host-bound: a few hundred small kernels
launched one by one from Python each step. Here the step's inputs live in
static device buffers (token ids, positions, block tables padded to the
widest a sequence can have), the forward pass reads nothing else, and on
CUDA one graph per batch size of BUCKETS (up to the engine's rows) is
captured at start and replayed each step: one copy of the inputs to the
device, one replay, and the logits are read where the graph wrote them.

A step of n rows runs the smallest bucket that holds n; the rows past n are
padding: token 0 at position 0 through a table of nothing but the runner's
scratch block (a block no sequence is ever given), so they write and read
only that block and never touch a live cache entry. Attention reads each
row up to its own length (paged_attention.py; the kind is chosen at start by
measurement).

Without capture (CPU, `graphs=False`, or a capture that failed: logged, and
an error when graphs were insisted on) the same function runs eagerly on
the same buffers: that is how the CPU tests check the padded step against
the eager one token for token, and the eager fallback on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from adapters.engine.layers.attention import padded_table
from adapters.engine.paged_attention import GatherAttention, TritonAttention
from adapters.engine.runner import Runner

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP = 32  # past SMALL_BUCKETS, every multiple of this up to the row limit
# A replay further than this from the uncaptured step (in logits) is a broken capture;
# within it, rounding of a differently chosen library kernel.
REPLAY_TOLERANCE = 0.05


def buckets(rows: int) -> list[int]:
    """The batch sizes captured for an engine of at most `rows` rows (rows included)."""
    sizes = [size for size in SMALL_BUCKETS if size < rows]
    sizes += list(range(BUCKET_STEP * 2, rows, BUCKET_STEP))
    return [*sizes, rows]


class StaticDecode:
    """Decode steps of up to `rows` rows on `runner` at fixed shapes."""

    def __init__(
        self,
        runner: Runner,
        rows: int,
        attention: GatherAttention | TritonAttention,
        graphs: bool,
        say: Callable[[str], None] = lambda line: None,
        insist: bool = False,
    ) -> None:
        self.runner = runner
        self.attention = attention
        self.sizes = buckets(rows)
        self.width = -(-runner.max_context // runner.block_size)
        device = runner.device
        most = self.sizes[-1]
        pin = device.type == "cuda"
        # Host side: filled by the step, copied in one go (pinned: the copy does not wait).
        self._host = torch.zeros((most, 2 + self.width), dtype=torch.int64, pin_memory=pin)
        self._inputs = torch.zeros((most, 2 + self.width), dtype=torch.int64, device=device)
        self._host[:, 2:] = runner.scratch_block
        self._inputs.copy_(self._host)
        # Marks the end of each step's copy out of `_host` (CUDA; None elsewhere).
        self._copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, Any] = {}
        if graphs:
            try:
                self._capture(say)
                self.check_replays(say)
            except Exception as error:  # a capture that fails: the same step, uncaptured
                self._graphs.clear()
                self._outputs.clear()
                if insist:
                    raise
                say(
                    f"decode graphs: capture failed ({type(error).__name__}: {error}); decode "
                    "steps run the same fixed-shape step without capture"
                )

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def run(self, tables: list[list[int]], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step: each row's token at its position,
        written and attended through its block table. The result is a view of a
        buffer the next step overwrites: use it before then."""
        rows = len(tokens)
        size = next((s for s in self.sizes if s >= rows), None)
        if size is None:
            raise ValueError(f"{rows} rows is more than the {self.sizes[-1]} of this step")
        runner = self.runner
        block_size, scratch = runner.block_size, runner.scratch_block
        used = max(positions) // block_size + 1  # table entries the widest row reads
        lines = [
            [token, position, *padded_table(table, used, scratch)]
            for table, position, token in zip(tables, positions, tokens, strict=True)
        ]
        host = self._host
        # The last step's copy out of the pinned buffer may still be in flight (it does
        # not wait for the host): let it finish before the buffer is written again. In
        # the engine the last step's sampled tokens were read back (`.tolist()`) after
        # its copy, which had therefore ended; this wait keeps it so for any caller.
        if self._copied is not None:
            self._copied.synchronize()
        # Past `used` a row keeps whatever ids an earlier step left: read by no row's length.
        host[:rows, : 2 + used] = torch.tensor(lines)
        host[rows:size, :2] = 0  # padding: token 0 at position 0 in the scratch block
        host[rows:size, 2:] = scratch
        self._inputs[:size].copy_(host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if runner.check_indices:  # what the kernels read: the device's copy, padding included
            inputs = self._inputs[:size]
            runner.check_step("decode (fixed-shape inputs)", inputs[:, 0], inputs[:, 1],
                              inputs[:, 2:], live=rows)  # fmt: skip
        graph = self._graphs.get(size)
        if graph is None:
            logits: torch.Tensor = self._forward(size)
            return logits[:rows]
        graph.replay()
        return self._outputs[size][:rows]

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        inputs = self._inputs[:size]
        tokens, positions, tables = inputs[:, 0], inputs[:, 1], inputs[:, 2:]
        attend = self.attention.bind(tables, positions + 1)
        return self.runner.forward_static(tokens, positions, tables, attend)

    def _capture(self, say: Callable[[str], None]) -> None:
        """One graph per bucket, largest first, all in one memory pool (a graph's
        temporaries are free again once it ends, so the smaller ones reuse them)."""
        device = self.runner.device
        began = time.perf_counter()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm up: triton compiles, the allocator settles
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls made meanwhile by other threads of the process (a
            # library's background thread, a benchmark's abandoned call) neither fail
            # nor spoil this capture; only this thread's own unsafe calls are errors.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._outputs[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - before
        taken = free_before - torch.cuda.mem_get_info(device)[0]
        say(
            f"decode graphs: {len(self.sizes)} batch sizes ({self._size_list()}) captured in "
            f"{time.perf_counter() - began:.1f} s, {self.attention.name} attention; "
            f"outputs hold {held / 2**20:.0f} MiB, the device {taken / 2**20:.0f} MiB more"
        )

    def check_replays(self, say: Callable[[str], None] = lambda line: None) -> None:
        """Replay the smallest graph and the largest of at most one block's rows on made-up
        rows in the scratch block against the same step run uncaptured: the same kernels
        on the same inputs should agree bit for bit. A replay that misses by more than
        rounding (stale buffers, a wrong capture) raises; one within rounding (a library
        choosing another algorithm under capture) is kept and said.

        Real rows sit at positions 1.. of the scratch block, each writing a slot of its
        own; the padding rows all write position 0, the same values from the same
        token, so which write lands last changes nothing."""
        block_size, scratch = self.runner.block_size, self.runner.scratch_block
        small = [size for size in self.sizes if size <= block_size - 1]
        for size in sorted({self.sizes[0], *small[-1:]}):
            rows = min(size, block_size - 1)
            replayed = self.run([[scratch]] * rows, list(range(1, rows + 1)), [1] * rows)
            replayed = replayed.clone()
            uncaptured = self._forward(size)[:rows]
            if torch.equal(replayed, uncaptured):
                continue
            gap = (replayed.float() - uncaptured.float()).abs().max()
            if not torch.allclose(
                replayed, uncaptured, rtol=REPLAY_TOLERANCE, atol=REPLAY_TOLERANCE
            ):
                raise RuntimeError(f"the graph of {size} rows replays differently by {gap:.3g}")
            say(f"decode graphs: the graph of {size} rows replays within {gap:.3g} of the "
                "uncaptured step, not bit for bit")  # fmt: skip

    def _size_list(self) -> str:
        sizes = self.sizes
        return ", ".join(map(str, sizes)) if len(sizes) <= 10 else f"{sizes[0]}..{sizes[-1]}"
