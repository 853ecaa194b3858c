"""The CPU weight formats' matrix products by batch rows (issue 14's levers).

For the default model's layer shapes (SmolLM2-135M: hidden 576, MLP 1536, 9
query and 3 key/value heads of 64), the time of one decode step's products
over all 30 layers, per format, at 1, 4, 8, 16 and 32 rows, random weights,
activations as the engine hands them over (bf16; w4a16 takes fp32 and
quantizes them itself, its products on as many threads as --threads). The
weights are one layer's, timed repeatedly, so they sit in cache: the
figures are the kernels' arithmetic, not the memory traffic of a real step.
The engine keeps one format per process (chosen at start by speed and the
quality gate); this shows where another format would be faster at a larger
batch, and by how much. Run:

    python bench/cpu_formats_by_rows.py [--threads N] [--rows 1,4,8,16,32]
"""

from __future__ import annotations

import argparse
import time

import torch

from adapters.engine.weights import projection

LAYERS = 30
SHAPES = {  # [out, in] of each product of one layer
    "qkv": (576 + 2 * 192, 576),
    "o": (576, 576),
    "gate_up": (2 * 1536, 576),
    "down": (576, 1536),
}
FORMATS = ("bf16", "int8", "int4", "w4a16")


def step_ms(fmt: str, rows: int, repeats: int) -> float:
    """Milliseconds of one step's products over every layer (one layer timed, x30)."""
    total = 0.0
    for out_features, in_features in SHAPES.values():
        product = projection(torch.randn(out_features, in_features) * 0.02, fmt)
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        for _ in range(5):
            product(x)
        began = time.perf_counter()
        for _ in range(repeats):
            product(x)
        total += (time.perf_counter() - began) / repeats
    return total * LAYERS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"products of one decode step, {LAYERS} layers, {args.threads} thread(s), ms")
    print(f"{'rows':>5} " + " ".join(f"{fmt:>8}" for fmt in FORMATS) + "  fastest")
    for rows in (int(r) for r in args.rows.split(",")):
        times = {fmt: step_ms(fmt, rows, args.repeats) for fmt in FORMATS}
        best = min(times, key=lambda fmt: times[fmt])
        print(f"{rows:>5} " + " ".join(f"{times[fmt]:8.2f}" for fmt in FORMATS) + f"  {best}")


if __name__ == "__main__":
    main()
