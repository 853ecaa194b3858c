"""`fencepost bench chat` end to end on fake workers, tiny: the table comes out, and its
cache figures are what a prefix cache must give a conversation.

It checks what the bench counts, not how fast anything is (figures come from
running the bench: README.md, docs/benchmarks.md).
"""

from __future__ import annotations

import math
from pathlib import Path

from bench import chat


def test_a_tiny_fake_chat_run_reports_cache_hits_on_later_turns(tmp_path: Path) -> None:
    load = chat.ChatLoad(
        conversations=3,
        turns=2,
        tokens=8,
        system_tokens=64,
        real_workers=(),
        fake_workers=(2,),
        routings=("cache-aware",),
        fake_prefill_ms_per_token=0.5,
        fake_step_ms=5.0,
        time_limit_s=60,
    )
    [row] = chat.run(load, logs=tmp_path)
    assert row.errors == 0
    assert [len(results) for results in row.turns] == [3, 3]
    assert all(r.completion_tokens > 0 and r.content for rs in row.turns for r in rs)
    first, later = row.prefill(slice(0, 1)), row.prefill(slice(1, None))
    assert first[1] > 64 * 3  # every conversation submitted at least its system prompt
    assert all(computed <= submitted for computed, submitted in (first, later))
    # a second turn resends the first turn's prompt: the worker that served it finds it
    assert later[0] < later[1]
    assert set(row.per_worker) <= {"w1", "w2"}
    assert sum(row.per_worker.values()) >= 6  # every turn's request was placed somewhere
    assert row.max_share >= 1.0 and row.rate > 0
    assert math.isfinite(row.ttft(slice(0, 1), 50)) and math.isfinite(row.ttft(slice(1, 2), 99))
    text = chat.table([row])
    assert "fake 2w cache on, cache-aware" in text and "computed/submitted" in text
