"""The native CPU path (adapters/engine/native.c): integer products and a fused decode step.

native_build.py compiles native.c for this CPU and loads it (or says why it cannot);
this file packs weights into the kernels' tiles and drives them: a product at a
time (NativeProduct, a weight format's Projection) or a whole decode step
(NativeModel, native.c's Model over a runner's weights and KV cache).

What is packed here (native.c's header has the byte layouts of every kind):
- float matrices (safetensors, or a GGUF type the kernels lack) quantized by
  `pack4` into 4-bit groups of 32 inputs with an fp16 scale and minimum per group
  (W = q * scale + minimum, q in 0..15: a Q4_1 block), or by `pack8` into 8-bit
  groups with an fp16 scale (W = q * scale, q in -127..127: a Q8_0 block, for the
  output projection);
- a GGUF's blocks as shipped (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16),
  repacked into tiles by adapters/engine/ggml_blocks.py with no fp32 copy: every
  weight the kernels use is gguf's own dequantised value.
A product (NativeProduct) is one or more such matrices over the same inputs, each
with its own kind and output scale: q, k and v of a layer, each as its file holds it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from adapters.engine.native_build import Library, Mat, load
from adapters.engine.spec import ModelSpec

GROUP = 32

# native.c's per-layer pointer arrays after the caches, in its order (NULL: none).
PER_LAYER = ("cos", "sin", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm",
             "k_norm", "attn_out_norm", "mlp_out_norm")  # fmt: skip


class ModelStruct(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("layers", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("max_context", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("embed", ctypes.c_void_p),
        ("embed_mat", ctypes.POINTER(Mat)),
        ("final_norm", ctypes.c_void_p),
        ("head", ctypes.POINTER(Mat)),
        ("input_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("post_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("qkv", ctypes.POINTER(Mat)),
        ("o", ctypes.POINTER(Mat)),
        ("gate_up", ctypes.POINTER(Mat)),
        ("down", ctypes.POINTER(Mat)),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        *((name, ctypes.POINTER(ctypes.c_void_p)) for name in PER_LAYER),
        ("window", ctypes.POINTER(ctypes.c_int32)),
        ("softcap", ctypes.POINTER(ctypes.c_float)),
        ("rot_dim", ctypes.c_int32),
        ("qk_norm_width", ctypes.c_int32),
        ("gelu", ctypes.c_int32),
        ("final_softcap", ctypes.c_float),
        ("experts", ctypes.POINTER(ctypes.c_int32)),
        ("has_mlp", ctypes.POINTER(ctypes.c_int32)),
        ("top_k", ctypes.c_int32),
        ("expert_inter", ctypes.c_int32),
        ("renormalise", ctypes.c_int32),
        ("router", ctypes.POINTER(ctypes.c_void_p)),
        ("expert_gate_up", ctypes.POINTER(ctypes.POINTER(Mat))),
        ("expert_down", ctypes.POINTER(ctypes.POINTER(Mat))),
        ("shared_gate", ctypes.POINTER(ctypes.c_void_p)),
        ("act_bytes", ctypes.c_int32),
    ]


def _grouped(weight: torch.Tensor, tile: int, bits: int) -> tuple[torch.Tensor, int, int]:
    """(weights [tiles * tile, groups, 32] in fp32, zero rows padding the last tile,
    tiles, groups)."""
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"{bits}-bit needs the input size ({in_features}) divisible by {GROUP}")
    tiles, groups = -(-out_features // tile), in_features // GROUP
    w = torch.zeros(tiles * tile, in_features, dtype=torch.float32)
    w[:out_features] = weight.float()
    return w.view(tiles * tile, groups, GROUP), tiles, groups


def pack4(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """[out, in] float -> the 4-bit layout of native.c (uint8, tiles x groups x 20*tile)."""
    w, tiles, groups = _grouped(weight, tile, 4)
    low = w.amin(dim=-1).half()
    scale = ((w.amax(dim=-1) - low.float()) / 15.0).half()
    _check_finite(scale, low)
    divisor = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
    q = torch.round((w - low.float()[..., None]) / divisor[..., None]).clamp(0, 15)
    q = torch.where(scale.float()[..., None] > 0, q, torch.zeros(())).to(torch.uint8)
    # [t, o, g, b, half, j] -> byte (j) | (j + 4) << 4, laid out [t, g, b, o, j]
    q = q.view(tiles, tile, groups, 4, 2, 4)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    packed = packed.reshape(tiles, groups, 16 * tile)
    scales = scale.view(tiles, tile, groups).transpose(1, 2).contiguous()
    lows = low.view(tiles, tile, groups).transpose(1, 2).contiguous()
    return torch.cat([packed, _bytes(scales), _bytes(lows)], dim=-1).contiguous()


def pack8(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """[out, in] float -> the 8-bit layout of native.c (uint8, tiles x groups x 34*tile)."""
    w, tiles, groups = _grouped(weight, tile, 8)
    scale = (w.abs().amax(dim=-1) / 127.0).half()
    _check_finite(scale)
    divisor = torch.where(scale.float() > 0, scale.float(), torch.ones(()))
    q = torch.round(w / divisor[..., None]).clamp(-127, 127).to(torch.int8)
    q = q.view(tiles, tile, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 32 * tile)
    scales = scale.view(tiles, tile, groups).transpose(1, 2).contiguous()
    return torch.cat([q.view(torch.uint8), _bytes(scales)], dim=-1).contiguous()


# Rows packed at a time: packing makes several fp32 temporaries of its input's size
# (a 49k x 2048 head's would be GBs at once); tiles are independent, so parts of
# whole tiles packed one after the other give the same bytes.
PACK_ROWS = 4096


def pack_in_parts(weight: torch.Tensor, bits: int, tile: int) -> torch.Tensor:
    """pack4 or pack8 of `weight`, PACK_ROWS rows (whole tiles) at a time."""
    pack = pack4 if bits == 4 else pack8
    rows = max(tile, PACK_ROWS // tile * tile)
    if weight.shape[0] <= rows:
        return pack(weight, tile)
    parts = [pack(weight[first : first + rows], tile) for first in range(0, weight.shape[0], rows)]
    return torch.cat(parts)


def unpack(packed: torch.Tensor, bits: int, out_features: int, in_features: int) -> torch.Tensor:
    """The float weights [out, in] a packed matrix stands for (for tests and the gate)."""
    tiles, groups, width = packed.shape
    tile = width // (20 if bits == 4 else 34)
    if bits == 4:
        nibbles = packed[..., : 16 * tile].view(tiles, groups, 4, tile, 4)
        low, high = nibbles & 15, nibbles >> 4
        q = torch.stack([low, high], dim=-2).permute(0, 3, 1, 2, 4, 5)  # t, o, g, b, half, j
        q = q.reshape(tiles * tile, groups, GROUP).float()
        scale = _halves(packed[..., 16 * tile : 18 * tile], tiles, tile, groups)
        low_value = _halves(packed[..., 18 * tile :], tiles, tile, groups)
        w = q * scale[..., None] + low_value[..., None]
    else:
        q = packed[..., : 32 * tile].contiguous().view(torch.int8).view(tiles, groups, 8, tile, 4)
        q = q.permute(0, 3, 1, 2, 4).reshape(tiles * tile, groups, GROUP).float()
        w = q * _halves(packed[..., 32 * tile :], tiles, tile, groups)[..., None]
    return w.reshape(tiles * tile, in_features)[:out_features]


def _halves(raw: torch.Tensor, tiles: int, tile: int, groups: int) -> torch.Tensor:
    values = raw.contiguous().view(torch.float16).float()  # [t, g, o]
    return values.transpose(1, 2).reshape(tiles * tile, groups)


def _bytes(halves: torch.Tensor) -> torch.Tensor:
    return halves.contiguous().view(torch.uint8)


def _check_finite(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if not torch.isfinite(tensor).all():
            raise ValueError("a weight group's scale does not fit in fp16")


@dataclass(frozen=True)
class Part:
    """One matrix of a product: native.c's tiles of one kind (ggml_blocks.KINDS)."""

    packed: torch.Tensor  # uint8 [tiles, ...]
    kind: str
    out_features: int
    in_features: int
    source: str  # what the tiles hold: a GGML type as shipped, or a requantisation
    scale: float = 1.0  # the outputs times this


def quantized_part(weight: torch.Tensor, bits: int, tile: int, scale: float = 1.0) -> Part:
    """A float matrix [out, in] in fencepost's 4-bit (Q4_1) or 8-bit (Q8_0) groups."""
    if weight.device.type != "cpu":
        raise ValueError("the native formats are CPU formats")
    out_features, in_features = weight.shape
    packed = pack_in_parts(weight.detach(), bits, tile)
    kind = "q4" if bits == 4 else "q8"
    return Part(packed, kind, out_features, in_features, f"fencepost {bits}-bit groups", scale)


class NativeProduct:
    """y = x @ W.T with W in native.c's tiles: a weight format's Projection. Either a
    float matrix quantized at `bits` (4 or 8), or `parts` already packed (a GGUF's
    blocks as shipped: adapters/engine/ggml_blocks.py), one after another in the outputs.
    `act_bytes`: each product's activations in two bytes (w4a16) or one (w4a8)."""

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        bits: int = 4,
        library: Library | None = None,
        parts: list[Part] | None = None,
        act_bytes: int = 2,
    ) -> None:
        from adapters.engine.ggml_blocks import KINDS

        if act_bytes not in (1, 2):
            raise ValueError(f"activations of 1 or 2 bytes, not {act_bytes}")
        self.act_bytes = act_bytes
        self.library = library or load()
        if parts is None:
            if weight is None:
                raise ValueError("a native product needs a weight or packed parts")
            parts = [quantized_part(weight, bits, self.library.tile)]
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("the parts of one product take the same inputs")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self._mats = (Mat * len(parts))()
        for index, part in enumerate(parts):
            self._mats[index] = Mat(
                part.out_features,
                part.in_features,
                part.in_features // GROUP,
                part.packed.shape[0],
                KINDS[part.kind],
                part.packed.data_ptr(),
                part.scale,
                None,
            )
        for index in range(len(parts) - 1):
            self._mats[index].next = ctypes.pointer(self._mats[index + 1])
        self.mat = self._mats[0]
        self.nbytes = sum(part.packed.numel() for part in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        self.library.matmul(self.mat, flat, y, self.act_bytes)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, index: torch.Tensor, part: int = 0) -> torch.Tensor:
        """Rows `index` of one part as the kernels see them (fp32, times its scale)."""
        index = index.to(torch.int64).contiguous()
        out = torch.empty(index.shape[0], self.in_features, dtype=torch.float32)
        if index.numel() and (
            int(index.min()) < 0 or int(index.max()) >= self.parts[part].out_features
        ):
            raise IndexError("a row outside the matrix")
        self.library.handle.fp_unpack_rows(
            ctypes.byref(self._mats[part]), index.data_ptr(), index.shape[0], out.data_ptr()
        )
        return out

    def dense(self) -> torch.Tensor:
        """Every weight as the kernels use it (for tests and the quality gate)."""
        return torch.cat(
            [self.rows(torch.arange(part.out_features), n) for n, part in enumerate(self.parts)]
        )


# What the fused pass computes beyond the plain Llama layer (spec.ModelSpec.features):
# all of it.
NATIVE_FEATURES = frozenset({
    "window", "softcap", "qk_norm_head", "qk_norm_width", "qkv_bias", "o_bias",
    "no_rotary", "mlp_bias", "gelu_tanh", "post_norms", "no_pre_norms", "partial_rotary",
    "final_softcap", "experts", "shared_expert",
})  # fmt: skip


def model_problem(spec: ModelSpec, block_size: int = 16) -> str | None:
    """Why the fused pass cannot run this model, or None when it can: a feature of its
    layers native.c does not compute, or shapes its tiles cannot take."""
    missing = sorted(spec.features() - NATIVE_FEATURES)
    if missing:
        return f"the fused pass does not compute {', '.join(missing)}"
    head_dim = spec.head_dim
    if head_dim % 16 or head_dim > 512:
        return f"head_dim {head_dim}: the fused pass needs a multiple of 16 up to 512"
    mlps = {layer.mlp.intermediate for layer in spec.layers if layer.mlp is not None}
    mixtures = {layer.experts for layer in spec.layers if layer.experts is not None}
    widths = [("hidden_size", spec.hidden)]
    widths += [("intermediate_size", width) for width in mlps]
    widths += [("moe_intermediate_size", experts.intermediate) for experts in mixtures]
    for name, width in widths:
        if width % GROUP:
            return f"{name} {width}: the native formats need a multiple of {GROUP}"
    if len(mlps) > 1:
        return "layers of different widths"
    if len(mixtures) > 1:
        return "layers with different mixtures of experts"
    activations = {layer.mlp.activation for layer in spec.layers if layer.mlp is not None}
    activations |= {experts.activation for experts in mixtures}
    if len(activations) > 1:
        return "MLPs with different activations"
    if spec.heads * head_dim % GROUP:
        return f"attention width {spec.heads * head_dim}: not a multiple of {GROUP}"
    if block_size % 16:
        return f"block size {block_size}: the fused pass needs a multiple of 16"
    return None


class NativeModel:
    """A runner's weights, norms, rotary tables and KV cache, as native.c's Model: one
    call runs a whole decode step. Keeps every tensor it points at alive. The runner's
    KV cache is fp16 in this format, each block's keys transposed ([dim][block_size],
    native.c's attend_head): only native.c reads or writes it."""

    def __init__(self, runner: Any) -> None:
        layers = runner.layers
        products = [layer.qkv for layer in layers] + [runner.lm_head]
        if not all(isinstance(p, NativeProduct) for p in products):
            raise ValueError("the fused step needs native products")
        widths = {p.act_bytes for p in products}
        if len(widths) != 1:
            raise ValueError("the fused step quantizes every product's activations alike")
        act_bytes = widths.pop()
        self.library: Library = runner.lm_head.library
        problem = model_problem(runner.spec, runner.block_size)
        if problem:
            raise ValueError(problem)
        spec = runner.spec
        count = len(layers)

        def mats(name: str) -> Any:  # a layer without the product: an empty Mat
            found = [getattr(layer, name) for layer in layers]
            return (Mat * count)(*(Mat() if p is None else p.mat for p in found))

        self._mats = {name: mats(name) for name in ("qkv", "o", "gate_up", "down")}
        keep: list[Any] = [runner.embed, runner.final_norm, runner.lm_head]
        # The embedding table: fp32 rows, or a packed matrix whose rows native.c unpacks
        # (a GGUF's table as shipped, often the tied output projection itself).
        shipped_embed = isinstance(runner.embed, NativeProduct)
        if shipped_embed and len(runner.embed.parts) != 1:
            raise ValueError("the embedding table is one matrix")

        def pointers(tensors: list[torch.Tensor | None]) -> Any:
            """A [layers] array of data pointers (NULL for None), its tensors kept alive."""
            for tensor in tensors:
                if tensor is not None:
                    assert tensor.dtype == torch.float32 and tensor.is_contiguous()
                    keep.append(tensor)
            array = (ctypes.c_void_p * count)(
                *(t.data_ptr() if t is not None else None for t in tensors)
            )
            keep.append(array)
            return ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))

        attention = [layer.attention for layer in spec.layers]
        tables = [None if a.rotary is None else runner.rotary_tables[a.rotary] for a in attention]
        rot_dims = {table[0].shape[-1] for table in tables if table is not None}
        if len(rot_dims) > 1:
            raise ValueError("the fused pass rotates the same part of every head in all layers")
        per_layer = {
            "cos": [None if t is None else t[0].contiguous() for t in tables],
            "sin": [None if t is None else t[1].contiguous() for t in tables],
            "qkv_bias": [w.qkv_bias for w in layers],
            "o_bias": [w.o_bias for w in layers],
            "gate_up_bias": [w.gate_up_bias for w in layers],
            "down_bias": [w.down_bias for w in layers],
            "q_norm": [w.q_norm for w in layers],
            "k_norm": [w.k_norm for w in layers],
            "attn_out_norm": [w.post_attention for w in layers],
            "mlp_out_norm": [w.post_mlp for w in layers],
        }
        windows = (ctypes.c_int32 * count)(*(a.window or 0 for a in attention))
        caps = (ctypes.c_float * count)(*(a.softcap or 0.0 for a in attention))
        keep += [windows, caps]
        inter = next((w.down.in_features for w in layers if w.down is not None), 0)
        mixture = next((layer.experts for layer in spec.layers if layer.experts), None)
        experts = self._experts(layers, keep)
        self.struct = ModelStruct(
            hidden=spec.hidden,
            heads=runner.heads,
            kv_heads=runner.kv_heads,
            head_dim=runner.head_dim,
            inter=inter,
            vocab=runner.vocab_size,
            layers=count,
            block_size=runner.block_size,
            slots=runner.k_cache.shape[2],  # the pool and the scratch block
            max_context=runner.max_context,
            eps=runner.eps,
            embed=None if shipped_embed else runner.embed.data_ptr(),
            embed_mat=ctypes.pointer(runner.embed.mat) if shipped_embed else None,
            final_norm=runner.final_norm.data_ptr(),
            head=ctypes.pointer(runner.lm_head.mat),
            input_norm=pointers([w.pre_attention for w in layers]),
            post_norm=pointers([w.pre_mlp for w in layers]),
            qkv=ctypes.cast(self._mats["qkv"], ctypes.POINTER(Mat)),
            o=ctypes.cast(self._mats["o"], ctypes.POINTER(Mat)),
            gate_up=ctypes.cast(self._mats["gate_up"], ctypes.POINTER(Mat)),
            down=ctypes.cast(self._mats["down"], ctypes.POINTER(Mat)),
            k_cache=runner.k_cache.data_ptr(),
            v_cache=runner.v_cache.data_ptr(),
            **{name: pointers(tensors) for name, tensors in per_layer.items()},
            window=ctypes.cast(windows, ctypes.POINTER(ctypes.c_int32)),
            softcap=ctypes.cast(caps, ctypes.POINTER(ctypes.c_float)),
            rot_dim=rot_dims.pop() if rot_dims else runner.head_dim,
            qk_norm_width=int(any(a.qk_norm == "width" for a in attention)),
            gelu=int("gelu_tanh" in spec.features()),
            final_softcap=spec.final_softcap or 0.0,
            top_k=mixture.top_k if mixture else 0,
            expert_inter=mixture.intermediate if mixture else 0,
            renormalise=int(mixture.renormalise) if mixture else 0,
            router=pointers([w.moe.router if w.moe else None for w in layers]),
            shared_gate=pointers([w.moe.shared_gate if w.moe else None for w in layers]),
            **experts,
            act_bytes=act_bytes,
        )
        self._keep = keep
        self.vocab = runner.vocab_size
        self.max_context = runner.max_context
        self.blocks = runner.num_blocks
        self.block_size = runner.block_size

    @staticmethod
    def _experts(layers: list[Any], keep: list[Any]) -> dict[str, Any]:
        """The mixtures' fields of native.c's Model: per layer its expert count and
        whether an MLP (or shared expert) runs, and arrays of its experts' matrices."""
        count = len(layers)
        numbers = (ctypes.c_int32 * count)(*(len(w.moe.gate_up) if w.moe else 0 for w in layers))
        has_mlp = (ctypes.c_int32 * count)(*(int(w.gate_up is not None) for w in layers))
        keep += [numbers, has_mlp]
        arrays = {}
        for name in ("gate_up", "down"):
            per_layer = []
            for w in layers:
                products = getattr(w.moe, name) if w.moe else []
                if not all(isinstance(p, NativeProduct) for p in products):
                    raise ValueError("the fused step needs native products")
                mats = (Mat * len(products))(*(p.mat for p in products))
                keep += [mats, products]
                empty = ctypes.POINTER(Mat)()  # NULL: a layer without experts
                per_layer.append(ctypes.cast(mats, ctypes.POINTER(Mat)) if products else empty)
            array = (ctypes.POINTER(Mat) * count)(*per_layer)
            keep.append(array)
            arrays[f"expert_{name}"] = ctypes.cast(array, ctypes.POINTER(ctypes.POINTER(Mat)))
        return {
            "experts": ctypes.cast(numbers, ctypes.POINTER(ctypes.c_int32)),
            "has_mlp": ctypes.cast(has_mlp, ctypes.POINTER(ctypes.c_int32)),
            **arrays,
        }

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        wanted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, positions [rows] (int64), tables [rows, width] block ids -> logits
        [len(wanted), vocab] of the `wanted` rows (default: every row). native.c's
        fp_forward: a decode step, or prefill chunks given as one row per token."""
        rows = tokens.shape[0]
        tokens = tokens.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        tables = tables.to(torch.int32).contiguous()
        # C indexes with these unchecked: what torch would refuse is refused here
        if rows and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab):
            raise IndexError(f"a token id is outside the vocabulary of {self.vocab}")
        if rows and (int(positions.min()) < 0 or int(positions.max()) >= self.max_context):
            raise IndexError(f"a position is outside the context of {self.max_context}")
        if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= self.blocks):
            raise IndexError(f"a block id is outside the pool of {self.blocks}")
        if rows and tables.shape[1] * self.block_size <= int(positions.max()):
            raise IndexError("a block table is too short for its row's position")
        if wanted is None:
            wanted = torch.arange(rows, dtype=torch.int32)
        wanted = wanted.to(torch.int32).contiguous()
        logits = torch.empty(wanted.shape[0], self.vocab, dtype=torch.float32)
        failed = self.library.handle.fp_forward(
            ctypes.byref(self.struct),
            rows,
            tokens.data_ptr(),
            positions.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            wanted.data_ptr(),
            wanted.shape[0],
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("native forward pass: out of memory")
        return logits
