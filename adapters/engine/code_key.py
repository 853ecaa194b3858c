"""The hash of the code that makes and runs the weight formats, which keys the caches
of decisions measured on it (the format choice in choose.py, the quality gate's
scores in quality.py): a changed quantiser, kernel, loader or layer is measured
again instead of trusting an older build's figures. Its own module so that both
caches can name it without importing each other.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def code_key(*parts: str) -> str:
    """A short hash of the code that makes and runs the weight formats (the quantisers,
    the packing of GGUF blocks, the native kernel's source and its build, the loader,
    the runner and the layers it calls) and of `parts`."""
    from adapters.engine import ggml_blocks, layers, loader, native, native_build, runner, weights

    digest = hashlib.sha256()
    code = [Path(weights.__file__), Path(native.__file__), Path(native_build.__file__),
            Path(ggml_blocks.__file__), Path(loader.__file__), Path(runner.__file__)]  # fmt: skip
    code += sorted(Path(layers.__file__).parent.glob("*.py"))  # every layer's file
    for path in (*code, native_build.SOURCE):
        digest.update(path.read_bytes())
    for part in parts:
        digest.update(part.encode())
    return digest.hexdigest()[:16]
