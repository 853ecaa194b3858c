"""The fused elementwise kernels (adapters/engine/fused.py) against the torch ops they
replace, run by triton's interpreter (tests/conftest.py), and the engine through them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from adapters.engine import fused, runner
from adapters.engine.fused import (
    fused_problem,
    kernel_problem,
    rms_norm,
    rotate_store,
    silu_gate,
    torch_rms_norm,
    torch_rotate_store,
)
from core.protocol import GenerationRequest, Sampling
from tests.engine.test_engine import PROMPTS, engine, run, tiny_llama

triton = pytest.importorskip("triton", reason="triton (a dev dependency) runs the kernels here")


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("width", [64, 576, 2048])  # 576: the default model, not a power of 2
def test_rms_norm_is_the_torch_norm(width: int) -> None:
    x, weight = _randn(5, width) * 3, _randn(width, seed=1)
    want = torch_rms_norm(x, weight, 1e-5, torch.float32)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5, torch.float32), want)
    halved = rms_norm(x, weight, 1e-5, torch.bfloat16)
    assert halved.dtype == torch.bfloat16
    torch.testing.assert_close(halved.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_store_rotates_q_and_k_and_writes_k_and_v_to_their_slots(
    dtype: torch.dtype,
) -> None:
    rows, heads, kv_heads, dim = 4, 6, 2, 32
    qkv = _randn(rows, (heads + 2 * kv_heads + 1) * dim)[:, : (heads + 2 * kv_heads) * dim]
    qkv = qkv.to(dtype)  # strided rows, as a slice of a wider product would be
    angles = _randn(rows, dim // 2, seed=2).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([7, 0, 12, 3])
    caches = [(_randn(kv_heads, 16, dim, seed=s).to(dtype)) for s in (3, 4)]
    wanted = [cache.clone() for cache in caches]
    q = rotate_store(qkv, cos, sin, heads, caches[0], caches[1], slots)
    want = torch_rotate_store(qkv, cos, sin, heads, wanted[0], wanted[1], slots)
    assert q.shape == (rows, heads, dim) and q.is_contiguous()
    # The same arithmetic in fp32, one rounding: equal to torch's up to its roundings.
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q.float(), want.float(), rtol=tolerance, atol=tolerance)
    for got, expected in zip(caches, wanted, strict=True):
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(rows, kv_heads, dim)
    assert torch.equal(caches[1][:, slots], v.transpose(0, 1))  # v copied as it is
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert torch.equal(caches[0][:, untouched], wanted[0][:, untouched])


@pytest.mark.parametrize("width", [128, 1536, 2500])
def test_silu_gate_is_silu_of_gate_times_up(width: int) -> None:
    gate_up = _randn(3, 2 * width) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_gate(gate_up), F.silu(gate) * up)


def test_the_engine_through_the_fused_kernels_gives_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model: LlamaForCausalLM = tiny_llama()
    requests = [
        *(GenerationRequest(f"g{i}", p, 12) for i, p in enumerate(PROMPTS)),
        GenerationRequest("s", PROMPTS[0], 12, Sampling(1.0, 0.9, 5)),
    ]
    plain = run(engine(model), requests)
    monkeypatch.setattr(runner, "fused_problem", lambda *args: None)
    through = engine(model)
    assert through.runner.fused
    assert run(through, requests) == plain


def test_cpu_and_a_switch_leave_the_kernels_out(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert fused_problem(cpu, 64, 16, gpu_path=False) == "the CPU path keeps torch's ops"
    assert fused_problem(cpu, 64, 16) is None  # the GPU path on a CPU: interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "compiled for CUDA, not cpu" in str(fused_problem(cpu, 64, 16))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("FENCEPOST_FUSED", "off")
    assert fused_problem(torch.device("cuda"), 64, 16) == "FENCEPOST_FUSED=off"
    monkeypatch.delenv("FENCEPOST_FUSED")
    assert "head size 48" in str(fused_problem(torch.device("cuda"), 64, 48))
    assert fused_problem(torch.device("cuda"), 4096, 128) is None


def test_the_start_check_passes_good_kernels_and_names_a_broken_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert kernel_problem(cpu, torch.float32, 576, 64) is None
    assert kernel_problem(cpu, torch.bfloat16, 64, 16) is None
    monkeypatch.setattr(fused, "silu_gate", lambda gate_up: gate_up[:, : gate_up.shape[1] // 2])
    assert "disagrees with torch" in str(kernel_problem(cpu, torch.float32, 64, 16))
    monkeypatch.setattr(fused, "rotate_store", lambda *args: 1 / 0)
    assert "ZeroDivisionError" in str(kernel_problem(cpu, torch.float32, 64, 16))
