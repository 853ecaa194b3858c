"""Settings the whole test run needs before any test module is imported."""

import os

# Triton kernels (adapters/engine/paged_attention.py) run through triton's interpreter on
# CPU tensors: there is no GPU here. It must be set before triton is first imported,
# which importing transformers or torch's compiler can do, so it cannot wait for the
# module that tests the kernels. TRITON_INTERPRET=0 in the environment overrides it.
os.environ.setdefault("TRITON_INTERPRET", "1")
