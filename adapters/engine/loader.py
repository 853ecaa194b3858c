"""Tensor names to the engine's layout: a checkpoint's weights read, converted and held.

A family (families/) names where each tensor is (spec.TensorNames); this file
reads them from the checkpoint (checkpoint.py) one at a time, each converted to
the chosen weight format (weights.py) and its source let go before the next, so
that loading never holds two copies of a model. q, k and v become one product,
gate and up another (`LayerWeights`); a mixture's experts become one product each,
and stacked for the fixed-shape step where the format is dense (`MoeWeights`).

Constant multipliers are folded into the weights here (`load_weights` lists
them), so the forward pass never spends a step on them. Under w4a16 and w4a8 a
GGUF's blocks are kept as shipped (`_Shipped`): no fp32 copy of a matrix the kernels
can run as the file holds it.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from adapters.engine.checkpoint import CheckpointError, expert_matrix
from adapters.engine.checkpoint import first as first_present
from adapters.engine.spec import Experts, ExpertTensors, ModelSpec
from adapters.engine.weights import (
    DENSE,
    NATIVE,
    Projection,
    act_bytes,
    activation_dtype,
    output_format,
    projection,
)

if TYPE_CHECKING:
    from adapters.engine.model import LoadedModel
    from adapters.engine.native import NativeProduct, Part


class MoeWeights(NamedTuple):
    """A mixture's weights (spec.Experts): the router, each expert's gate|up and down
    products, and (dense formats) the same experts stacked, [experts, 2 * width,
    hidden] and [experts, hidden, width], for the fixed-shape step's batched products
    (the per-expert products are views of them then, no second copy)."""

    router: torch.Tensor  # [experts, hidden], state dtype
    gate_up: list[Projection]
    down: list[Projection]
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    shared_gate: torch.Tensor | None = None  # [hidden]: the shared expert's sigmoid gate

    @property
    def nbytes(self) -> int:
        total = tensor_bytes(self.router) + sum(p.nbytes for p in [*self.gate_up, *self.down])
        return total + (tensor_bytes(self.shared_gate) if self.shared_gate is not None else 0)

    def expert_bytes(self) -> int:
        """Bytes one expert's products read."""
        return self.gate_up[0].nbytes + self.down[0].nbytes


class LayerWeights(NamedTuple):
    """One decoder layer's weights, q/k/v and gate/up fused into one matrix each; the
    norms, biases and q/k norms a layer does not have are None. A mixture's layer has
    `moe`, and gate_up and down only for a shared expert."""

    qkv: Projection
    o: Projection
    gate_up: Projection | None
    down: Projection | None
    pre_attention: torch.Tensor | None = None
    post_attention: torch.Tensor | None = None
    pre_mlp: torch.Tensor | None = None
    post_mlp: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's elements take."""
    return tensor.numel() * tensor.element_size()


def return_freed_heap() -> None:
    """Hand glibc's freed heap pages back to the system: loading frees about as much
    as it keeps (each tensor's fp32 reading and candidates), in pieces the allocator
    would otherwise hold (~190 MB at a 1.1B shape). No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


class _Shipped:
    """The native format's products from a GGUF's blocks as shipped (adapters/engine/
    ggml_blocks.py): each tensor packed straight from the file's bytes, never as fp32, unless
    its type is one the kernels lack, which is dequantised and requantised (4-bit
    groups, or 8-bit for the 5-bit types) and counted as such in `sources`."""

    WIDER = ("Q5_0", "Q5_1", "Q8_1")  # more than 4 bits: requantised to 8

    def __init__(self, checkpoint: Any, act_bytes: int = 2) -> None:
        from adapters.engine.native_build import load

        self.checkpoint = checkpoint
        self.act_bytes = act_bytes  # the products' activations: w4a16's 2, w4a8's 1
        self.library = load()
        self.sources: Counter[str] = Counter()
        self._parts: dict[tuple[str, int, int | None], Part] = {}

    def part(self, name: str, bits: int, expert: int | None = None) -> Part:
        """`name`'s matrix (or expert `expert`'s of a stacked tensor), packed once however
        many products use it."""
        from adapters.engine.ggml_blocks import FALLBACK, pack_blocks, shippable
        from adapters.engine.native import Part, quantized_part

        key = (name, bits, expert)
        if key in self._parts:
            return self._parts[key]
        checkpoint = self.checkpoint
        if expert is None:
            type_name, raw, (rows, cols) = checkpoint.blocks(name)
        else:
            type_name, raw, (rows, cols) = checkpoint.expert_blocks(name, expert)
        if shippable(type_name, cols):
            packed, kind = pack_blocks(type_name, raw, rows, cols, self.library.tile)
            part = Part(packed, kind, rows, cols, f"{type_name} as shipped")
            if expert is None:
                checkpoint.done_with(name)
        else:
            wide = 8 if type_name in self.WIDER else bits
            weight = checkpoint.tensor(name) if expert is None else checkpoint.expert(name, expert)
            part = quantized_part(weight.float(), wide, self.library.tile)
            part = replace(part, source=f"{type_name} -> {FALLBACK.replace('8', str(wide))}")
        self.sources[part.source] += 1
        self._parts[key] = part
        return part

    def expert_product(
        self, names: ExpertTensors, expert: int, which: Sequence[int], scale: float
    ) -> NativeProduct:
        """One expert's gate|up (which (0, 1)) or down ((2,)) from a GGUF's tensors stacked
        over the experts: each expert's slice of blocks packed as a matrix is."""
        from adapters.engine.native import NativeProduct

        parts = []
        for kind in which:
            name = names.stacked[kind]
            if not self.checkpoint.has(name):
                raise CheckpointError(
                    f"{self.checkpoint.source}: no {name!r} (experts stacked, as llama.cpp "
                    "writes them; a file with one tensor per expert is not read)"
                )
            parts.append(replace(self.part(name, 4, expert), scale=scale))
        return NativeProduct(library=self.library, act_bytes=self.act_bytes, parts=parts)

    def product(
        self, names: Sequence[str], scales: Sequence[float], bits: int = 4
    ) -> NativeProduct:
        """The product over these tensors' rows, one after another, each's outputs times
        its scale. `bits`: what a type the kernels lack is requantised to."""
        from adapters.engine.native import NativeProduct

        parts = [
            replace(self.part(name, bits), scale=scale)
            for name, scale in zip(names, scales, strict=True)
        ]
        return NativeProduct(library=self.library, act_bytes=self.act_bytes, parts=parts)

    def fused_qkv(self, name: str, q_size: int, q_scale: float) -> NativeProduct:
        """A q|k|v matrix shipped as one tensor (Phi-3's), with the attention scale on q's
        rows only: two parts over the same tiles (as shipped or requantised alike), split
        where q's rows end. That is a whole tile: the fused pass takes only head sizes
        that are multiples of 16 (native.model_problem)."""
        from adapters.engine.native import NativeProduct

        part, tile = self.part(name, 4), self.library.tile
        if q_size % tile:
            raise ValueError(f"q's {q_size} rows are not whole {tile}-row tiles")
        q_tiles = q_size // tile
        q = replace(part, packed=part.packed[:q_tiles], out_features=q_size, scale=q_scale)
        kv = replace(part, packed=part.packed[q_tiles:], out_features=part.out_features - q_size)
        return NativeProduct(library=self.library, act_bytes=self.act_bytes, parts=[q, kv])

    def embedding(self, name: str, scale: float, head_name: str) -> torch.Tensor | NativeProduct:
        """The embedding table: packed as shipped (shared with a tied head) where its
        type runs so, else fp32 rows as the other formats keep it."""
        from adapters.engine.ggml_blocks import shippable
        from adapters.engine.native import NativeProduct

        type_name, _, shape = self.checkpoint.quantized(name)
        if len(shape) != 2 or not shippable(type_name, shape[1]):
            table: torch.Tensor = self.checkpoint.tensor(name).float()
            return table * scale if scale != 1.0 else table
        part = self.part(name, 8 if name == head_name else 4)  # a tied head's own tiles
        scaled = [replace(part, scale=scale)]
        return NativeProduct(library=self.library, act_bytes=self.act_bytes, parts=scaled)


def load_weights(
    loaded: LoadedModel, spec: ModelSpec, fmt: str, state: torch.dtype
) -> tuple[
    torch.Tensor | NativeProduct, torch.Tensor, Projection, list[LayerWeights], Counter[str]
]:
    """(embedding table, final norm, lm_head, layers) from the checkpoint, tensor by
    tensor: products in `fmt`, the rest in `state`, each source let go once converted.

    Folded in as they are read: the attention scale into the query rows and bias (or,
    where q is normalised, into the q norm's weight, since a norm would undo it: exact
    for power-of-two scales, else one rounding), the residual multiplier into the
    output and down products, the embedding scale into the embedding table, the
    logit multiplier into lm_head, and the norm offset (Gemma's 1 + w) into every
    norm weight. A tied lm_head is the embedding table itself unless one of those
    scales differs between them.

    w4a16 and w4a8 on a GGUF keep the file's blocks (_Shipped): the attention scale, the
    residual and logit multipliers then scale the products' outputs instead of the
    weights, and the embedding table is a packed matrix (the tied head's own tiles)
    whose rows native.c unpacks.
    """
    checkpoint, names, device = loaded.checkpoint, loaded.tensors, loaded.device
    packer = None
    if fmt in NATIVE and hasattr(checkpoint, "blocks"):
        packer = _Shipped(checkpoint, act_bytes(fmt))

    def read(name: str) -> torch.Tensor:
        return checkpoint.tensor(name).to(device=device, dtype=torch.float32)

    def rows(parts: Sequence[str]) -> torch.Tensor:
        return torch.cat([read(name) for name in parts]) if len(parts) > 1 else read(parts[0])

    def norm(name: str | None) -> torch.Tensor | None:
        if name is None:
            return None
        return (read(name) + spec.norm_offset).to(state)

    with torch.no_grad():
        head_scale = spec.logit_scale
        head_name = names.embed
        if names.lm_head is not None and checkpoint.has(names.lm_head):
            head_name = names.lm_head
        elif names.lm_head is not None and not spec.tie_embeddings:
            raise CheckpointError(f"{checkpoint.source}: no {names.lm_head}, and it is not tied")
        table: torch.Tensor | NativeProduct
        lm_head: Projection
        if packer is not None:
            lm_head = packer.product([head_name], [head_scale], bits=8)
            table = packer.embedding(names.embed, spec.embed_scale, head_name)
        else:
            embed = read(names.embed)
            head = embed if head_name == names.embed else read(head_name)
            head = head * head_scale if head_scale != 1.0 else head
            lm_head = projection(head, output_format(fmt))
            del head
            table = (embed * spec.embed_scale if spec.embed_scale != 1.0 else embed).to(state)
            del embed
        final = norm(names.final_norm)
        assert final is not None
        return_freed_heap()
        layers = []
        for layer, where in zip(spec.layers, names.layers, strict=False):
            attention, residual = layer.attention, spec.residual_scale
            q_size = attention.heads * attention.head_dim
            q_norm, k_norm = norm(where.q_norm), norm(where.k_norm)
            bias = rows(where.qkv_bias).to(state) if where.qkv_bias else None
            q_scale = 1.0 if q_norm is not None else attention.scale
            if q_norm is not None:
                q_norm = q_norm * attention.scale
            elif bias is not None:  # out of place: a tensor read may be the checkpoint's own
                bias = torch.cat([bias[:q_size] * attention.scale, bias[q_size:]])
            o_bias = read(where.o_bias).to(state) if where.o_bias else None
            down_bias = read(where.down_bias).to(state) if where.down_bias else None
            if residual != 1.0:
                o_bias = o_bias * residual if o_bias is not None else None
                down_bias = down_bias * residual if down_bias is not None else None
            gate_up_bias = rows(where.gate_up_bias).to(state) if where.gate_up_bias else None
            products: tuple[Projection, Projection, Projection | None, Projection | None]
            has_mlp = layer.mlp is not None  # else only experts
            if packer is not None:  # each tensor as shipped, scales on the outputs
                if len(where.qkv) == 1 and q_scale != 1.0:
                    qkv_product = packer.fused_qkv(where.qkv[0], q_size, q_scale)
                else:
                    scales = [q_scale] + [1.0] * (len(where.qkv) - 1)
                    qkv_product = packer.product(where.qkv, scales)
                products = (
                    qkv_product,
                    packer.product([where.o], [residual]),
                    packer.product(where.gate_up, [1.0] * len(where.gate_up)) if has_mlp else None,
                    packer.product([where.down], [residual]) if has_mlp else None,
                )
            else:
                qkv = rows(where.qkv)
                if q_scale != 1.0:  # out of place, as the bias
                    qkv = torch.cat([qkv[:q_size] * q_scale, qkv[q_size:]])
                o, down = read(where.o), read(where.down) if has_mlp else None
                if residual != 1.0:
                    o, down = o * residual, down * residual if down is not None else None
                products = (
                    projection(qkv, fmt),
                    projection(o, fmt),
                    projection(rows(where.gate_up), fmt) if has_mlp else None,
                    projection(down, fmt) if down is not None else None,
                )
                del qkv, o, down
            moe = None
            if layer.experts is not None:
                if where.experts is None:
                    raise CheckpointError(f"{checkpoint.source}: no expert tensors named")
                moe = _experts(checkpoint, where.experts, layer.experts, fmt, residual, state,
                               packer, device)  # fmt: skip
            layers.append(
                LayerWeights(
                    *products,
                    pre_attention=norm(where.pre_attention),
                    post_attention=norm(where.post_attention),
                    pre_mlp=norm(where.pre_mlp),
                    post_mlp=norm(where.post_mlp),
                    qkv_bias=bias,
                    o_bias=o_bias,
                    gate_up_bias=gate_up_bias,
                    down_bias=down_bias,
                    q_norm=q_norm,
                    k_norm=k_norm,
                    moe=moe,
                )
            )
            return_freed_heap()  # each layer's temporaries, before the next layer's
    sources = packer.sources if packer is not None else Counter()
    return table, final, lm_head, layers, sources


def _experts(
    checkpoint: Any,
    names: ExpertTensors,
    experts: Experts,
    fmt: str,
    residual: float,
    state: torch.dtype,
    packer: _Shipped | None,
    device: torch.device,
) -> MoeWeights:
    """A mixture's weights, expert by expert (each read, converted and let go before the
    next): the router and a shared expert's gate in the state dtype; each expert's
    gate|up and down in `fmt` (a GGUF's blocks as shipped under w4a16), the residual
    multiplier on down. Dense formats keep the experts stacked, and each expert's
    products are views of the stack."""
    router_name = first_present(checkpoint, names.router)
    if router_name is None:
        raise CheckpointError(f"{checkpoint.source}: no router ({names.router[0]!r})")
    router = checkpoint.tensor(router_name).to(device=device, dtype=state)
    if router.shape[0] != experts.count:
        raise CheckpointError(
            f"{checkpoint.source}: {router_name} routes to {router.shape[0]} experts, "
            f"the config says {experts.count}"
        )
    shared_gate = None
    gate_up: list[Projection]
    down: list[Projection]
    if names.shared_gate is not None:
        shared_gate = checkpoint.tensor(names.shared_gate).to(device=device, dtype=state)
        shared_gate = shared_gate.reshape(-1)
    if packer is not None:
        gate_up = [packer.expert_product(names, e, (0, 1), 1.0) for e in range(experts.count)]
        down = [packer.expert_product(names, e, (2,), residual) for e in range(experts.count)]
        for name in names.stacked:  # packed: their pages leave the resident set
            checkpoint.done_with(name)
        return MoeWeights(router, gate_up, down, None, shared_gate)

    def matrix(which: int, index: int) -> torch.Tensor:
        return expert_matrix(checkpoint, names, which, index).to(device, torch.float32)

    if fmt in DENSE:
        dtype = activation_dtype(fmt)
        stacked = _stacked_as_held(checkpoint, names, dtype, device) if residual == 1.0 else None
        if stacked is not None:  # transformers' own layout already: no copy
            gate_up = [projection(stacked[0][e], fmt) for e in range(experts.count)]
            down = [projection(stacked[1][e], fmt) for e in range(experts.count)]
            return MoeWeights(router, gate_up, down, stacked, shared_gate)
        hidden, width = router.shape[1], experts.intermediate
        stacked_up = torch.empty(experts.count, 2 * width, hidden, dtype=dtype, device=device)
        stacked_down = torch.empty(experts.count, hidden, width, dtype=dtype, device=device)
        for e in range(experts.count):
            stacked_up[e, :width] = matrix(0, e)
            stacked_up[e, width:] = matrix(1, e)
            stacked_down[e] = matrix(2, e) * residual if residual != 1.0 else matrix(2, e)
        gate_up = [projection(stacked_up[e], fmt) for e in range(experts.count)]
        down = [projection(stacked_down[e], fmt) for e in range(experts.count)]
        return MoeWeights(router, gate_up, down, (stacked_up, stacked_down), shared_gate)
    gate_up, down = [], []
    for e in range(experts.count):
        gate_up.append(projection(torch.cat([matrix(0, e), matrix(1, e)]), fmt))
        down.append(projection(matrix(2, e) * residual, fmt))
    return MoeWeights(router, gate_up, down, None, shared_gate)


def _stacked_as_held(
    checkpoint: Any, names: ExpertTensors, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A model built in this process whose experts are already the stacked layout the
    fixed-shape step takes (transformers' gate|up [experts, 2 x width, hidden] and down),
    in `dtype` on `device`: those tensors themselves, else None."""
    gate_up, down = names.fused
    if not (checkpoint.has(gate_up) and checkpoint.has(down)):
        return None
    both, out = checkpoint.tensor(gate_up), checkpoint.tensor(down)
    fits = all(t.dtype == dtype and t.device == device and t.is_contiguous() for t in (both, out))
    return (both, out) if fits else None
