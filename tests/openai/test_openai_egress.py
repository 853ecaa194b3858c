"""Detokenizing, stop strings and the per-client queue, without a server."""

from __future__ import annotations

import pytest
import trio

from adapters.openai.egress import (
    ClientLimits,
    ClientOverflow,
    ClientQueue,
    IncrementalDetokenizer,
    StopMatcher,
)

# A byte-level vocabulary: token i is PIECES[i]; multi-byte characters are split.
TEXT = "naïve 🙂 déjà-vu 日本!"
RAW = TEXT.encode()
PIECES = [RAW[i : i + 1] for i in range(len(RAW))]  # every byte its own token


def decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_characters_split_across_tokens_are_sent_whole_and_never_as_replacement() -> None:
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.push(i) for i in range(len(PIECES))]
    assert "".join(deltas) + detok.flush() == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # the 4 bytes of the emoji give three empty deltas, then the whole character
    start = RAW.index("🙂".encode())
    assert deltas[start : start + 4] == ["", "", "", "🙂"]


def test_invalid_bytes_at_the_very_end_are_flushed_as_they_are() -> None:
    detok = IncrementalDetokenizer(decode)
    start = RAW.index("🙂".encode())
    for i in range(start + 2):  # the emoji cut off after two of its bytes
        detok.push(i)
    assert detok.flush() == "\ufffd"


def feed_all(matcher: StopMatcher, parts: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in parts)
    return out + matcher.flush()


def test_a_stop_string_spanning_deltas_is_cut_and_never_sent() -> None:
    matcher = StopMatcher(("STOP",))
    sent = [matcher.feed(p) for p in ["hello S", "T", "OP and more"]]
    assert sent == ["hello ", "", ""]
    assert matcher.matched == "STOP"
    assert matcher.feed("after") == "" and matcher.flush() == ""


def test_a_held_prefix_that_does_not_become_a_stop_is_released() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("a ST") == "a "  # "ST" could start STOP: held
    assert matcher.feed("ART") == "START"
    assert feed_all(StopMatcher(("STOP",)), ["end ST"]) == "end ST"  # released at the end


def test_the_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(("world", "lo w"))
    assert matcher.feed("hello world") == "hel"
    assert matcher.matched == "lo w"


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_matching_does_not_depend_on_how_text_is_split(cut: int) -> None:
    text = "abcXYZdefXY"
    parts = [text[:cut], text[cut:]]
    assert feed_all(StopMatcher(("XYZ",)), parts) == "abc"
    assert feed_all(StopMatcher(("XYQ",)), parts) == text


def test_the_client_queue_merges_text_when_congested_and_fails_past_the_ceiling() -> None:
    async def main() -> None:
        limits = ClientLimits(max_events=8, high_water_bytes=400, low_water_bytes=200,
                              ceiling_bytes=2000)  # fmt: skip
        queue = ClientQueue(limits, lambda text, _choice: f"data: {text}\n\n".encode())
        queue.put_frame(b"data: first\n\n")
        for i in range(20):
            queue.put_delta(f"w{i:02d} ")
        assert len(queue) <= limits.max_events
        assert queue.merged > 0
        data = await queue.take()  # the writer catches up: the same text, fewer frames
        text = "".join(
            line[6:] for line in data.decode().split("\n\n") if line.startswith("data: w")
        )
        assert text == "".join(f"w{i:02d} " for i in range(20))
        assert not queue.congested
        queue.put_delta("x" * 3000)  # past the ceiling
        assert queue.failed is not None
        with pytest.raises(ClientOverflow):
            await queue.take()

    trio.run(main)


def _byte_queue(limits: ClientLimits) -> ClientQueue:
    return ClientQueue(limits, lambda text, _choice: f"data: {text}\n\n".encode())


def test_congestion_begins_exactly_at_the_high_watermark_and_ends_under_the_low_one() -> None:
    async def main() -> None:
        limits = ClientLimits(max_events=1000, high_water_bytes=1000, low_water_bytes=400,
                              ceiling_bytes=100_000)  # fmt: skip
        queue = _byte_queue(limits)
        overhead = len(b"data: \n\n")
        piece = "x" * (100 - overhead)  # each delta is exactly 100 queued bytes
        for _ in range(10):
            queue.put_delta(piece)
        assert (queue.bytes, len(queue), queue.merged) == (1000, 10, 0)  # below: one event each
        queue.put_delta(piece)  # the queue now holds the high watermark: merged from here on
        assert (len(queue), queue.merged, queue.congested) == (10, 1, True)
        for _ in range(5):
            queue.put_delta(piece)
        assert (len(queue), queue.merged) == (10, 6)
        await queue.take()  # the writer drains it: under the low watermark again
        queue.put_delta(piece)
        queue.put_delta(piece)
        assert (len(queue), queue.merged, queue.congested) == (2, 6, False)

    trio.run(main)


def test_congestion_also_begins_near_the_event_limit() -> None:
    limits = ClientLimits(max_events=20, high_water_bytes=10**6, low_water_bytes=10**5,
                          ceiling_bytes=10**7)  # fmt: skip
    queue = _byte_queue(limits)
    for _ in range(40):
        queue.put_delta("w")
    assert len(queue) == limits.max_events - 4  # never more events than the limit allows
    assert queue.merged == 40 - (limits.max_events - 4)


def test_the_ceiling_fails_only_past_it() -> None:
    limits = ClientLimits(max_events=1000, high_water_bytes=50, low_water_bytes=20,
                          ceiling_bytes=1000)  # fmt: skip
    queue = _byte_queue(limits)
    queue.put_frame(b"x" * 1000)
    assert queue.failed is None  # exactly at the ceiling
    queue.put_frame(b"x")
    assert queue.failed is not None


def test_the_documented_client_limits_are_the_ones_in_force() -> None:
    from adapters.openai.server import HttpLimits

    limits = ClientLimits()
    assert (limits.max_events, limits.high_water_bytes, limits.low_water_bytes) == (
        256,
        64 * 1024,
        32 * 1024,
    )
    assert limits.ceiling_bytes == 1024 * 1024
    assert HttpLimits().client == limits
    assert HttpLimits().max_body_bytes == 1024 * 1024
