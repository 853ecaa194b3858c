"""What every client saw, and the contract it is held to: the stream oracles.

A ClientStream is one client's side of a request: the tokens it received, in
order, and its outcome. StreamOracles judges each delivery as the router makes
it: a token must take the next index and be one the fake model gives that
request (for some attempt it may come from: unseeded requests draw per
attempt, and a resume continues a prefix), with the logprob record the fake
model gives that token after the tokens the client already has (one record,
whichever attempt drew the token: a record is the model's, not the draw's); a
finish must match a reference output and count every token; an error must be
one the contract allows at that point. It only reads the
cluster, through StreamView (the few figures that bound what is allowed), and
keeps its own list of violations, which the cluster's invariants
(sim/invariants.py `check_safety`) raise.
`outcomes` and `error_causes` count what the clients were left with, for a
run's summary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from core.fake_model import FakeContext, reference_output
from core.protocol import (
    ClientFinishReason,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    GenerationRequest,
)

SALT_SEARCH = 256  # with shared workers: attempts past the last one seen, to look among


def diverges(request: GenerationRequest) -> bool:
    """Unseeded sampling: two attempts of this request draw different tokens."""
    return request.sampling.sampled and request.sampling.seed is None


@dataclass(slots=True)
class ClientStream:
    """Everything one client received, in order."""

    request: GenerationRequest
    references: dict[int, tuple[list[int], ClientFinishReason]]  # by salt: the outputs it may show
    tokens: list[int] = field(default_factory=list)
    outcome: DeliverFinished | DeliverError | None = None
    cancel_requested: bool = False
    # The fake model's context before the next token (prompt and what the client has),
    # to compute the one logprob record each delivered token must carry (requests that
    # ask for logprobs only). Any salt reads the same; salt 0 is as good as any.
    context: FakeContext | None = None
    cut: bool = False  # its router died before an outcome: the client saw the connection drop


class StreamView(Protocol):
    """What the stream oracles read of the cluster (they change nothing in it)."""

    @property
    def shared(self) -> bool: ...  # several routers share the workers

    @property
    def max_salt(self) -> int: ...  # the highest attempt number a request can reach

    @property
    def decoder_failures(self) -> int: ...  # injected so far

    @property
    def misbehaviours(self) -> int: ...  # decoder steps that went wrong on purpose


class StreamOracles:
    def __init__(self, cluster: StreamView) -> None:
        self.cluster = cluster
        self.violations: list[str] = []

    def open(self, request: GenerationRequest) -> ClientStream:
        """A client sends a request: its stream, with every output it may show."""
        salts = range(1, self.cluster.max_salt + 1) if diverges(request) else [0]
        references = {salt: reference_output(request, salt) for salt in salts}
        return ClientStream(request, references)

    def delivered(
        self, stream: ClientStream | None, effect: DeliverToken | DeliverFinished | DeliverError
    ) -> None:
        """The router handed the client this: judge it against what the client may see."""
        if stream is None:
            self.violations.append(f"delivery for unknown request {effect.request_id}")
            return
        rid = effect.request_id
        if stream.outcome is not None:
            self.violations.append(f"{rid}: delivery {effect!r} after terminal {stream.outcome!r}")
            return
        match effect:
            case DeliverToken(_, index, token_id):
                if index != len(stream.tokens):
                    self.violations.append(f"{rid}: index {index} after {len(stream.tokens)}")
                matching = {
                    salt: (ref, why)
                    for salt, (ref, why) in stream.references.items()
                    if index < len(ref) and ref[index] == token_id
                }
                if not matching and diverges(stream.request):
                    # Resumed on a newer attempt, which draws its own tokens from here (or,
                    # with shared workers, a first token from an attempt past max_salt:
                    # attempts declined for want of a slot add attempts without limit).
                    # Newer than the oldest attempt the stream may have come from so far:
                    # two salts can give one token (the vocabulary is finite), and only
                    # the oldest bounds the attempts that may follow it.
                    oldest = min(stream.references, default=0)
                    newest = max(stream.references, default=0)
                    prefix = tuple(stream.tokens)
                    last = max(
                        self.cluster.max_salt, newest + SALT_SEARCH if self.cluster.shared else 0
                    )
                    matching = {
                        salt: cont
                        for salt in range(oldest + 1, last + 1)
                        if (cont := reference_output(stream.request, salt, prefix))[0][index]
                        == token_id
                    }
                stream.references = matching
                if not stream.references:
                    self.violations.append(f"{rid}: token {token_id} at {index} is foreign")
                elif not self._record_matches(stream, effect):
                    self.violations.append(
                        f"{rid}: logprob record at {index} is wrong: {effect.logprob!r}"
                    )
                stream.tokens.append(token_id)
            case DeliverFinished(_, finish_reason, count):
                if (stream.tokens, finish_reason) not in stream.references.values():
                    self.violations.append(f"{rid}: finished early or wrong: {effect!r}")
                if count != len(stream.tokens):
                    self.violations.append(f"{rid}: usage {count} != {len(stream.tokens)}")
                stream.outcome = effect
            case DeliverError(_, kind, _):
                if not self._error_allowed(stream, kind):
                    self.violations.append(f"{rid}: error {kind} after {len(stream.tokens)} tokens")
                stream.outcome = effect

    def _record_matches(self, stream: ClientStream, token: DeliverToken) -> bool:
        """Does the token carry the record the fake model gives it after the tokens the
        client has (across resumes too), or none if none was asked?"""
        top = stream.request.logprobs
        if top is None:
            return token.logprob is None
        context = stream.context
        if context is None or context.index != token.index:
            context = stream.context = FakeContext(stream.request, 0, tuple(stream.tokens))
        expected = context.record(token.token_id, top)
        context.feed(token.token_id)
        return expected == token.logprob

    def _error_allowed(self, stream: ClientStream, kind: str) -> bool:
        """The contract: which error outcomes a client may see, and when."""
        started = bool(stream.tokens)
        match kind:
            case "cancelled":
                return stream.cancel_requested
            case "no_worker" | "overloaded":
                return not started  # refused or given up before any output
            case "worker_lost":
                return started  # before the first token the router must fail over
            case "failed":  # a broken decoder, or one that skipped an index
                return started and (
                    self.cluster.decoder_failures > 0 or self.cluster.misbehaviours > 0
                )
        return False


def outcomes(streams: Iterable[ClientStream]) -> Counter[str]:
    """How the clients' requests ended: by finish reason or error kind, or "cut" (its
    router died first)."""
    counts: Counter[str] = Counter()
    for stream in streams:
        match stream.outcome:
            case DeliverFinished(reason=reason) | DeliverError(kind=reason):
                counts[reason] += 1
            case None if stream.cut:
                counts["cut"] += 1
    return counts


def error_causes(streams: Iterable[ClientStream]) -> Counter[str]:
    """Error outcomes by kind and cause (the message without its particulars)."""
    counts: Counter[str] = Counter()
    for stream in streams:
        if isinstance(stream.outcome, DeliverError):
            started = "after tokens" if stream.tokens else "before tokens"
            counts[f"{stream.outcome.kind} {started}: {_cause(stream.outcome.message)}"] += 1
    return counts


def _cause(message: str) -> str:
    """An error message with its particulars (ids, counts) taken out, to count by."""
    return " ".join(w for w in message.split() if not any(c.isdigit() for c in w))
