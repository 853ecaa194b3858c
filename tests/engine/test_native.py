"""The native CPU kernels (adapters/engine/native.c) against references written in torch.

Each instruction set this CPU has is built and tested; the AVX-512 and AVX2 builds
must agree bit for bit (native.c: every output is the same sequence of operations).
"""

from __future__ import annotations

import pytest
import torch

from adapters.engine import native
from adapters.engine.native import NativeProduct, pack4, pack8, unpack
from adapters.engine.native_build import (
    ISAS,
    Library,
    NativeUnavailable,
    cpu_flags,
    load,
    pick_isa,
)
from adapters.engine.runner import Runner
from tests.conftest import native_library
from tests.engine.test_engine import PROMPTS, tiny_llama
from tests.support.tiny_models import loaded_of


def quantized(x: torch.Tensor, act_bytes: int = 2) -> torch.Tensor:
    """The activations a native product multiplies, in float64: each row's groups of 32
    as 16-bit integers 128 * hi + lo at step max|x| / 127 / 128 (two bytes), or as hi
    alone at step max|x| / 127 (one byte): native.c's quantize, written again."""
    groups = x.double().reshape(x.shape[0], -1, 32)
    d = (groups.float().abs().amax(dim=-1, keepdim=True) / 127).double()  # fp32, as in C
    safe = torch.where(d > 0, d, torch.ones((), dtype=torch.float64))
    hi = torch.round(groups / safe)
    if act_bytes == 1:
        return (hi * d).reshape(x.shape)
    lo = torch.round((groups - hi * d) / safe * 128).clamp(-127, 127)
    return ((hi * 128 + lo) * d / 128).reshape(x.shape)


def reference(weight: torch.Tensor, x: torch.Tensor, act_bytes: int = 2) -> torch.Tensor:
    """What a native product computes, in float64: the quantized activations times the
    weights as the kernels use them."""
    return quantized(x, act_bytes) @ weight.double().T


def q4_1_weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Weights already on a Q4_1 grid (q * d + m, fp16 d and m, each group reaching 0
    and 15), as a GGUF's dequantized 4-bit matrix is."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features // 32, 32), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, in_features // 32, 1, generator=generator) * 0.01 + 1e-3).half()
    m = (-torch.rand(out_features, in_features // 32, 1, generator=generator) * 0.05).half()
    return (q.float() * d.float() + m.float()).reshape(out_features, in_features)


def test_packing_keeps_q4_1_and_q8_0_weights_exactly(
    library: Library, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = q4_1_weights(40, 96, seed=1)  # 40 rows: the last tile is padded
    assert torch.equal(unpack(pack4(weight, library.tile), 4, 40, 96), weight)
    generator = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (40, 3, 32), generator=generator)
    q[..., 0] = 127  # a Q8_0 block's largest magnitude is 127 steps
    d = (torch.rand(40, 3, 1, generator=generator) * 0.01 + 1e-3).half().float()
    weight8 = (q.float() * d).reshape(40, 96)
    assert torch.equal(unpack(pack8(weight8, library.tile), 8, 40, 96), weight8)
    # packed a few tiles at a time, the bytes are the whole matrix's
    tall = torch.randn(5 * library.tile + 3, 96)
    for bits, pack in ((4, pack4), (8, pack8)):
        with monkeypatch.context() as patch:
            patch.setattr(native, "PACK_ROWS", 2 * library.tile)
            parts = native.pack_in_parts(tall, bits, library.tile)
            assert torch.equal(parts, pack(tall, library.tile))


@pytest.mark.parametrize("act_bytes", [2, 1])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16])
def test_products_equal_the_float64_reference(
    library: Library, bits: int, rows: int, act_bytes: int
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(53, 160) * 0.05  # 53 outputs: tiles of 16 or 8 and a partial one
    product = NativeProduct(weight, bits, library, act_bytes=act_bytes)
    x = torch.randn(rows, 160) * 3
    x[0, 5] = 40.0  # an outlier sets a group's step; the low byte keeps its neighbours
    got = product(x)
    expected = reference(product.dense(), x, act_bytes)
    assert got.dtype == torch.float32 and got.shape == (rows, 53)
    assert float((got.double() - expected).abs().max()) < 1e-5 * float(expected.abs().max())
    # and against the plain float product: two bytes lose ~15 bits' worth only, one
    # byte (steps of max|x| / 127 a group) about 1% here, the outlier's group the worst
    exact = x.double() @ product.dense().double().T
    error = float((got.double() - exact).norm() / exact.norm())
    assert error < (1e-4 if act_bytes == 2 else 3e-2)
    if act_bytes == 1:  # one byte is not two: the reference above tells them apart
        assert error > 1e-3
        two = reference(product.dense(), x, 2)
        assert float((got.double() - two).abs().max()) > 1e-4 * float(two.abs().max())


def test_the_activation_width_is_one_or_two_bytes(library: Library) -> None:
    with pytest.raises(ValueError, match="1 or 2 bytes"):
        NativeProduct(torch.randn(8, 32), 4, library, act_bytes=3)
    product = NativeProduct(torch.randn(8, 32), 4, library)
    with pytest.raises(ValueError, match="1 or 2 bytes"):
        library.matmul(product.mat, torch.randn(1, 32), torch.empty(1, 8), act_bytes=0)


@pytest.mark.parametrize("act_bytes", [2, 1])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_computed_the_same_alone_and_in_any_batch(
    library: Library, bits: int, act_bytes: int
) -> None:
    torch.manual_seed(9)
    product = NativeProduct(torch.randn(70, 96) * 0.05, bits, library, act_bytes=act_bytes)
    x = torch.randn(13, 96)  # passes of 6 (or 3), then the rest
    together = product(x)
    for row in range(13):
        assert torch.equal(product(x[row : row + 1])[0], together[row])
    assert torch.equal(product(x[3:11]), together[3:11])


def test_the_avx512_and_avx2_builds_agree_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    wide, narrow = native_library("avx512"), native_library("avx2")
    torch.manual_seed(5)
    for bits in (4, 8):
        for width in (2, 1):
            weight, x = torch.randn(100, 128) * 0.05, torch.randn(9, 128)
            assert torch.equal(
                NativeProduct(weight, bits, wide, act_bytes=width)(x),
                NativeProduct(weight, bits, narrow, act_bytes=width)(x),
            )
    model, prompt = tiny_llama(), torch.tensor(PROMPTS[2])
    for fmt in ("w4a16", "w4a8"):
        logits = []
        for isa in ("avx512", "avx2"):  # the whole fused pass, each build its own tiles
            monkeypatch.setenv("FENCEPOST_NATIVE", isa)
            runner = Runner(loaded_of(model), 8, 16, 64, fmt)
            assert runner.lm_head.library.isa == isa  # type: ignore[attr-defined]
            logits.append(runner.prefill([0, 1], 0, prompt, True))
        assert torch.equal(logits[0], logits[1])


def _runner(blocks: int = 16, fmt: str = "w4a16") -> Runner:
    return Runner(loaded_of(tiny_llama()), blocks, 16, 128, fmt)


@pytest.mark.parametrize("fmt", ["w4a16", "w4a8"])
def test_the_fused_pass_computes_what_the_torch_forward_does_with_native_products(
    fmt: str,
) -> None:
    prompt = torch.tensor(PROMPTS[2])
    fused = _runner(fmt=fmt).prefill([0, 1], 0, prompt, True)
    composed_runner = _runner(fmt=fmt)
    composed_runner._native = None  # the torch forward, native products, an fp32 cache
    composed_runner.k_cache = composed_runner.k_cache.float()
    composed_runner.v_cache = composed_runner.v_cache.float()
    composed = composed_runner.prefill([0, 1], 0, prompt, True)
    fp32 = Runner(loaded_of(tiny_llama()), 16, 16, 128, "fp32").prefill([0, 1], 0, prompt, True)
    # the fused pass keeps keys and values in fp16: that rounding, nothing else (with
    # one-byte activations a nudge can move a value across a step: 0.8% here)
    bound = 2e-3 if fmt == "w4a16" else 2e-2
    assert float((fused - composed).norm() / composed.norm()) < bound
    assert float((fused - fp32).norm() / fp32.norm()) < 0.12  # random weights at 4 bits


@pytest.mark.parametrize("fmt", ["w4a16", "w4a8"])
def test_a_decoded_position_equals_a_prefilled_one_and_any_batch_leaves_rows_alone(
    fmt: str,
) -> None:
    """What resumes and batching rely on: the same row gets the same bits whether its
    position was prefilled in a chunk or decoded, alone or beside other rows."""
    prompt = torch.tensor(PROMPTS[2])  # 19 tokens over two blocks
    whole = _runner(fmt=fmt).prefill([0, 1], 0, prompt, True)
    stepwise = _runner(fmt=fmt)
    stepwise.prefill([0, 1], 0, prompt[:5], True)  # a first chunk, then token by token
    for position in range(5, len(prompt)):
        pages = stepwise.pages([[0, 1]], position + 1)
        got = stepwise.decode(pages, torch.tensor([position]), prompt[position : position + 1])
        assert torch.equal(got[0], whole[position])
    batch = _runner(fmt=fmt)
    other = torch.tensor(PROMPTS[0])
    batch.prefill([2], 0, other, False)
    batch.prefill([0, 1], 0, prompt[:10], False)
    pages = batch.pages([[2], [0, 1]], 11)
    got = batch.decode(pages, torch.tensor([len(other), 10]), torch.tensor([5, int(prompt[10])]))
    assert torch.equal(got[1], whole[10])


def test_the_instruction_set_is_picked_from_the_cpu_flags() -> None:
    assert pick_isa({"avx2", "fma", "f16c"}) == "avx2"
    every = {flag for needed, _, _ in ISAS.values() for flag in needed}
    assert pick_isa(every) == "avx512"
    assert pick_isa(every, "avx2") == "avx2"
    with pytest.raises(NativeUnavailable, match="neither"):
        pick_isa({"sse4_2"})
    with pytest.raises(NativeUnavailable, match="avx512_vnni"):
        pick_isa({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, "avx512")
    assert isinstance(cpu_flags(), set)


def test_turned_off_or_without_a_compiler_the_format_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from adapters.engine import native_build
    from adapters.engine.choose import working_formats

    monkeypatch.setenv("FENCEPOST_NATIVE", "off")
    with pytest.raises(NativeUnavailable, match="FENCEPOST_NATIVE"):
        load()
    working = working_formats(torch.device("cpu"))
    assert "w4a16" not in working and "w4a8" not in working
    monkeypatch.delenv("FENCEPOST_NATIVE")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(NativeUnavailable, match="no C compiler"):
        native_build._compiler()


def test_results_do_not_depend_on_the_thread_count() -> None:
    """Products split by tiles and attention by (row, head): each output is still one
    thread's whole, same-order sum."""
    before = torch.get_num_threads()
    try:
        torch.manual_seed(11)
        product = NativeProduct(torch.randn(300, 256) * 0.05, 4)
        x = torch.randn(7, 256)
        prompt = torch.tensor(PROMPTS[2])
        products, passes = [], []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            products.append(product(x))
            passes.append(_runner().prefill([0, 1], 0, prompt, True))
        assert all(torch.equal(products[0], p) for p in products[1:])
        assert all(torch.equal(passes[0], p) for p in passes[1:])
    finally:
        torch.set_num_threads(before)


def test_ids_the_c_code_would_read_out_of_bounds_are_refused_first() -> None:
    runner = _runner(blocks=4)
    assert runner._native is not None
    tables = torch.tensor([[0, 1]])
    for tokens, positions, table in (
        (torch.tensor([97]), torch.tensor([3]), tables),  # vocabulary is 97
        (torch.tensor([-1]), torch.tensor([3]), tables),
        (torch.tensor([5]), torch.tensor([128]), tables),  # context is 128
        (torch.tensor([5]), torch.tensor([3]), torch.tensor([[0, 4]])),  # pool is 4 blocks
        (torch.tensor([5]), torch.tensor([40]), tables),  # two blocks cover 32 positions
    ):
        with pytest.raises(IndexError):
            runner._native.forward(tokens, positions, table)
    assert runner._native.forward(torch.tensor([5]), torch.tensor([3]), tables).shape == (1, 97)


def test_a_model_whose_shapes_the_fused_pass_cannot_take_is_left_to_torchs_formats() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from adapters.engine.choose import working_formats
    from adapters.engine.native import model_problem

    plain = loaded_of(tiny_llama()).spec
    assert model_problem(plain) is None
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=12,  # head_dim 8
        num_key_value_heads=4,
    )
    odd = LlamaForCausalLM(config).eval()
    assert "head_dim 8" in (model_problem(loaded_of(odd).spec) or "")
    assert "block size" in (model_problem(plain, block_size=24) or "")
    assert "w4a16" not in working_formats(torch.device("cpu"), loaded_of(odd).spec)
    with pytest.raises(ValueError, match="head_dim 8"):
        Runner(loaded_of(odd), 4, 16, 32, "w4a16")
