"""A mixture of experts: the router's choice of each row's top-k gated MLPs, and their sum.

The eager path groups the rows by expert and runs one product per expert over
the rows that chose it; the fixed-shape step (CUDA graphs: no count may be read
from the device) gives every expert the same number of slots, its rows and
zero padding, in two batched products over the experts' stacked weights. Both
sum each row's k results in rank order, so a row's output is formed the same
way whatever rows share its experts (batch invariance, engine.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adapters.engine.layers.mlp import activate, gated
from adapters.engine.spec import Experts

if TYPE_CHECKING:
    from adapters.engine.loader import MoeWeights


def mixture(
    h: torch.Tensor,
    experts: Experts,
    moe: MoeWeights,
    out: torch.dtype,
    fixed_shapes: bool,
    kernel: bool,
) -> torch.Tensor:
    """A mixture of experts over rows h [rows, hidden] -> [rows, hidden] (in `out`, the
    state dtype).

    The router's softmax in fp32, each row's top_k (renormalised where the family
    says); then the rows grouped by expert: the (row, rank) pairs sorted by expert,
    one product per expert over the rows that chose it, each result put back at its
    pair, and each row's k results weighed and summed in rank order, so that a
    row's sum is formed the same way whatever rows share its experts. With
    `fixed_shapes` (and the experts stacked) every expert takes `rows` rows, the
    pairs it got and padding, in two batched products. `kernel`: the SiLU gate's."""
    rows, k = h.shape[0], experts.top_k
    logits = h.to(out) @ moe.router.T
    probs = torch.softmax(logits.float(), dim=-1)
    top, chosen = torch.topk(probs, k, dim=-1)
    if experts.renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs, expert by expert
    pairs = h[order // k]
    if fixed_shapes and moe.stacked is not None:
        done = _padded(pairs, flat, order, experts, moe.stacked, out, kernel)
    else:
        done = torch.empty(rows * k, h.shape[1], dtype=out, device=h.device)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=experts.count).tolist()):
            if count:
                span = slice(start, start + count)
                up, down = moe.gate_up[expert], moe.down[expert]
                done[order[span]] = gated(pairs[span], up, down, experts.activation, out, kernel)
                start += count
    weighed = done.view(rows, k, -1) * top.to(out)[:, :, None]
    return weighed.sum(dim=1)


def _padded(
    pairs: torch.Tensor,
    flat: torch.Tensor,
    order: torch.Tensor,
    experts: Experts,
    stacked: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    kernel: bool,
) -> torch.Tensor:
    """The experts of the sorted `pairs` in two batched products of fixed shapes: each
    expert takes `rows` slots (a row picks an expert at most once), its own pairs
    first, zero rows after -> results [pairs, hidden] in the pairs' first order."""
    count, total = experts.count, flat.shape[0]
    device = pairs.device
    per_expert = torch.zeros(count, dtype=flat.dtype, device=device)
    per_expert.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(per_expert, 0) - per_expert
    by_expert = flat[order]
    within = torch.arange(total, device=device) - starts[by_expert]
    # slot [expert, i]: the sorted pair there, or `total` (a zero row: padding)
    where = torch.full((count, total // experts.top_k), total, dtype=flat.dtype, device=device)
    where[by_expert, within] = torch.arange(total, device=device)
    gate_up, down = stacked
    inputs = torch.cat([pairs, pairs.new_zeros(1, pairs.shape[1])])[where]
    hidden = activate(torch.bmm(inputs, gate_up.transpose(1, 2)), experts.activation, kernel)
    out = torch.bmm(hidden, down.transpose(1, 2)).to(out_dtype)
    done = out.new_zeros(total + 1, out.shape[-1])  # the last row takes the padding's
    targets = torch.cat([order, order.new_full((1,), total)])[where]
    done[targets.flatten()] = out.flatten(0, 1)
    return done[:total]
