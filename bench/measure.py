"""Measurements every benchmark shares, in one copy: `fencepost bench ...` (this
package) and the scripts in bench/ (the device check among them) import them
from here.

Only torch: bench/gpu_check.py runs this on a device image that carries
nothing else of the project's dependencies but the wheels it names.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a clock read after it
    times the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_rate(
    model: Any,
    prompt: tuple[int, ...],
    tokens: int,
    *,
    warm_tokens: int | None = None,
    cap_s: float | None = None,
    **settings: Any,
) -> tuple[float, float]:
    """(tokens/s, seconds of the warm-up) of transformers' `generate` at batch 1,
    greedy, exactly `tokens` new tokens (EOS ignored). One untimed call first, of
    `warm_tokens` (default: `tokens`, which is what a static cache needs: it
    compiles for its length there); `cap_s` bounds the timed call (max_time) and
    the rate counts what it produced; `settings` go to both calls."""
    device = next(model.parameters()).device
    inputs = torch.tensor([prompt], device=device)
    options = {"do_sample": False, "attention_mask": torch.ones_like(inputs), **settings}
    warm = tokens if warm_tokens is None else warm_tokens
    with torch.inference_mode():
        began = time.perf_counter()
        model.generate(inputs, max_new_tokens=warm, min_new_tokens=warm, **options)
        sync(device)
        warm_s = time.perf_counter() - began
        if cap_s is not None:
            options["max_time"] = cap_s
        began = time.perf_counter()
        out = model.generate(inputs, max_new_tokens=tokens, min_new_tokens=tokens, **options)
        sync(device)
        elapsed = time.perf_counter() - began
    return float(out.shape[1] - len(prompt)) / elapsed, warm_s


def memory_bandwidth_gbs(device: torch.device) -> float:
    """Read + write bandwidth of copying 256 MiB on the device, best of five, in GB/s:
    the bound a decode step that reads its weights once cannot beat."""
    source = torch.ones(256 << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        sync(device)
        began = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * source.numel() / best / 1e9
