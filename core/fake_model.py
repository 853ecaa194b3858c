"""The deterministic fake model: a stand-in for a language model, with no weights.

The simulator decodes with it, and so do `fencepost serve --fake`, `fencepost
worker --fake` and the runtime and HTTP tests; one definition, so the
simulator's references and the fake servers' outputs can never disagree.

It is autoregressive, like a real model: token k is a pure function of the
prompt, the sampling seed, a salt, k, and every output token before k
(FakeContext). So every attempt of a greedy or seeded request, on any worker,
produces the same output, and a continuation (a request with an
output_prefix) takes the prefix as context and goes on exactly where an
undisturbed run would. The salt lets a caller model unseeded sampling, where
two attempts draw different tokens (the simulator salts by attempt).

Token EOS_TOKEN (0) ends a sequence; it comes up about once in EOS_ONE_IN
tokens. Other tokens are 1..VOCAB-1.

For a request that asks for logprobs, each token comes with a fake record
(FakeContext.record). As a real model's log probabilities are, it is a pure
function of what the model reads, the prompt and the output before k, and of
the token it scores; never of the seed or the salt, which only draw. So two
attempts of an unseeded request that reach the same position with the same
tokens give the same record, whichever attempt drew it. The numbers are made
up (they are not a distribution): the top entries descend strictly and have
distinct ids, which is all a client of the fake can rely on.
"""

from __future__ import annotations

from core.decoding import Generation, stop_reason
from core.protocol import (
    Assignment,
    ClientFinishReason,
    DecoderEvent,
    GenerationRequest,
    TokenLogprob,
)
from core.seeds import GOLDEN, MASK64

VOCAB = 50_000
FAKE_CONTEXT = 2048  # the context a fake decoder serves unless told otherwise
EOS_TOKEN = 0
EOS_ONE_IN = 89


class FakeContext:
    """The fake model's state, two hashes fed the same tokens: `state` (prompt, seed and
    salt, then each output token) draws the next token; `reads` (prompt and output
    only) is what the model reads, and fixes the logprob records."""

    __slots__ = ("index", "reads", "state")

    def __init__(
        self, request: GenerationRequest, salt: int = 0, prefix: tuple[int, ...] | None = None
    ) -> None:
        mix = GOLDEN ^ (request.sampling.seed or 0) & MASK64
        mix = ((mix ^ salt) * 0x100000001B3) & MASK64
        reads = GOLDEN
        for token in request.prompt_token_ids:
            mix = ((mix ^ token) * 0x100000001B3) & MASK64
            reads = ((reads ^ token) * 0x100000001B3) & MASK64
        self.state = mix
        self.reads = reads
        self.index = 0
        for token in request.output_prefix if prefix is None else prefix:
            self.feed(token)

    def next_token(self) -> int:
        """The token at `index`, given everything fed so far (does not feed it)."""
        mix = ((self.state ^ self.index) * 0xFF51AFD7ED558CCD) & MASK64
        mix ^= mix >> 29
        return EOS_TOKEN if mix % EOS_ONE_IN == 0 else 1 + mix % (VOCAB - 1)

    def record(self, token: int, top: int) -> TokenLogprob:
        """The fake logprob record of `token` at `index`, with `top` alternatives: of the
        context alone, so every draw that reaches it agrees."""
        mix = ((self.reads ^ self.index ^ (token << 32)) * 0xC2B2AE3D27D4EB4F) & MASK64
        mix ^= mix >> 31
        base = (mix & 0xFFFF) / 65536.0  # in [0, 1)
        alternatives = tuple(
            (1 + (mix + 7919 * i) % (VOCAB - 1), -(base + 0.5 * i)) for i in range(top)
        )
        return TokenLogprob(-(base + (mix >> 16) % 8 / 4.0), alternatives)

    def feed(self, token: int) -> None:
        self.state = ((self.state ^ (token + 1)) * 0x100000001B3) & MASK64
        self.reads = ((self.reads ^ (token + 1)) * 0x100000001B3) & MASK64
        self.index += 1


def fake_stop_ids(request: GenerationRequest, ignore_eos: bool = False) -> frozenset[int]:
    """What ends a fake output: EOS and the request's own stop ids (none with ignore_eos)."""
    return frozenset() if ignore_eos else frozenset((EOS_TOKEN, *request.stop_token_ids))


class FakeDecode:
    """One assignment decoding on the fake model, one token per step."""

    __slots__ = ("context", "generation", "started", "top")

    def __init__(
        self,
        assignment: Assignment,
        request: GenerationRequest,
        salt: int = 0,
        ignore_eos: bool = False,
    ) -> None:
        self.context = FakeContext(request, salt)
        self.generation = Generation(assignment, request, fake_stop_ids(request, ignore_eos))
        self.started = False
        self.top = request.logprobs  # None: the request asks for no records

    @property
    def next_index(self) -> int:
        return self.generation.next_index

    def step(self, events: list[DecoderEvent]) -> bool:
        """Append the next step's events (the next token, or the end of a continuation
        that had already ended); True when the assignment is over."""
        if not self.started:
            self.started = True
            done = self.generation.ended_at_start()
            if done is not None:
                events.append(done)
                return True
        context = self.context
        token = context.next_token()
        record = None if self.top is None else context.record(token, self.top)
        context.feed(token)
        return self.generation.emit(token, events, record)


def reference_output(
    request: GenerationRequest, salt: int = 0, prefix: tuple[int, ...] = ()
) -> tuple[list[int], ClientFinishReason]:
    """What an undisturbed run returns, the tokens and the finish reason; with a prefix,
    what a continuation from those tokens returns (prefix included).

    Computed straight from FakeContext and the stop rule, not through FakeDecode,
    so that an oracle built on it does not share the decoders' bookkeeping."""
    context = FakeContext(request, salt, prefix)
    tokens, stops = list(prefix), fake_stop_ids(request)
    while (reason := stop_reason(tokens, request.max_new_tokens, stops)) is None:
        token = context.next_token()
        context.feed(token)
        tokens.append(token)
    return tokens, reason


def reference_tokens(request: GenerationRequest, count: int, salt: int = 0) -> list[int]:
    """The first `count` tokens the fake model produces, stop tokens or not."""
    context = FakeContext(request, salt)
    tokens = []
    for _ in range(count):
        tokens.append(context.next_token())
        context.feed(tokens[-1])
    return tokens
