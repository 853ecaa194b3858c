"""The gated MLP: down(act(gate) * up), gate and up one product (`gate_up`).

Activations: SiLU (most families; on CUDA one triton kernel for the gate,
fused.silu_gate, when `kernel` says so) and tanh-approximated GELU (Gemma).
A mixture's experts (experts.py) are gated MLPs too, and call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from adapters.engine import fused

if TYPE_CHECKING:
    from adapters.engine.weights import Projection


def activate(both: torch.Tensor, activation: str, kernel: bool) -> torch.Tensor:
    """act(gate) * up of [..., gate | up] -> [..., width]."""
    if activation == "gelu_tanh":
        gate, up = both.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if not kernel:
        return fused.torch_silu_gate(both)
    return fused.silu_gate(both.reshape(-1, both.shape[-1])).view(*both.shape[:-1], -1)


def gated(
    h: torch.Tensor,
    gate_up: Projection,
    down: Projection,
    activation: str,
    out: torch.dtype,
    kernel: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(act(gate) * up) of rows h -> [rows, hidden] in `out` (the state dtype)."""
    both = gate_up(h)
    if bias is not None:
        both = both + bias.to(both.dtype)
    return down(activate(both, activation, kernel)).to(out)
