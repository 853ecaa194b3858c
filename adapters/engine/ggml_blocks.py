"""GGUF quant blocks into native.c's tiles as they were shipped: no fp32 copy, no
requantisation.

Each GGML type below is taken apart into the integers and half floats its blocks hold,
and laid out in one of native.c's matrix kinds (its header has the byte layouts), so
that every weight the kernels use is the value gguf's own dequantisation gives, bit
for bit (tests/engine/test_gguf_blocks.py compares them with gguf.dequantize):

| GGML type | kind | bits a weight read (file's) |
|---|---|---|
| Q4_0 | q4: scale d, minimum -8d (exact in fp16) | 5 (4.5) |
| Q4_1 | q4: scale d, minimum m | 5 (5) |
| Q8_0 | q8 | 8.5 (8.5) |
| Q4_K | q4k: per super-block d, dmin; per 32 the 6-bit sc and m | 4.625 (4.5) |
| Q5_K | q5k: nibbles and a plane of fifth bits; per 32 sc and m | 5.625 (5.5) |
| Q6_K | q6k: nibbles and two planes of high bits; per 16 the signed sc | 6.625 (6.5625) |
| F16, BF16 | f16, bf16 | 16 (16) |

Any other type (F32 matrices, Q5_0, Q5_1, Q2_K, Q3_K, the IQ types) is dequantised
and requantised to fencepost's 8-bit groups (`FALLBACK`), and the runner's start log
says which tensors were.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

KINDS = {"q4": 0, "q8": 1, "q4k": 2, "q5k": 3, "q6k": 4, "f16": 5, "bf16": 6}
# bytes of one tile per group of 32 inputs (in units of the tile's rows), and of a
# super-block's header (the K kinds: 8 groups a super-block)
PER_GROUP = {"q4": 20, "q8": 34, "q4k": 16, "q5k": 20, "q6k": 24, "f16": 64, "bf16": 64}
HEADER = {"q4k": 20, "q5k": 20, "q6k": 20}
# GGML type -> (kind, block bytes, weights a block)
SHIPPED = {
    "Q4_0": ("q4", 18, 32),
    "Q4_1": ("q4", 20, 32),
    "Q8_0": ("q8", 34, 32),
    "Q4_K": ("q4k", 144, 256),
    "Q5_K": ("q5k", 176, 256),
    "Q6_K": ("q6k", 210, 256),
    "F16": ("f16", 2, 1),
    "BF16": ("bf16", 2, 1),
}
FALLBACK = "fencepost 8-bit groups (requantised)"
GROUP = 32


def shippable(type_name: str, cols: int) -> bool:
    """Whether a matrix of this GGML type and row length runs as shipped (the K kinds
    need whole super-blocks of 256, the rest groups of 32)."""
    if type_name not in SHIPPED:
        return False
    return cols % (256 if SHIPPED[type_name][0] in HEADER else GROUP) == 0


def tile_bytes(kind: str, cols: int, tile: int) -> int:
    groups = cols // GROUP
    return (groups * PER_GROUP[kind] + groups // 8 * HEADER.get(kind, 0)) * tile


# Rows packed at a time: the layouts make a few temporaries of their input's size
# (a 49k-row head's would be hundreds of MB at once); tiles are independent.
PACK_ROWS = 4096


def pack_blocks(
    type_name: str, raw: Any, rows: int, cols: int, tile: int
) -> tuple[torch.Tensor, str]:
    """A GGUF tensor's data as shipped ([rows] rows of blocks; any numpy view of its
    bytes) -> (the tiles of its kind, uint8 [tiles, tile_bytes], and the kind)."""
    kind, block, per_block = SHIPPED[type_name]
    data = np.asarray(raw).view(np.uint8).reshape(rows, -1)
    if data.shape[1] != cols // per_block * block:
        raise ValueError(f"{type_name}: {data.shape[1]} bytes a row for {cols} weights")
    tiles = -(-rows // tile)
    out = torch.empty(tiles, tile_bytes(kind, cols, tile), dtype=torch.uint8)
    step = max(tile, PACK_ROWS // tile * tile)
    for first in range(0, rows, step):
        part = data[first : first + step]
        count = -(-part.shape[0] // tile)
        padded = np.zeros((count * tile, data.shape[1]), dtype=np.uint8)
        padded[: part.shape[0]] = part  # zero rows: zero scales, zero weights
        blocks = torch.from_numpy(padded).view(count * tile, cols // per_block, block)
        out[first // tile : first // tile + count] = _LAYOUTS[type_name](blocks, tile).reshape(
            count, -1
        )
    return out, kind


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The half float at byte `at` of each block, as its two bytes [..., 2]."""
    return blocks[..., at : at + 2]


def _per_row(values: torch.Tensor, tile: int) -> torch.Tensor:
    """[rows, n, width] bytes (width bytes per row and item) -> [tiles, n, tile * width]:
    a tile's rows side by side."""
    rows, n, width = values.shape
    return (
        values.contiguous()
        .view(rows // tile, tile, n, width)
        .transpose(1, 2)
        .reshape(rows // tile, n, tile * width)
    )


def _nibbles(q: torch.Tensor, tile: int) -> torch.Tensor:
    """q [rows, groups, 32] in 0..15 -> [tiles, groups, 16 * tile]: native.c's four
    sub-blocks (input 8b + j in the low nibble of byte 4 o + j, 8b + 4 + j high)."""
    rows, groups, _ = q.shape
    q = q.contiguous().view(rows // tile, tile, groups, 4, 2, 4)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    return packed.reshape(rows // tile, groups, 16 * tile)


def _bytes(q: torch.Tensor, tile: int) -> torch.Tensor:
    """q [rows, groups, 32] bytes -> [tiles, groups, 32 * tile]: eight sub-blocks of
    four inputs, a tile's rows side by side."""
    rows, groups, _ = q.shape
    q = q.contiguous().view(rows // tile, tile, groups, 8, 4).permute(0, 2, 3, 1, 4)
    return q.reshape(rows // tile, groups, 32 * tile)


def _halves(blocks: torch.Tensor, at: int, tile: int) -> torch.Tensor:
    """Each block's half float at byte `at` -> [tiles, blocks, 2 * tile]."""
    return _per_row(_f16(blocks, at).contiguous(), tile)


def _q4_0(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    qs = blocks[..., 2:18]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # weight j low nibble of byte j, j + 16 high
    d = _f16(blocks, 0).contiguous().view(torch.float16)
    low = (d.float() * -8.0).half()  # exact: a power of two times a half float
    if not torch.isfinite(low).all():
        raise ValueError("Q4_0: a block's scale times -8 does not fit in fp16")
    return _q4_tiles(q, _halves(blocks, 0, tile), _per_row(low.view(torch.uint8), tile), tile)


def _q4_1(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    qs = blocks[..., 4:20]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)
    return _q4_tiles(q, _halves(blocks, 0, tile), _halves(blocks, 2, tile), tile)


def _q4_tiles(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, tile: int) -> torch.Tensor:
    return torch.cat([_nibbles(q, tile), scale, low], dim=-1)


def _q8_0(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    return torch.cat([_bytes(blocks[..., 2:34], tile), _halves(blocks, 0, tile)], dim=-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K/Q5_K super-block -> its eight 6-bit scales and
    eight 6-bit minimums ([..., 8] each): the first four of each in the low six bits of
    bytes 0-3 and 4-7; the last four from bytes 8-11's nibbles, with two high bits
    from the top of bytes 0-3 (scales) and 4-7 (minimums)."""
    first, second, third = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([first & 63, (third & 15) | ((first >> 6) << 4)], dim=-1)
    m = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    return sc, m


def _k_tiles(
    blocks: torch.Tensor, d_at: int, dmin_at: int | None, scales: list[torch.Tensor],
    groups: torch.Tensor, tile: int,
) -> torch.Tensor:  # fmt: skip
    """A K kind's tiles: each super-block's header (d; dmin or zeros; then `scales`, the
    per-group bytes, [rows, super-blocks, 8 or 16] each, a tile's rows side by side)
    before its eight groups' quants ([tiles, super-blocks * 8, bytes])."""
    d = _halves(blocks, d_at, tile)
    dmin = _halves(blocks, dmin_at, tile) if dmin_at is not None else torch.zeros_like(d)
    tiles, supers = d.shape[0], d.shape[1]
    rows = tiles * tile
    header = [d, dmin] + [
        _per_row(part.reshape(rows, -1, 1), tile).reshape(tiles, supers, -1) for part in scales
    ]
    return torch.cat([*header, groups.reshape(tiles, supers, -1)], dim=-1)


def _q4_k(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    rows, supers = blocks.shape[0], blocks.shape[1]
    sc, m = _scale_min_k4(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 32)  # chunk c: groups 2c (low), 2c + 1
    q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, supers * 8, 32)
    return _k_tiles(blocks, 0, 2, [sc, m], _nibbles(q, tile), tile)


def _plane(high: torch.Tensor, tile: int, width: int) -> torch.Tensor:
    """The high bits of the groups' quants ([rows, groups, 32], `width` bits each) ->
    [tiles, groups, 4 * width * tile]: `width` planes a group, plane v for its inputs
    32v / width on; in plane v, bits width * (2s + h) of byte 4 o + j hold input
    8s + 4h + j of those, as native.c's q5k and q6k kernels read them."""
    rows, groups, _ = high.shape
    spans = 4 // width  # sub-blocks of 8 inputs a plane covers
    h = high.reshape(rows, groups, width, spans, 2, 4)
    byte = torch.zeros(rows, groups, width, 4, dtype=torch.uint8)
    for s in range(spans):
        for half in range(2):
            byte |= h[:, :, :, s, half] << (width * (2 * s + half))
    planes = _per_row(byte.reshape(rows, groups * width, 4), tile)
    return planes.reshape(rows // tile, groups, 4 * width * tile)


def _q5_k(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    rows, supers = blocks.shape[0], blocks.shape[1]
    sc, m = _scale_min_k4(blocks[..., 4:16])
    qh = blocks[..., 16:48]  # bit g of byte l: the fifth bit of weight l of group g
    qs = blocks[..., 48:176].reshape(rows, supers, 4, 32)
    low = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, supers * 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
    high = ((qh[:, :, None, :] >> shifts) & 1).reshape(rows, supers * 8, 32)
    groups = torch.cat([_nibbles(low, tile), _plane(high, tile, 1)], dim=-1)
    return _k_tiles(blocks, 0, 2, [sc, m], groups, tile)


def _q6_k(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    rows, supers = blocks.shape[0], blocks.shape[1]
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 2, 32)  # [half n][first/second 32]
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    low = torch.stack([ql & 15, ql >> 4], dim=3)  # [n][nibble][part]: weight 128n + 64k + 32p + l
    shifts = (torch.arange(4, dtype=torch.uint8) * 2).view(2, 2)  # bits 2(2k + p) of qh
    high = (qh[:, :, :, None, :, :] >> shifts.view(1, 1, 1, 2, 2, 1)) & 3
    sc = blocks[..., 192:208]  # signed, one per 16 weights
    low, high = low.reshape(rows, supers * 8, 32), high.reshape(rows, supers * 8, 32)
    groups = torch.cat([_nibbles(low, tile), _plane(high, tile, 2)], dim=-1)
    return _k_tiles(blocks, 208, None, [sc], groups, tile)


def _sixteen(blocks: torch.Tensor, tile: int) -> torch.Tensor:
    """F16 or BF16 values ([rows, cols, 2] bytes) -> per group, for each of its 32
    inputs, the tile's rows' two bytes side by side."""
    rows, cols, _ = blocks.shape
    v = blocks.reshape(rows // tile, tile, cols // GROUP, GROUP, 2).permute(0, 2, 3, 1, 4)
    return v.reshape(rows // tile, cols // GROUP, GROUP * tile * 2)


_LAYOUTS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "F16": _sixteen,
    "BF16": _sixteen,
}
