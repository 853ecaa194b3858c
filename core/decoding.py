"""What every decoder does with the tokens it produces: one stop rule, one record of output.

Three decoders run assignments: the torch engine (adapters/engine), the fake
decoder of `--fake` serving and fake workers (adapters/runtime), and the
simulator's fake decoder (sim/). They differ in how a token is chosen, never
in what happens to it: it takes the next index, goes to the worker machine
as Decoded, and the output ends after it if it is a stop token (eos) or fills
the request's budget (length). A continuation (a request with an
output_prefix) starts at index k = len(prefix); if its prefix had already
ended by that same rule (only the Finished was lost), it ends at once with
no new token. `Generation` is that shared part, so the three cannot drift.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from core.protocol import (
    Assignment,
    ClientFinishReason,
    Decoded,
    DecodeDone,
    DecoderEvent,
    GenerationRequest,
    TokenLogprob,
)


def stop_reason(
    output: Sequence[int], max_new_tokens: int, stop_ids: Container[int]
) -> ClientFinishReason | None:
    """Why an output ends after its last token: a stop token (eos) or the budget (length)."""
    if not output:
        return None
    if output[-1] in stop_ids:
        return "eos"
    return "length" if len(output) >= max_new_tokens else None


class Generation:
    """One assignment's output as its decoder produces it, prefix first.

    `output` holds every token of the request's output so far (a
    continuation's prefix, then what this decoder added); its length is the
    index the next token takes.
    """

    __slots__ = ("assignment", "max_new_tokens", "output", "stop_ids")

    def __init__(
        self, assignment: Assignment, request: GenerationRequest, stop_ids: Container[int]
    ) -> None:
        self.assignment = assignment
        self.max_new_tokens = request.max_new_tokens
        self.stop_ids = stop_ids
        self.output = list(request.output_prefix)

    @property
    def next_index(self) -> int:
        return len(self.output)

    def ended_at_start(self) -> DecodeDone | None:
        """For a continuation whose prefix had already ended: how, with nothing to add."""
        reason = stop_reason(self.output, self.max_new_tokens, self.stop_ids)
        return None if reason is None else DecodeDone(self.assignment, reason)

    def emit(
        self, token: int, events: list[DecoderEvent], logprob: TokenLogprob | None = None
    ) -> bool:
        """Record the next token and append its events; True if the output ended with it.
        `logprob` is the token's record when the request asks for one."""
        events.append(Decoded(self.assignment, len(self.output), token, logprob))
        self.output.append(token)
        reason = stop_reason(self.output, self.max_new_tokens, self.stop_ids)
        if reason is None:
            return False
        events.append(DecodeDone(self.assignment, reason))
        return True
