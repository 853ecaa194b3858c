"""The fixed-shape decode step (what a GPU captures as graphs) and its attention, on CPU.

The padded step must give the eager step's tokens; its padding rows must
never touch a live cache entry; the triton kernel (run by triton's
interpreter here) must attend as the torch gather does, and a row's result
must not depend on the rows beside it. (tests/conftest.py puts triton in
interpreter mode for the whole run.)
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from adapters.engine.engine import Engine
from adapters.engine.model import LoadedModel
from adapters.engine.paged_attention import (
    Attend,
    GatherAttention,
    SdpaAttention,
    TritonAttention,
    choose_attention,
    triton_problem,
)
from adapters.engine.runner import Chunk, Runner
from adapters.engine.spec import Attention
from adapters.engine.static_decode import StaticDecode, buckets
from core.batching import BatchLimits
from core.protocol import GenerationRequest, Sampling
from tests.engine.test_engine import PROMPTS, run, tiny_llama
from tests.support.tiny_models import loaded_of

triton = pytest.importorskip("triton", reason="triton (a dev dependency) runs the kernel here")

# A layer with no window and no cap: what every kind attends alike.
PLAIN = Attention(heads=8, kv_heads=2, head_dim=32, scale=1.0)


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return tiny_llama()


def engine(model: LlamaForCausalLM, max_seqs: int = 4, **options: str) -> Engine:
    limits = BatchLimits(max_seqs=max_seqs, max_context=128, max_step_tokens=16)
    loaded = LoadedModel.from_model(model, None, "tiny", frozenset(), 128, "built in the test")
    return Engine(loaded, limits, **options)  # type: ignore[arg-type]


def test_buckets_cover_every_batch_size_up_to_the_rows() -> None:
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(256) == [1, 2, 4, 8, 16, 24, 32, *range(64, 257, 32)]
    assert buckets(100) == [1, 2, 4, 8, 16, 24, 32, 64, 96, 100]


REQUESTS = [
    *(GenerationRequest(f"g{i}", p, 18) for i, p in enumerate(PROMPTS)),
    GenerationRequest("s", PROMPTS[0], 21, Sampling(1.0, 0.9, 1234)),
    GenerationRequest("t", PROMPTS[2], 15, Sampling(0.7, 1.0, 7)),
]


@pytest.mark.parametrize("attention", ["gather", "sdpa", "triton"])
def test_the_padded_step_gives_the_eager_steps_tokens(
    tiny: LlamaForCausalLM, attention: str
) -> None:
    """Five requests over four rows: steps of 1 to 4 rows, padded to buckets 1, 2, 4,
    requests joining and leaving, greedy and seeded sampling."""
    eager = run(engine(tiny), REQUESTS)
    padded = run(engine(tiny, decode="static", attention=attention), REQUESTS)
    assert padded == eager


def test_a_continuation_through_the_padded_step_goes_on_exactly(tiny: LlamaForCausalLM) -> None:
    whole = run(engine(tiny, decode="static", attention="triton"), REQUESTS[:4])
    cuts = (1, 5, 9, 13)
    resumed = [
        msgspec.structs.replace(r, output_prefix=tuple(int(t) for t in whole[r.request_id][:k]))  # type: ignore[call-overload]
        for r, k in zip(REQUESTS[:4], cuts, strict=True)
    ]
    again = run(engine(tiny, decode="static", attention="triton"), resumed)
    for r, k in zip(REQUESTS[:4], cuts, strict=True):
        assert again[r.request_id] == whole[r.request_id][k:]


def test_padding_rows_touch_only_the_scratch_block(tiny: LlamaForCausalLM) -> None:
    runner = Runner(loaded_of(tiny), num_blocks=12, block_size=16, max_context=128)
    generator = torch.Generator().manual_seed(3)
    runner.k_cache.copy_(torch.randn(runner.k_cache.shape, generator=generator))
    runner.v_cache.copy_(torch.randn(runner.v_cache.shape, generator=generator))
    before_k, before_v = runner.k_cache.clone(), runner.v_cache.clone()
    step = StaticDecode(runner, 8, GatherAttention(4, 2, 16, 16), graphs=False)
    tables = [[3, 4], [7], [0, 9, 2]]
    positions = [20, 5, 40]
    logits = step.run(tables, positions, [5, 6, 7])  # 3 rows run in the bucket of 4
    assert logits.shape == (3, runner.vocab_size)
    written = {table[p // 16] * 16 + p % 16 for table, p in zip(tables, positions, strict=True)}
    scratch = range(runner.scratch_block * 16, (runner.scratch_block + 1) * 16)
    for slot in range(runner.k_cache.shape[2]):
        if slot in written:
            assert not torch.equal(runner.k_cache[:, :, slot], before_k[:, :, slot])
        elif slot not in scratch:
            assert torch.equal(runner.k_cache[:, :, slot], before_k[:, :, slot]), slot
            assert torch.equal(runner.v_cache[:, :, slot], before_v[:, :, slot]), slot
    assert not torch.equal(runner.k_cache[:, :, scratch[0]], before_k[:, :, scratch[0]])


# Ops that read a device tensor's value on the host (.item(), bool(), nonzero's count) or
# build a tensor from host data (torch.tensor): each stops or breaks a CUDA graph capture.
# (.tolist() on a CPU tensor reads memory without an op of its own: not seen here.)
HOST_READS = {
    "aten._local_scalar_dense.default",
    "aten.item.default",  # what .item() and int() reach under inference_mode
    "aten.is_nonzero.default",  # bool(tensor)
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.lift_fresh.default",
}


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(  # type: ignore[no-untyped-def]
        self, func, types, args=(), kwargs=None
    ):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["gather", "sdpa"])
def test_the_fixed_shape_step_reads_nothing_back_from_the_device(
    tiny: LlamaForCausalLM, attention: str
) -> None:
    """What a capture needs, checked on CPU: the step, as a graph would record it, runs
    no op that reads a tensor's value on the host or makes a tensor of host data.
    (The triton kind launches kernels, which read nothing; under the interpreter
    they copy to numpy, so they are not probed here.)"""
    step = engine(tiny, decode="static", attention=attention).static
    assert step is not None
    recorder = _OpRecorder()
    with recorder:
        step._forward(4)
    assert "aten.index_put_.default" in recorder.ops  # the probe saw the step's cache writes
    assert not recorder.ops & HOST_READS, recorder.ops & HOST_READS
    with recorder, torch.inference_mode():  # and it would have caught one
        int(torch.ones(2).sum())
    assert recorder.ops & HOST_READS


def _random_case(
    kv_heads: int, group: int, dim: int, lengths: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, one layer's k and v caches, tables and lengths: tables of random distinct
    blocks (not runs), the first two rows sharing their first block."""
    block = 16
    generator = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lengths)
    blocks = max(80, width)
    heads = kv_heads * group  # q as the runner hands it: the first heads of q and k
    q = torch.randn(len(lengths), heads + kv_heads, dim, generator=generator)[:, :heads]
    k_cache = torch.randn(kv_heads, blocks * block, dim, generator=generator)
    v_cache = torch.randn(kv_heads, blocks * block, dim, generator=generator)
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:width] for _ in lengths])
    tables[1, 0] = tables[0, 0]
    return q, k_cache, v_cache, tables, torch.tensor(lengths)


@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"),
    [(2, 2, 16), (3, 3, 32), (1, 4, 64)],  # group 3: query heads padded to 4 in the kernel
)
def test_the_triton_kernel_and_sdpa_attend_as_the_torch_gather(
    kv_heads: int, group: int, dim: int
) -> None:
    lengths = [1, 16, 17, 300, 600, 37]  # one position, a block's end, past one span, three
    q, k_cache, v_cache, tables, lengths_t = _random_case(kv_heads, group, dim, lengths, dim)
    heads = kv_heads * group
    kernel = TritonAttention(heads, kv_heads, dim, 16, max_context=640)
    assert kernel.spans == 3  # spans of 256 positions: the 600-position row uses all three
    gather = GatherAttention(heads, kv_heads, dim, 16)
    want = gather.bind(tables, lengths_t)(q, k_cache, v_cache, PLAIN)
    for other in (kernel, SdpaAttention(heads, kv_heads, dim, 16)):
        got = other.bind(tables, lengths_t)(q, k_cache, v_cache, PLAIN)
        assert got.shape == want.shape == (len(lengths), heads * dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Told the longest row, the kernel runs only the spans it needs: the same result.
    fewer = kernel.bind(tables[:4], lengths_t[:4], longest=300)(q[:4], k_cache, v_cache, PLAIN)
    assert torch.equal(
        fewer, kernel.bind(tables[:4], lengths_t[:4])(q[:4], k_cache, v_cache, PLAIN)
    )


@pytest.mark.parametrize(
    ("window", "softcap"),
    [(12, None), (None, 5.0), (300, 30.0), (1, None)],  # Mistral, Gemma 2, both; one key
)
def test_the_triton_kernel_attends_windows_and_soft_caps_as_the_gather(
    window: int | None, softcap: float | None
) -> None:
    """Gemma 2 and 3 and Mistral's layers: a window shorter than some rows, one that cuts
    inside a span of a 600-position row, and scores capped by tanh (large scores, so
    the cap binds)."""
    lengths = [1, 12, 13, 300, 600, 37]
    q, k_cache, v_cache, tables, lengths_t = _random_case(2, 2, 16, lengths, 7)
    layer = Attention(heads=4, kv_heads=2, head_dim=16, scale=2.0, window=window,
                      softcap=softcap)  # fmt: skip
    kernel = TritonAttention(4, 2, 16, 16, max_context=640)
    want = GatherAttention(4, 2, 16, 16).bind(tables, lengths_t)(q, k_cache, v_cache, layer)
    got = kernel.bind(tables, lengths_t)(q, k_cache, v_cache, layer)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = GatherAttention(4, 2, 16, 16).bind(tables, lengths_t)(q, k_cache, v_cache, PLAIN4)
    assert not torch.allclose(got, plain, atol=1e-3), "the window or cap changed nothing"


PLAIN4 = Attention(heads=4, kv_heads=2, head_dim=16, scale=2.0)


def test_long_rows_share_their_work_among_sixteen_spans_and_attend_as_the_gather() -> None:
    """Past 16 spans of 256 positions a row's spans grow by its own length (so a row
    is still the same in any batch), not by max_context: at 8192 the kernel keeps 16
    programs a row and key head, and rows on both sides of 4096 attend exactly."""
    lengths = [5000, 300, 4097, 4096]  # spans of 512 (10 used), 256 (2), 512 (9), 256 (16)
    q, k_cache, v_cache, tables, lengths_t = _random_case(1, 2, 16, lengths, 5)
    kernel = TritonAttention(2, 1, 16, 16, max_context=8192)
    assert kernel.spans == 16
    want = GatherAttention(2, 1, 16, 16).bind(tables, lengths_t)(q, k_cache, v_cache, PLAIN)
    together = kernel.bind(tables, lengths_t)(q, k_cache, v_cache, PLAIN)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-5)
    for row in (0, 2):
        alone = kernel.bind(tables[row : row + 1], lengths_t[row : row + 1], longest=lengths[row])
        assert torch.equal(alone(q[row : row + 1], k_cache, v_cache, PLAIN)[0], together[row])


def test_a_rows_attention_does_not_depend_on_its_batch() -> None:
    lengths = [300, 5, 128, 64]
    q, k_cache, v_cache, tables, lengths_t = _random_case(2, 4, 32, lengths, 11)
    kernel = TritonAttention(8, 2, 32, 16, max_context=512)
    together = kernel.bind(tables, lengths_t)(q, k_cache, v_cache, PLAIN)
    for row in range(len(lengths)):
        alone = kernel.bind(tables[row : row + 1], lengths_t[row : row + 1])
        assert torch.equal(alone(q[row : row + 1], k_cache, v_cache, PLAIN)[0], together[row])


def test_shapes_the_kernel_cannot_take_are_named() -> None:
    assert triton_problem(9, 3, 64) is None
    assert "head size 48" in str(triton_problem(8, 2, 48))
    assert "do not group" in str(triton_problem(9, 2, 64))
    with pytest.raises(ValueError, match="head size"):
        TritonAttention(8, 2, 48, 16, 128)


def test_choosing_on_cpu_takes_the_gather_and_says_why(tiny: LlamaForCausalLM) -> None:
    runner = Runner(loaded_of(tiny), num_blocks=12, block_size=16, max_context=128)
    said: list[str] = []
    assert choose_attention(runner, 4, said.append).name == "gather"
    assert said == ["decode attention: no triton candidate (the CPU path keeps torch's ops)"]


def test_decode_paths_the_engine_cannot_run_are_refused(tiny: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        engine(tiny, decode="graphs")
    with pytest.raises(ValueError, match="unknown decode path"):
        engine(tiny, decode="fast")
    with pytest.raises(ValueError, match="unknown attention"):
        engine(tiny, decode="static", attention="flash")
    assert engine(tiny).static is None  # auto on CPU: the eager step


def test_a_packed_prefill_row_by_row_is_the_per_chunk_prefill(tiny: LlamaForCausalLM) -> None:
    """Three chunks (one starting past a cached prefix) through the triton kernel one row
    per token, against the per-chunk attention: the same logits, the same cache."""
    tables = [[0, 1, 2], [5, 3], [7]]
    starts = [0, 16, 0]
    prompts = [torch.arange(3, 40), torch.arange(50, 61), torch.arange(1, 9)]
    bound: list[int] = []  # rows of each call through the kernel

    class Counted(TritonAttention):
        def bind(
            self, tables: torch.Tensor, lengths: torch.Tensor, longest: int | None = None
        ) -> Attend:
            bound.append(tables.shape[0])
            assert longest is not None  # a prefill knows its longest row: fewer spans
            return super().bind(tables, lengths, longest)

    runners = []
    for rowwise in (False, True):
        runner = Runner(loaded_of(tiny), num_blocks=12, block_size=16, max_context=128)
        if rowwise:
            runner.row_attention = Counted(4, 2, 16, 16, max_context=128)
        runner.prefill([5, 3], 0, torch.arange(20, 36))  # the second chunk's cached prefix
        chunks = [Chunk(t, s, p) for t, s, p in zip(tables, starts, prompts, strict=True)]
        runners.append((runner, runner.prefill_packed(chunks, [36, 47, 55])))
    (plain, want), (rowwise, got) = runners
    assert bound == [16, 37 + 11 + 8]  # the cached prefix's prefill, then all three chunks
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rowwise.k_cache, plain.k_cache, rtol=1e-5, atol=1e-5)


def test_a_failed_capture_falls_back_to_the_uncaptured_step_unless_insisted_on(
    tiny: LlamaForCausalLM,
) -> None:
    """Capturing on a CPU fails (no CUDA): the step says so and runs uncaptured."""
    runner = Runner(loaded_of(tiny), num_blocks=12, block_size=16, max_context=128)
    said: list[str] = []
    step = StaticDecode(runner, 4, GatherAttention(4, 2, 16, 16), graphs=True, say=said.append)
    assert not step.captured
    assert len(said) == 1 and said[0].startswith("decode graphs: capture failed (")
    assert step.run([[0]], [0], [5]).shape == (1, runner.vocab_size)
    with pytest.raises(Exception, match=r"(?i)cuda"):
        StaticDecode(runner, 4, GatherAttention(4, 2, 16, 16), graphs=True, insist=True)


def test_choosing_leaves_out_a_kind_that_disagrees_or_fails(tiny: LlamaForCausalLM) -> None:
    """The kinds are checked against the gather on the same random inputs before they
    are timed: a wrong kernel is never chosen, however fast."""

    class Wrong(GatherAttention):
        name = "wrong"

        def bind(self, tables: torch.Tensor, lengths: torch.Tensor) -> Attend:
            return lambda q, k, v, layer: torch.zeros(q.shape[0], q.shape[1] * q.shape[2])

    class Broken(GatherAttention):
        name = "broken"

        def bind(self, tables: torch.Tensor, lengths: torch.Tensor) -> Attend:
            raise RuntimeError("no kernel for this device")

    runner = Runner(loaded_of(tiny), num_blocks=12, block_size=16, max_context=128)
    shape = (4, 2, 16, 16)
    kinds = [GatherAttention(*shape), Wrong(*shape), Broken(*shape), TritonAttention(*shape, 128)]
    said: list[str] = []
    chosen = choose_attention(runner, 4, said.append, kinds)
    assert chosen.name in ("gather", "triton")
    assert any(
        line.startswith("decode attention: wrong disagrees with an fp32 gather") for line in said
    )
    assert any("broken failed to run (RuntimeError: no kernel" in line for line in said)
    assert "measured for 4 rows at lengths up to 128" in said[-1]
    assert "gather" in said[-1] and "triton" in said[-1] and "wrong" not in said[-1]


def test_the_start_check_of_replays_catches_a_graph_that_computes_otherwise(
    tiny: LlamaForCausalLM,
) -> None:
    """check_replays compares each checked graph's replay with the uncaptured step; here
    a stand-in graph (no CUDA) replays the step itself, then the step plus a little."""
    runner = Runner(loaded_of(tiny), num_blocks=12, block_size=16, max_context=128)
    step = StaticDecode(runner, 24, GatherAttention(4, 2, 16, 16), graphs=False)
    replayed: list[int] = []

    class StandIn:
        def __init__(self, size: int, off: float) -> None:
            self.size, self.off = size, off

        def replay(self) -> None:
            replayed.append(self.size)
            step._outputs[self.size] = step._forward(self.size) + self.off

    step._graphs = {size: StandIn(size, 0.0) for size in step.sizes}
    step.check_replays()
    assert replayed == [1, 8]  # the smallest, and the largest of at most 15 rows
    said: list[str] = []
    step._graphs[8] = StandIn(8, 1e-3)  # rounding: kept, and said
    step.check_replays(said.append)
    assert said == ["decode graphs: the graph of 8 rows replays within 0.001 of the "
                    "uncaptured step, not bit for bit"]  # fmt: skip
    step._graphs[8] = StandIn(8, 0.5)
    with pytest.raises(RuntimeError, match=r"the graph of 8 rows replays differently by 0\.5"):
        step.check_replays()
