"""Compile every triton kernel the engine launches for an NVIDIA GPU, on any machine.

The test suite runs the kernels through triton's interpreter, which checks
what they compute, not that they compile: a kernel can pass there and still
be refused by the GPU compiler (an operation its backend lacks, a block too
wide) or compile into code that spills registers to memory. This script
needs no GPU. For each shape of bench/gpu_check.py it builds a one-layer
model at the real widths (heads, key heads, head size, hidden and MLP
widths; a small vocabulary) on the CPU, runs a few requests through the
Engine with the fused kernels and the triton attention forced (triton's
interpreter does the arithmetic), records every distinct launch (argument
types, compile-time constants, warps), and compiles each one ahead of time
for the target with triton's own compiler and the ptxas it ships. It prints,
per kernel and shape, the registers a thread uses, the bytes it spills, the
shared memory, and the compile time. A launch that fails to compile is
printed with its error and the exit status is 1.

    python bench/kernel_build.py                      # sm_90 (H100/H200), three shapes
    python bench/kernel_build.py --arch 80 --shapes 8b --dtypes bfloat16
    pip install --no-deps --target /tmp/triton36 triton==3.6.0   # the device's triton
    python bench/kernel_build.py --triton-from /tmp/triton36      # compile with it

About 80 s for three shapes and two dtypes on two cores, most of it the
interpreted recording runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--compile" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the recording run has no GPU
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a plain script

import torch

from adapters.engine import fused, paged_attention, runner
from adapters.engine.engine import Engine
from adapters.engine.model import LoadedModel
from bench.gpu_check import SHAPES, Shape, build_model
from core.batching import BatchLimits
from core.protocol import Assignment, GenerationRequest

# dtype -> (the model's dtype, the weight format a GPU serves it in)
DTYPES = {"bfloat16": (torch.bfloat16, "bf16"), "float32": (torch.float32, "fp32")}
TYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
COMPILED_WITH: set[str] = set()  # the triton versions the child processes compiled with
VOCAB = 512  # the vocabulary changes no kernel's shape: small keeps the CPU run short


@dataclasses.dataclass(frozen=True)
class Launch:
    """One distinct launch: the kernel, its argument types and its constants."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, Any], ...]
    num_warps: int


@dataclasses.dataclass
class Built:
    launch: Launch
    seconds: float
    registers: int | None = None
    spilled: int | None = None  # bytes stored to local memory per thread
    shared: int | None = None
    error: str | None = None


def kernels() -> dict[str, Any]:
    """The engine's triton kernels by name (interpreted or jitted, as triton is set)."""
    partial, join = paged_attention._kernels()
    elementwise = fused._kernels()
    return {
        "attention.partial": partial,
        "attention.join": join,
        "fused.rms_norm": elementwise.rms_norm,
        "fused.rotate_store": elementwise.rotate_store,
        "fused.silu_gate": elementwise.silu_gate,
    }


class _Recording:
    """Stands in for a kernel: `kernel[grid](...)` records the launch, then runs it."""

    def __init__(self, kernel: Any, name: str, seen: set[Launch]) -> None:
        self.kernel, self.name, self.seen = kernel, name, seen
        function = getattr(kernel, "fn", kernel)  # interpreted or jitted: the function
        self.names = list(inspect.signature(function).parameters)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **constants: Any) -> Any:
            warps = int(constants.pop("num_warps", 4))
            signature = tuple(zip(self.names, map(_type_of, args), strict=False))
            self.seen.add(Launch(self.name, signature, tuple(sorted(constants.items())), warps))
            return self.kernel[grid](*args, num_warps=warps, **constants)

        return launch


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no triton type for {type(value).__name__}")


@contextmanager
def recording(seen: set[Launch]) -> Iterator[None]:
    """The engine's kernels recorded as they launch; the fused kernels forced on and
    the activations kept in the weights' dtype, as on a GPU (the CPU keeps fp32)."""
    by_name = {name: _Recording(kernel, name, seen) for name, kernel in kernels().items()}
    attention = (by_name["attention.partial"], by_name["attention.join"])
    elementwise = fused._Kernels(
        by_name["fused.rms_norm"], by_name["fused.rotate_store"], by_name["fused.silu_gate"]
    )
    with ExitStack() as stack:
        for module, name, value in (
            (paged_attention, "_kernels", lambda: attention),
            (fused, "_kernels", lambda: elementwise),
            (runner, "fused_problem", lambda *args: None),
            (runner, "state_dtype", lambda device, dtype: dtype),
        ):
            stack.callback(setattr, module, name, getattr(module, name))
            setattr(module, name, value)
        yield


def record(shape: Shape, dtype: str) -> list[Launch]:
    """Every distinct launch of a short run of a one-layer model of `shape`: prefills
    of three prompts of different lengths, then decode steps through the fixed-shape
    step and the triton attention."""
    seen: set[Launch] = set()
    one_layer = dataclasses.replace(shape, layers=1, vocab=VOCAB)
    torch_dtype, weights = DTYPES[dtype]
    model = build_model(one_layer, torch.device("cpu"), torch_dtype, seed=0)
    loaded = LoadedModel.from_model(
        model, None, shape.name, frozenset(), 256, "built by kernel_build"
    )
    limits = BatchLimits(max_seqs=4, max_context=256, max_step_tokens=64)
    with recording(seen):
        engine = Engine(loaded, limits, weights=weights, decode="static", attention="triton")
        assert engine.runner.fused, "the fused kernels were not taken"
        for n, length in enumerate((5, 17, 40)):
            prompt = tuple(range(1, length + 1))
            engine.start(Assignment(f"r{n}", 1), GenerationRequest(f"r{n}", prompt, 4))
        for _ in range(64):  # bounded: 3 prompts of 4 tokens end well within it
            if not engine.has_work():
                break
            engine.step()
    return sorted(seen, key=lambda launch: (launch.kernel, repr(launch)))


def compile_all(launches: list[Launch], arch: int, triton_from: Path | None = None) -> list[Built]:
    """Each launch compiled for sm_`arch`, in a child process: triton's interpreter,
    once it has run a kernel, leaves the language patched for interpreting, and the
    compiler needs it as it was. `triton_from`: a folder holding another triton
    (`pip install --no-deps --target DIR triton==X`) for the child to compile with."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if triton_from is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(triton_from), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as folder:
        asked = Path(folder) / "launches.json"
        asked.write_text(json.dumps([dataclasses.asdict(launch) for launch in launches]))
        done = subprocess.run(
            [sys.executable, __file__, "--compile", str(asked), "--arch", str(arch)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60 + 60 * len(launches),
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the compiling process failed:\n{done.stderr[-4000:]}")
    version, results = json.loads(done.stdout.splitlines()[-1])
    COMPILED_WITH.add(version)
    return [Built(launch, **result) for launch, result in zip(launches, results, strict=True)]


def _compile_here(asked: Path, arch: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    by_name = kernels()
    results = []
    for item in json.loads(asked.read_text()):
        kernel = by_name[item["kernel"]]
        constants = {name: value for name, value in item["constants"]}
        signature = {name: kind for name, kind in item["signature"]}
        if "constexprs" in inspect.signature(ASTSource).parameters:  # triton 3.2 and later
            signature |= {name: "constexpr" for name in constants}
            source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        else:  # 3.0, 3.1: arguments by position, the constants apart
            at = kernel.arg_names.index
            source = ASTSource(
                fn=kernel,
                signature={at(name): kind for name, kind in signature.items()},
                constants={at(name): value for name, value in constants.items()},
            )
        began = time.perf_counter()
        try:
            compiled = triton.compile(
                source, target=GPUTarget("cuda", arch, 32), options={"num_warps": item["num_warps"]}
            )
        except Exception as error:
            message = f"{type(error).__name__}: {error}"
            results.append({"seconds": time.perf_counter() - began, "error": message})
            continue
        registers, spilled = _ptxas_usage(compiled.asm["ptx"], arch)
        results.append(
            {
                "seconds": time.perf_counter() - began,
                "registers": registers,
                "spilled": spilled,
                "shared": compiled.metadata.shared,
            }
        )
    print(json.dumps([triton.__version__, results]))


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """Registers per thread and spill stores (bytes), as the ptxas triton ships reports."""
    from triton.backends.nvidia import compiler

    if hasattr(compiler, "get_ptxas"):  # the one triton's compile used for this target
        ptxas = compiler.get_ptxas(arch).path
    else:  # before 3.4: one ptxas for every target
        ptxas = compiler._path_to_binary("ptxas")[0]
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", str(source), "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spilled = re.search(r"(\d+) bytes spill stores", done.stderr)
    return (
        int(registers.group(1)) if registers else None,
        int(spilled.group(1)) if spilled else None,
    )


def _constants(launch: Launch) -> str:
    return " ".join(f"{name}={value}" for name, value in launch.constants) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (sm_90)")
    parser.add_argument("--shapes", default="135m,1b,8b", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--dtypes", default="bfloat16,float32", help=f"of {','.join(DTYPES)}")
    parser.add_argument(
        "--triton-from",
        type=Path,
        help="compile with the triton in this folder (pip install --no-deps --target DIR "
        "triton==X), e.g. the device's version; the recording run keeps this one",
    )
    parser.add_argument("--compile", type=Path, help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args(argv)
    if args.compile:
        _compile_here(args.compile, args.arch)
        return 0
    failed = 0
    print(f"triton kernels compiled for sm_{args.arch} (registers a thread, spill bytes, "
          "shared memory, compile seconds)")  # fmt: skip
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        for dtype_name in args.dtypes.split(","):
            for built in compile_all(record(shape, dtype_name), args.arch, args.triton_from):
                launch = built.launch
                types = ",".join(kind for _, kind in launch.signature if kind.startswith("*"))
                label = f"{shape.name:13} {dtype_name:8} {launch.kernel:17}"
                if built.error:
                    failed += 1
                    print(f"{label} FAILED {built.error}  [{_constants(launch)}; {types}]")
                    continue
                print(
                    f"{label} regs {built.registers!s:>4} spill {built.spilled!s:>5} "
                    f"shared {built.shared!s:>6} {built.seconds:5.1f} s  "
                    f"[{_constants(launch)}; warps {launch.num_warps}; {types}]"
                )
    print(f"compiled with triton {', '.join(sorted(COMPILED_WITH))}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
