"""An opt-in check of every index a step hands its kernels (FENCEPOST_CHECK_INDICES=1).

A kernel that reads a block id past the pool, a position past the rotary tables
or a token id past the embedding does not fail where the mistake is: on a GPU it
reads or writes someone else's memory, and the fault (if any) surfaces later at
whatever call next synchronises, with the CUDA context poisoned. With the check
on, a Runner validates what each decode step and each prefill is about to hand
its kernels, on the host, before they run, and the engine validates each step's
sampled tokens; a violation raises IndexCheckError naming the step kind, the
row and the value against its bound.

It reads the inputs back from the device (one synchronisation per step), so it
is for finding a fault, not for serving: off by default, and read once, when a
Runner is made (`checking()`).

What a step's rows must hold (rows past `live` are a fixed-shape step's padding):
- a token id in [0, vocab) and a position in [0, max_context);
- a table that covers the position: position // block_size + 1 entries;
- the entries a live row reads (up to its position) in [0, num_blocks): the pool's
  own blocks, never the scratch block; every other entry of the table in
  [0, num_blocks], the scratch block included;
- a padding row: position 0 and nothing but the scratch block.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ENVIRONMENT = "FENCEPOST_CHECK_INDICES"


class IndexCheckError(RuntimeError):
    """An index a step was about to hand its kernels is out of its bounds."""


def checking() -> bool:
    """Whether the bounds check is asked for (FENCEPOST_CHECK_INDICES=1)."""
    return os.environ.get(ENVIRONMENT, "").strip().lower() in ("1", "true", "yes", "on")


def check_rows(
    kind: str,
    tokens: torch.Tensor | list[int],
    positions: torch.Tensor | list[int],
    tables: torch.Tensor | list[list[int]],
    *,
    vocab: int,
    max_context: int,
    block_size: int,
    num_blocks: int,
    live: int | None = None,
) -> None:
    """Raise IndexCheckError unless every row (token, position, table: a tensor
    [rows, width] or the lists as the block manager gave them, before any padding
    could hide a table too short) is within the bounds the module docstring lists;
    rows from `live` on (None: none) are padding rows."""
    token_list, position_list = _listed(tokens), _listed(positions)
    table_rows = _listed(tables)
    count = len(token_list)
    if len(position_list) != count or len(table_rows) != count:
        raise IndexCheckError(
            f"{kind}: {count} tokens, {len(position_list)} positions and {len(table_rows)} tables"
        )
    live = count if live is None else live
    scratch = num_blocks
    for row, (token, position, table) in enumerate(
        zip(token_list, position_list, table_rows, strict=True)
    ):
        where = f"{kind} row {row}"
        if not 0 <= token < vocab:
            raise IndexCheckError(f"{where}: token {token} is outside the vocabulary [0, {vocab})")
        if not 0 <= position < max_context:
            raise IndexCheckError(
                f"{where}: position {position} is outside the context [0, {max_context})"
            )
        needed = position // block_size + 1
        if needed > len(table):
            raise IndexCheckError(
                f"{where}: position {position} needs {needed} table entries, the table has "
                f"{len(table)}"
            )
        if row >= live:
            if position != 0 or any(block != scratch for block in table):
                raise IndexCheckError(
                    f"{where} is padding but reads position {position} through {table}; "
                    f"padding reads position 0 in the scratch block {scratch} only"
                )
            continue
        for entry, block in enumerate(table):
            top = num_blocks if entry < needed else num_blocks + 1
            if not 0 <= block < top:
                what = "a block of the pool" if entry < needed else "a block or the scratch block"
                raise IndexCheckError(
                    f"{where}: table entry {entry} is {block}, not {what} [0, {top})"
                )


def _listed(values: torch.Tensor | list[Any]) -> list[Any]:
    if isinstance(values, torch.Tensor):
        listed: list[Any] = values.detach().cpu().tolist()
        return listed
    return values


def check_picks(picks: list[int], vocab: int) -> None:
    """Raise IndexCheckError unless every sampled token is in [0, vocab)."""
    for row, token in enumerate(picks):
        if not 0 <= token < vocab:
            raise IndexCheckError(
                f"sampling row {row}: token {token} is outside the vocabulary [0, {vocab})"
            )
