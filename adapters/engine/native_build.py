"""Building native.c for this CPU and loading it: the one place that compiles C.

The C source ships with the package and is compiled at first use with the system's C
compiler for the instruction set this CPU reports (AVX-512 with VNNI, else AVX2 with FMA
and F16C), into the cache folder (keyed by the source, the flags and the compiler), and
loaded with ctypes, its entry points' argument types declared here. Nothing is assumed:
with no compiler, or a CPU with neither instruction set, `load()` raises
NativeUnavailable naming why, and the engine's weight choice (adapters/engine/choose.py)
simply has one candidate fewer.

`FENCEPOST_NATIVE=off` turns the path off; `FENCEPOST_NATIVE=avx2` builds the AVX2
variant even on an AVX-512 machine (the tests compare the two: they must agree bit for
bit, see native.c). An image build calls `build` for every variant its nodes may have.
What the kernels compute, and the packing of weights for them, is native.py's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from adapters.engine.files import cache_root

SOURCE = Path(__file__).with_name("native.c")
ISAS = {
    # name: (CPU flags needed, compiler flags, define)
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c", "avx2"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c", "-mavx2"),
        "FP_AVX512",
    ),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "FP_AVX2"),
}


class NativeUnavailable(RuntimeError):
    """The native path cannot run here (the message says why)."""


class Mat(ctypes.Structure):
    """One matrix as native.c's products take it (its `next`: the product's next part)."""


Mat._fields_ = [
    ("out", ctypes.c_int32),
    ("in_", ctypes.c_int32),
    ("groups", ctypes.c_int32),
    ("tiles", ctypes.c_int32),
    ("kind", ctypes.c_int32),  # ggml_blocks.KINDS
    ("data", ctypes.c_void_p),
    ("scale", ctypes.c_float),
    ("next", ctypes.POINTER(Mat)),
]


@dataclass(frozen=True)
class Library:
    """native.c loaded for one instruction set (`isa`), its products' tile height."""

    isa: str
    tile: int
    path: Path
    handle: Any  # ctypes.CDLL

    def matmul(self, mat: Mat, x: torch.Tensor, y: torch.Tensor, act_bytes: int = 2) -> None:
        """y = x through `mat`, the activations quantized in `act_bytes` (1 or 2) bytes."""
        if act_bytes not in (1, 2):
            raise ValueError(f"activations of 1 or 2 bytes, not {act_bytes}")
        threads = torch.get_num_threads()
        if self.handle.fp_matmul(
            ctypes.byref(mat), x.data_ptr(), x.shape[0], y.data_ptr(), threads, act_bytes
        ):
            raise MemoryError("native product: out of memory")


def cpu_flags() -> set[str]:
    """Every flag of the CPU, as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split()[2:])


def pick_isa(flags: set[str], wanted: str | None = None) -> str:
    """The instruction set to build for: `wanted` if given, else the widest the CPU has."""
    names = [wanted] if wanted else list(ISAS)
    for name in names:
        if name not in ISAS:
            raise NativeUnavailable(f"unknown instruction set {name!r}; one of {', '.join(ISAS)}")
        missing = [flag for flag in ISAS[name][0] if flag not in flags]
        if not missing:
            return name
        if wanted:
            raise NativeUnavailable(f"{name} needs CPU flags {', '.join(missing)}")
    raise NativeUnavailable("the CPU has neither AVX-512 with VNNI nor AVX2 with FMA and F16C")


def load(isa: str | None = None) -> Library:
    """The compiled library for `isa` (default: FENCEPOST_NATIVE, else the CPU's widest)."""
    setting = os.environ.get("FENCEPOST_NATIVE", "").strip().lower()
    if setting in ("off", "0", "no", "false"):
        raise NativeUnavailable("turned off by FENCEPOST_NATIVE")
    return _load(isa or (setting if setting not in ("", "auto", "on") else None))


@cache
def _load(wanted: str | None) -> Library:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"x86-64 kernels; this machine is {platform.machine()}")
    isa = pick_isa(cpu_flags(), wanted)
    path = build(isa)
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as error:
        raise NativeUnavailable(f"could not load {path}: {error}") from error
    handle.fp_isa.restype = ctypes.c_char_p
    handle.fp_tile.restype = ctypes.c_int32
    handle.fp_matmul.restype = ctypes.c_int
    handle.fp_matmul.argtypes = [
        ctypes.c_void_p,  # matrix
        ctypes.c_void_p,  # x
        ctypes.c_int32,  # rows
        ctypes.c_void_p,  # y
        ctypes.c_int32,  # threads
        ctypes.c_int32,  # activation bytes (1 or 2)
    ]
    handle.fp_unpack_rows.restype = None
    handle.fp_unpack_rows.argtypes = [
        ctypes.c_void_p,  # matrix
        ctypes.c_void_p,  # rows int64
        ctypes.c_int32,  # how many
        ctypes.c_void_p,  # out
    ]
    handle.fp_forward.restype = ctypes.c_int
    handle.fp_forward.argtypes = [
        ctypes.c_void_p,  # model
        ctypes.c_int32,  # rows
        ctypes.c_void_p,  # tokens int64
        ctypes.c_void_p,  # positions int64
        ctypes.c_void_p,  # tables int32
        ctypes.c_int32,  # width
        ctypes.c_void_p,  # wanted rows int32
        ctypes.c_int32,  # how many
        ctypes.c_void_p,  # logits
        ctypes.c_int32,  # threads
    ]
    return Library(isa, int(handle.fp_tile()), path, handle)


def _compiler() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")


def build(isa: str) -> Path:
    """The compiled library for `isa`, from the cache or compiled now (whatever this CPU
    has: an image build compiles every variant for the nodes it will run on)."""
    compiler = _compiler()
    _, machine_flags, define = ISAS[isa]
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
    flags += ["-fno-math-errno"]
    flags += ["-fno-trapping-math", f"-D{define}"]
    flags += machine_flags
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeUnavailable(f"{compiler} --version failed: {error}") from error
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(flags).encode() + version.encode()
    ).hexdigest()[:16]
    for folder in (cache_root() / "native", Path(tempfile.gettempdir()) / "fencepost-native"):
        target = folder / f"{isa}-{key}.so"
        if target.is_file():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                built = Path(scratch) / target.name
                command = [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"]
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if done.returncode:
                    raise NativeUnavailable(
                        f"compiling {SOURCE.name} failed: {done.stderr.strip()[-2000:]}"
                    )
                os.replace(built, target)  # atomic: a concurrent build loses nothing
            return target
        except OSError:
            continue  # a read-only cache: try the temporary folder
    raise NativeUnavailable("no writable folder for the compiled kernels")
