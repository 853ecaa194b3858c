"""FENCEPOST_CHECK_INDICES=1: every index a step hands its kernels checked first.

The check must pass every step of ordinary serving (eager, fixed-shape, prefill,
sampling) without changing a token, and must stop a step that would read
outside the pool, the context or the vocabulary, naming what is wrong, before
any kernel runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from adapters.engine.engine import Engine
from adapters.engine.index_check import IndexCheckError, check_picks, check_rows
from tests.engine.test_engine import run, tiny_llama
from tests.engine.test_static_decode import REQUESTS, engine

BOUNDS: dict[str, Any] = {"vocab": 100, "max_context": 64, "block_size": 16, "num_blocks": 8}


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return tiny_llama()


def test_rows_within_their_bounds_pass() -> None:
    check_rows("decode", [0, 99], [0, 63], [[7], [0, 1, 2, 3]], **BOUNDS)
    # A fixed-shape step: a live row's unread entries may be the scratch block (8),
    # padding rows read position 0 through nothing else.
    tables = torch.tensor([[3, 8, 8, 8], [8, 8, 8, 8]])
    check_rows("decode", torch.tensor([5, 0]), torch.tensor([3, 0]), tables, live=1, **BOUNDS)


@pytest.mark.parametrize(
    ("tokens", "positions", "tables", "live", "said"),
    [
        ([100], [0], [[0]], None, "token 100 is outside the vocabulary [0, 100)"),
        ([-1], [0], [[0]], None, "token -1 is outside"),
        ([1], [64], [[0, 1, 2, 3, 4]], None, "position 64 is outside the context [0, 64)"),
        ([1], [16], [[0]], None, "position 16 needs 2 table entries, the table has 1"),
        ([1], [17], [[0, 9]], None, "table entry 1 is 9, not a block of the pool [0, 8)"),
        ([1], [3], [[8]], None, "table entry 0 is 8, not a block of the pool"),
        ([1], [3], [[0, 9]], None, "table entry 1 is 9, not a block or the scratch block [0, 9)"),
        ([1, 0], [3, 0], [[0], [2]], 1, "row 1 is padding but reads position 0 through [2]"),
        ([1, 0], [3, 5], [[0], [8]], 1, "row 1 is padding but reads position 5"),
    ],
)
def test_each_bound_stops_the_step_and_names_itself(
    tokens: list[int], positions: list[int], tables: list[list[int]], live: int | None, said: str
) -> None:
    with pytest.raises(IndexCheckError, match=said.replace("[", r"\[").replace(")", r"\)")):
        check_rows("decode", tokens, positions, tables, live=live, **BOUNDS)


def test_a_sampled_token_past_the_vocabulary_is_named() -> None:
    check_picks([0, 99], 100)
    with pytest.raises(IndexCheckError, match="sampling row 1: token 100"):
        check_picks([0, 100], 100)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_checked_serving_gives_the_same_tokens(
    tiny: LlamaForCausalLM, decode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = run(engine(tiny, decode=decode), REQUESTS)
    monkeypatch.setenv("FENCEPOST_CHECK_INDICES", "1")
    checked = engine(tiny, decode=decode)
    assert checked.runner.check_indices
    assert run(checked, REQUESTS) == plain


def _corrupt_tables(eng: Engine, bad: int) -> None:
    """Every table the block manager hands out gets `bad` in place of its first entry."""
    table = eng.blocks.table

    def corrupted(key: Any) -> list[int]:
        return [bad, *table(key)[1:]]

    eng.blocks.table = corrupted  # type: ignore[method-assign]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize(("bad", "kind"), [(10_000, "prefill"), (-1, "prefill")])
def test_a_table_outside_the_pool_stops_the_step(
    tiny: LlamaForCausalLM, decode: str, bad: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEPOST_CHECK_INDICES", "1")
    eng = engine(tiny, decode=decode)
    _corrupt_tables(eng, bad)
    with pytest.raises(IndexCheckError, match=f"{kind} row 0: table entry 0 is {bad}"):
        run(eng, REQUESTS[:1])


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_decode_through_a_corrupted_table_is_stopped(
    tiny: LlamaForCausalLM, decode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill is sound; the tables go bad once decoding starts (the scratch block,
    which no sequence may read, in place of the first block)."""
    monkeypatch.setenv("FENCEPOST_CHECK_INDICES", "1")
    eng = engine(tiny, decode=decode)
    prefill = eng._prefill

    def then_corrupt(*args: Any) -> None:
        prefill(*args)
        _corrupt_tables(eng, eng.runner.scratch_block)

    eng._prefill = then_corrupt  # type: ignore[method-assign]
    with pytest.raises(IndexCheckError, match="decode row 0: table entry 0 is"):
        run(eng, REQUESTS[:1])


def test_without_the_setting_nothing_is_checked(
    tiny: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FENCEPOST_CHECK_INDICES", raising=False)
    assert not engine(tiny).runner.check_indices
