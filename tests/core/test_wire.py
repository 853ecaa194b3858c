"""The wire format: round trips, and bad frames as values rather than exceptions."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from core.protocol import (
    AnyWireMessage,
    Assignment,
    Cancel,
    Finished,
    GenerationRequest,
    Heartbeat,
    Offer,
    OfferResult,
    Sampling,
    Token,
    TokenLogprob,
    TokenRun,
)
from core.wire import FrameReader, WireError, decode_message, encode_frame, encode_message

A = Assignment("req-1", 2)
MESSAGES = [
    Offer("w1", 4, A, GenerationRequest("req-1", (1, 2, 3), 16, Sampling(0.7, 0.9, 42), (2,))),
    Cancel(A),
    OfferResult("w1", 4, A, False, "no_slot"),
    Token(A, 5, 1234),
    Finished(A, "eos", 6),
    Heartbeat("w1", 4, 99, 8, 7, 2048, (A,)),
]


def test_every_message_round_trips() -> None:
    for message in MESSAGES:
        assert decode_message(encode_message(message)) == message


def test_frames_split_anywhere_reassemble() -> None:
    stream = b"".join(encode_frame(m) for m in MESSAGES)
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == MESSAGES
        assert reader.finish() is None


def test_bad_frames_are_typed_errors() -> None:
    unknown = msgspec.msgpack.encode({"type": "Launch", "x": 1})
    wrong_type = msgspec.msgpack.encode({"type": "Token", "assignment": ["r", 1], "index": "0"})
    negative = msgspec.msgpack.encode(
        {"type": "Token", "assignment": ["r", 1], "index": -1, "token_id": 3}
    )
    attempt_zero = msgspec.msgpack.encode(
        {"type": "Token", "assignment": ["r", 0], "index": 0, "token_id": 3}
    )
    extra_field = msgspec.msgpack.encode({"type": "Cancel", "assignment": ["r", 1], "evil": 1})
    empty_prompt = encode_message(MESSAGES[0]).replace(b"\x93\x01\x02\x03", b"\x90")
    for payload in (unknown, wrong_type, negative, attempt_zero, extra_field, empty_prompt):
        result = decode_message(payload)
        assert isinstance(result, WireError), payload
        assert result.kind == "invalid"
    assert decode_message(encode_message(MESSAGES[0])[:-4]) == WireError(
        "truncated", "Input data was truncated"
    )
    assert isinstance(decode_message(b"\xc1"), WireError)


def test_oversized_frame_stops_the_reader() -> None:
    reader = FrameReader(max_frame_bytes=64)
    [error] = reader.feed((1000).to_bytes(4, "big") + b"x" * 10)
    assert isinstance(error, WireError) and error.kind == "oversized"
    assert reader.feed(encode_frame(Cancel(A))) == []


def test_partial_frame_at_end_of_stream_is_reported() -> None:
    reader = FrameReader()
    frame = encode_frame(Cancel(A))
    assert reader.feed(frame[:-1]) == []
    error = reader.finish()
    assert isinstance(error, WireError) and error.kind == "truncated"


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    result = decode_message(data)
    assert isinstance(result, WireError | AnyWireMessage)
    reader = FrameReader(max_frame_bytes=256)
    for item in reader.feed(data):
        assert isinstance(item, WireError | AnyWireMessage)


def test_logprob_records_round_trip_and_bad_ones_are_refused() -> None:
    record = TokenLogprob(-0.25, ((7, -0.25), (9, -1.5), (3, float("-inf"))))
    run = TokenRun(A, 2, (7, 8), (record, TokenLogprob(-3.0)))
    for message in (Token(A, 5, 7, record), run):
        assert decode_message(encode_message(message)) == message
    top = tuple((40_000 + i, -0.5 - i) for i in range(5))
    plain, with_record = Token(A, 5, 7), Token(A, 5, 7, TokenLogprob(-0.5, top))
    # array_like records: about 14 bytes per alternative (an id, a double), no field names
    assert len(encode_message(with_record)) - len(encode_message(plain)) < 90
    assert b"logprob" not in encode_message(plain)  # no record: the field is left out
    encoded = msgspec.msgpack.encode
    too_many = encoded({"type": "Token", "assignment": ["r", 1], "index": 0, "token_id": 3,
                        "logprob": [-1.0, [[1, -1.0]] * 21]})  # fmt: skip
    positive = encoded({"type": "Token", "assignment": ["r", 1], "index": 0, "token_id": 3,
                        "logprob": [0.5, []]})  # fmt: skip
    misaligned = encoded({"type": "TokenRun", "assignment": ["r", 1], "start_index": 0,
                          "token_ids": [1, 2], "logprobs": [[-1.0, []]]})  # fmt: skip
    for payload in (too_many, positive, misaligned):
        result = decode_message(payload)
        assert isinstance(result, WireError) and result.kind == "invalid", payload
