"""The engine's lines for the person starting the server.

Loading, choosing a format, building kernels and sizing the KV pool each have
something to tell whoever is watching a start (how long, what was chosen and why).
They all write through `say`, one prefixed line to stderr, so the log reads as one
voice and a test or a quiet caller can pass its own callable instead.
"""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """A line for the person starting the server (stderr)."""
    print(f"[fencepost] {message}", file=sys.stderr, flush=True)
