"""The one 64-bit mix behind every seeded choice: splitmix64's output function.

Three layers turn a seed into something else and must agree with themselves
across processes and versions: the HTTP boundary derives the seed of each of n
choices from the request's seed, the engine derives the uniform number of each
draw from (seed, token index), and the fake model starts its hash from the
seed. They share these constants and this function so a change to one is a
change to all, on purpose. Pure integer arithmetic on unsigned 64-bit values.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio: splitmix64's increment
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def splitmix64(z: int) -> int:
    """splitmix64's finaliser of the 64-bit state `z` (taken modulo 2^64), unsigned."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def signed64(value: int) -> int:
    """An unsigned 64-bit pattern as the signed int64 that holds the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value
