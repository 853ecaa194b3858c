"""The router-worker wire format: length-prefixed msgpack frames, decoded sans-IO.

A frame is a 4-byte big-endian payload length followed by one msgpack-encoded
wire message (see core.protocol). Decoding never raises on bad input: a
malformed, truncated, oversized or unknown frame becomes a WireError value that
the transport logs before closing the connection. Because a corrupt length
prefix leaves no way to find the next frame boundary, a FrameReader stops for
good at its first error.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from core.protocol import AnyWireMessage

HEADER_BYTES = 4
DEFAULT_MAX_FRAME_BYTES = 1 << 20
"""A frame may carry one prompt; 1 MiB holds ~100k token ids with room to spare."""

WireErrorKind = Literal["oversized", "malformed", "invalid", "truncated"]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyWireMessage)


class WireError(Struct, frozen=True):
    """A frame that could not be turned into a message, and why."""

    kind: WireErrorKind
    detail: str


def encode_message(message: AnyWireMessage) -> bytes:
    return _encoder.encode(message)


def encode_frame(message: AnyWireMessage) -> bytes:
    payload = _encoder.encode(message)
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


def decode_message(payload: bytes) -> AnyWireMessage | WireError:
    """Decode one complete payload; bad input yields a WireError, never an exception."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as error:
        return WireError("invalid", str(error))
    except msgspec.DecodeError as error:
        kind: WireErrorKind = "truncated" if "truncated" in str(error) else "malformed"
        return WireError(kind, str(error))


class FrameReader:
    """Accumulates bytes from a stream and yields whole decoded frames.

    feed() returns the messages completed by the new bytes; after the first
    WireError it returns nothing more (the caller should close the connection).
    finish() reports a frame cut off by the end of the stream.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max_frame_bytes = max_frame_bytes
        self.failed: WireError | None = None

    def limit(self, max_frame_bytes: int) -> None:
        """Change the frame cap (a link takes small frames until it has registered)."""
        self._max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes | bytearray) -> list[AnyWireMessage | WireError]:
        if self.failed is not None:
            return []
        self._buffer += data
        out: list[AnyWireMessage | WireError] = []
        offset = 0
        while len(self._buffer) - offset >= HEADER_BYTES:
            length = int.from_bytes(self._buffer[offset : offset + HEADER_BYTES], "big")
            if length > self._max_frame_bytes:
                return self._fail(out, WireError("oversized", f"frame of {length} bytes"))
            end = offset + HEADER_BYTES + length
            if len(self._buffer) < end:
                break
            decoded = decode_message(bytes(self._buffer[offset + HEADER_BYTES : end]))
            offset = end
            if isinstance(decoded, WireError):
                return self._fail(out, decoded)
            out.append(decoded)
        del self._buffer[:offset]
        return out

    def finish(self) -> WireError | None:
        """Call at end of stream: a partial frame left in the buffer is an error."""
        if self.failed is None and self._buffer:
            self.failed = WireError("truncated", f"{len(self._buffer)} bytes of a partial frame")
        return self.failed

    def _fail(
        self, out: list[AnyWireMessage | WireError], error: WireError
    ) -> list[AnyWireMessage | WireError]:
        self.failed = error
        self._buffer.clear()
        out.append(error)
        return out
