"""Settings the whole test run needs before any test module is imported."""

import os
from typing import Any

import pytest

# Triton kernels (adapters/engine/paged_attention.py) run through triton's interpreter on
# CPU tensors: there is no GPU here. It must be set before triton is first imported,
# which importing transformers or torch's compiler can do, so it cannot wait for the
# module that tests the kernels. TRITON_INTERPRET=0 in the environment overrides it.
os.environ.setdefault("TRITON_INTERPRET", "1")

# In a parallel run (pytest-xdist) each worker gets its share of the cores for torch's
# own threads, so that two workers on two cores do not each start two threads and
# take turns. Subprocesses the tests start (servers, workers) are not affected.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def native_library(isa: str) -> Any:
    """The native kernels built for `isa` (adapters/engine/native_build.py), or the test is
    skipped where this CPU or machine cannot build or run them."""
    from adapters.engine.native_build import NativeUnavailable, load

    try:
        return load(isa)
    except NativeUnavailable as error:
        pytest.skip(f"{isa}: {error}")


def _isas() -> list[str]:
    from adapters.engine.native_build import ISAS  # after TRITON_INTERPRET is set, above

    return list(ISAS)


@pytest.fixture(scope="module", params=_isas())
def library(request: pytest.FixtureRequest) -> Any:
    """Each instruction set's native kernels in turn."""
    return native_library(request.param)
