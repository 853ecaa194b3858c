"""The machines' tables: anything missing is a misuse, and docs/design/core.md shows them as
they are in code."""

from __future__ import annotations

import enum
import itertools
import re
from pathlib import Path

import pytest

from core.protocol import (
    Assignment,
    Cancel,
    FromRouterMessage,
    GenerationRequest,
    Offer,
)
from core.states import (
    ASSIGNMENT,
    HEALTH,
    HOLD,
    REQUEST,
    TERMINAL,
    AssignmentEvent,
    AssignmentState,
    Health,
    HealthEvent,
    Hold,
    HoldEvent,
    Misuse,
    Phase,
    RequestEvent,
    RouterMisuse,
    Table,
    WorkerMisuse,
)
from core.worker import Worker, WorkerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "core.md"

MACHINES: list[tuple[str, Table, type[enum.Enum], type[enum.Enum], type[Misuse]]] = [  # type: ignore[type-arg]
    ("Request phase", REQUEST, Phase, RequestEvent, RouterMisuse),
    ("Slot hold", HOLD, Hold, HoldEvent, RouterMisuse),
    ("Worker health", HEALTH, Health, HealthEvent, RouterMisuse),
    ("Assignment at the worker", ASSIGNMENT, AssignmentState, AssignmentEvent, WorkerMisuse),
]


@pytest.mark.parametrize(("title", "table", "states", "events", "misuse"), MACHINES)
def test_every_pair_off_the_table_is_a_misuse(
    title: str,
    table: Table,  # type: ignore[type-arg]
    states: type[enum.Enum],
    events: type[enum.Enum],
    misuse: type[Misuse],
) -> None:
    listed = {(state, event): nxt for state, event, nxt in table.pairs()}
    assert listed, title
    for state, event in itertools.product(states, events):
        if (state, event) in listed:
            assert table.next(state, event) is listed[(state, event)]
        else:
            with pytest.raises(misuse, match=f"no move from {state.value} on {event.value}"):
                table.next(state, event)


def test_terminal_phases_and_a_free_slot_have_no_way_out_but_the_expected_one() -> None:
    for state, _, _ in REQUEST.pairs():
        assert state not in TERMINAL
    assert [event for state, event, _ in HOLD.pairs() if state is Hold.FREE] == [
        HoldEvent.OFFER_SENT
    ]
    # Everything the router may count against a slot can be released.
    for state in Hold:
        if state is not Hold.FREE:
            assert HOLD.next(state, HoldEvent.RELEASED) is Hold.FREE


def test_an_illegal_move_asked_of_the_worker_raises_instead_of_freeing_a_slot_twice() -> None:
    """Ending an assignment that is not active is a bug in our code: the table refuses it
    before any slot accounting changes."""
    worker = Worker(WorkerConfig("w", slots=1))
    assignment = Assignment("r", 1)
    offer = Offer("w", 0, assignment, GenerationRequest("r", (1, 2), 4))
    worker.handle(FromRouterMessage(offer), 0.0)
    worker.handle(FromRouterMessage(Cancel(assignment)), 0.0)
    assert worker.state_of(assignment) is AssignmentState.ENDED
    assert worker.free_slots == 1
    with pytest.raises(WorkerMisuse, match="no move from ended on cancel"):
        worker._end(assignment, "cancelled", AssignmentEvent.CANCEL, [])
    assert worker.free_slots == 1


def _doc_rows(title: str) -> set[tuple[str, str, str]]:
    """(state, event, next) rows of the first table under the heading `title` in core.md."""
    text = DOC.read_text()
    heading = re.search(rf"^#+ {re.escape(title)}\b.*$", text, re.MULTILINE)
    assert heading is not None, f"core.md has no heading {title!r}"
    rows: set[tuple[str, str, str]] = set()
    started = False
    for line in text[heading.end() :].splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
            if cells[0] in ("state", "phase") or set(cells[0]) <= {"-", " "}:
                continue
            for state, event in itertools.product(cells[0].split(" / "), cells[1].split(" / ")):
                rows.add((state, event, cells[2]))
        elif started:
            break
    return rows


@pytest.mark.parametrize(("title", "table"), [machine[:2] for machine in MACHINES])
def test_the_design_note_shows_each_table_as_it_is(
    title: str,
    table: Table,  # type: ignore[type-arg]
) -> None:
    in_code = {(s.value, e.value, n.value) for s, e, n in table.pairs()}
    assert _doc_rows(title) == in_code
