"""Every triton kernel the engine launches compiles for the H200 (sm_90), without a GPU.

The other kernel tests run them through triton's interpreter, which checks the
arithmetic and not the compilation: bench/kernel_build.py records each launch
of a short run at the real widths of a shape, then compiles it ahead of time
with triton's compiler and the ptxas it ships. Two shapes: SmolLM2-135M (a
query-head group of 3, padded to 4; a 576-wide norm) and Llama-3-8B (head size
128; a 4096-wide norm over 16 warps), in bf16 as a GPU serves them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton (a dev dependency) compiles the kernels")

from bench import kernel_build  # after the skip: it imports triton's kernels

KERNELS = {
    "attention.partial",
    "attention.join",
    "fused.rms_norm",
    "fused.rotate_store",
    "fused.silu_gate",
}


@pytest.mark.parametrize("shape", ["135m", "8b"])
def test_each_launch_compiles_for_sm_90(shape: str) -> None:
    launches = kernel_build.record(kernel_build.SHAPES[shape], "bfloat16")
    assert {launch.kernel for launch in launches} == KERNELS
    for launch in launches:  # bf16 activations and caches, as on a GPU
        if launch.kernel != "attention.join":
            assert "*bf16" in dict(launch.signature).values(), launch
    built = kernel_build.compile_all(launches, arch=90)
    failed = [f"{b.launch.kernel}: {b.error}" for b in built if b.error]
    assert not failed, failed
    assert all(b.registers for b in built), "ptxas reported no register count"


def test_a_kernel_the_compiler_refuses_is_reported_not_hidden() -> None:
    # A launch whose constant breaks a rule the interpreter does not enforce the same
    # way: a block that is not a power of two.
    launch = kernel_build.Launch(
        "fused.silu_gate", (("x_ptr", "*bf16"), ("out_ptr", "*bf16"), ("width", "i32")),
        (("BLOCK", 1000),), 4,
    )  # fmt: skip
    (built,) = kernel_build.compile_all([launch], arch=90)
    assert built.error is not None and "power of 2" in built.error


def test_no_kernel_reads_a_name_from_a_closure() -> None:
    """Triton 3.1 (torch 2.5's, in the CUDA image) looks a kernel's names up in its
    module's globals only: a kernel that used `tl` from an enclosing function failed to
    compile there (`bench/kernel_build.py --triton-from` a 3.1 install showed it)."""
    for name, kernel in kernel_build.kernels().items():
        function = getattr(kernel, "fn", kernel)
        assert function.__code__.co_freevars == (), (name, function.__code__.co_freevars)
        assert "tl" in function.__globals__, name
