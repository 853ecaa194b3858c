"""The two ends of the forward pass: token ids to embedding rows, and the last hidden
state to logits (the final norm, the output projection, a final soft-cap).

The embedding table is fp32 rows in the state dtype, or under w4a16 on a GGUF a
packed matrix (often the tied output projection's own tiles) whose rows native.c
unpacks; the output projection is a weight format's Projection either way.
Scales (an embedding multiplier, a logit multiplier) are folded into the
weights as they are loaded (loader.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adapters.engine.layers.norm import rms_norm

if TYPE_CHECKING:
    from adapters.engine.native import NativeProduct
    from adapters.engine.weights import Projection


def embedded(
    embed: torch.Tensor | NativeProduct, tokens: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The rows of the embedding table the torch passes start from (a packed table:
    unpacked by native.c, as its fused pass does), on `device`."""
    if isinstance(embed, torch.Tensor):
        return embed[tokens]
    return embed.rows(tokens.cpu()).to(device)


def logits(
    x: torch.Tensor,
    final_norm: torch.Tensor,
    lm_head: Projection,
    eps: float,
    dtype: torch.dtype,
    kernel: bool,
    softcap: float | None,
) -> torch.Tensor:
    """Rows x [rows, hidden] -> fp32 logits [rows, vocab]: the final RMSNorm (handed on
    in the products' `dtype`; `kernel`: the triton norm's), lm_head, and with
    `softcap` tanh(l / softcap) * softcap."""
    out = lm_head(rms_norm(x, final_norm, eps, dtype, kernel)).float()
    return out if softcap is None else torch.tanh(out / softcap) * softcap
