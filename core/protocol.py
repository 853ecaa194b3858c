"""The vocabulary of fencepost: requests, wire messages, machine events and effects.

Everything here is a small frozen msgspec struct. The same classes serve three
purposes: in-memory events fed to the machines, effects the machines return, and
(for the wire messages) msgpack frames exchanged with remote workers, where the
field constraints below validate untrusted input at decode time.

An assignment names one attempt at serving one request: (request_id, attempt).
Attempts only grow. Every message about generated output names its assignment
and a zero-based token index, so a receiver can accept exactly the next index of
the assignment it considers active and drop everything else (the fence).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, structs

RequestId = Annotated[str, Meta(min_length=1, max_length=256)]
WorkerId = Annotated[str, Meta(min_length=1, max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**40)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Positive = Annotated[int, Meta(ge=1, le=2**40)]

FinishReason = Literal["eos", "length", "cancelled", "failed"]
"""Why a worker stopped an assignment. Only eos and length complete a request."""

ClientFinishReason = Literal["eos", "length"]

ErrorKind = Literal["no_worker", "overloaded", "worker_lost", "failed", "cancelled"]
"""Terminal error outcomes a client can see; the HTTP layer maps each to a status."""

DeclineReason = Literal[
    "wrong_worker", "stale_epoch", "stale_attempt", "no_slot", "context_length", "cancelled",
    "wrong_router",
]  # fmt: skip


RouterId = Annotated[str, Meta(max_length=64)]


class Assignment(Struct, frozen=True, array_like=True):
    """One attempt at one request. Attempt numbers start at 1 and only grow.

    `router` names the router (one incarnation of it) that made the attempt.
    Several routers may share a worker and number their requests independently,
    so a worker tells their assignments apart, and fences each router's
    messages to that router's own assignments, by this field. A lone router
    may leave it empty (one byte on the wire).
    """

    request_id: RequestId
    attempt: Positive
    router: RouterId = ""


# A request built in memory (tests, benches, the simulator) is greedy unless it says
# otherwise; the HTTP boundary applies OpenAI's own default (1.0) before it builds one.
DEFAULT_TEMPERATURE = 0.0


def is_sampled(temperature: float) -> bool:
    """Whether a token is drawn at random: any temperature above 0 (0 is the argmax)."""
    return temperature > 0


class Sampling(Struct, frozen=True):
    """Per-request sampling. temperature 0 means greedy; seed makes sampling reproducible."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = DEFAULT_TEMPERATURE
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None

    @property
    def sampled(self) -> bool:
        """Drawn at random (then a seed makes it repeat), not greedy."""
        return is_sampled(self.temperature)


MAX_TOP_LOGPROBS = 20
MAX_GRAMMAR_BYTES = 256 * 1024  # a grammar travels in the Offer frame (1 MiB at most)


class Constraint(Struct, frozen=True):
    """The output must be a sentence of this grammar (constrained decoding).

    Opaque to core: the text is an llguidance grammar (JSON naming a JSON schema
    or a Lark grammar) that adapters/engine compiles. What the grammar allows at
    any point is a function of the output tokens before it, so a continuation
    rebuilds the state from its output_prefix and goes on exactly as the
    undisturbed run would.
    """

    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_BYTES)]


Logprob = Annotated[float, Meta(le=0.0)]  # a natural log probability; -inf is allowed


class TokenLogprob(Struct, frozen=True, array_like=True):
    """A token's log probability, and the `top` most likely tokens at its step.

    It travels with its token (Token, TokenRun, Decoded, DeliverToken), so it is
    fenced with it: accepted or dropped together. `top` holds (token id, log
    probability) pairs, most likely first, as many as the request's logprobs
    asks (fewer only if the vocabulary has fewer). What distribution the
    numbers come from is the decoder's business (docs/design/engine.md).
    """

    logprob: Logprob
    top: Annotated[tuple[tuple[TokenId, Logprob], ...], Meta(max_length=MAX_TOP_LOGPROBS)] = ()


class GenerationRequest(Struct, frozen=True):
    """What the router schedules: token ids in, token ids out. No JSON, no text.

    output_prefix makes it a continuation: the first k output tokens (indices
    0..k-1) are already with the client; the worker takes them as context and
    generates from index k, within the same max_new_tokens budget and with the
    same sampling, so an undisturbed run and a resumed one agree token for token.

    logprobs None asks for no log probabilities; k asks, with every token, for
    its log probability and those of the k most likely tokens at that step.
    constraint, when set, limits every token to what its grammar allows.
    """

    request_id: RequestId
    prompt_token_ids: tuple[TokenId, ...]
    max_new_tokens: Positive
    sampling: Sampling = Sampling()
    stop_token_ids: tuple[TokenId, ...] = ()
    output_prefix: tuple[TokenId, ...] = ()
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        # Checked here (not only by Meta) so that requests built in memory are
        # held to the same rules as requests decoded from the wire.
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if len(self.output_prefix) > self.max_new_tokens:
            raise ValueError("output_prefix is longer than max_new_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")

    @property
    def context_tokens(self) -> int:
        """Context positions the request may occupy: prompt plus every new token."""
        return len(self.prompt_token_ids) + self.max_new_tokens

    def renamed(self, request_id: str) -> GenerationRequest:
        """The same request under another id (sent again to another router)."""
        return structs.replace(self, request_id=request_id)


# --- wire messages (router <-> worker), tagged so one decoder reads them all ---


class WireMessage(Struct, frozen=True, tag_field="type", tag=True, forbid_unknown_fields=True):
    """Base of every frame on the router-worker link."""


class Offer(WireMessage, frozen=True):
    """Router -> worker: please run this assignment (addressed to one worker epoch)."""

    worker_id: WorkerId
    epoch: Count
    assignment: Assignment
    request: GenerationRequest


class Cancel(WireMessage, frozen=True):
    """Router -> worker: stop this assignment and free its slot (idempotent)."""

    assignment: Assignment


class Resend(WireMessage, frozen=True):
    """Router -> worker: send the assignment's tokens again from `from_index` on.

    The router drops every token that is not the next one it expects, so a
    token lost or overtaken on the wire leaves a gap; this asks for the rest
    again (and for the Finished, if the assignment has already ended).
    """

    assignment: Assignment
    from_index: Count


class OfferResult(WireMessage, frozen=True):
    """Worker -> router: the answer to an offer. A duplicate offer gets the same answer."""

    worker_id: WorkerId
    epoch: Count
    assignment: Assignment
    accepted: bool
    reason: DeclineReason | None = None
    # The worker's last heartbeat sequence number when it answered: a heartbeat up to
    # that number was sent before the assignment was taken, so its silence about it
    # says nothing.
    seq: Count = 0


class Token(WireMessage, frozen=True, omit_defaults=True):
    """Worker -> router: the token at `index` of the request's output.

    (omit_defaults: a token without a record costs no byte more than before.)"""

    assignment: Assignment
    index: Count
    token_id: TokenId
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    # On an attempt's first token only: as OfferResult.seq, the worker's last heartbeat
    # sequence number when it took the assignment. The token may be the router's first
    # news of the acceptance (its OfferResult late or lost), and a heartbeat up to that
    # number, overtaken on the way, says nothing by leaving the assignment out.
    taken_after: Count | None = None


class TokenRun(WireMessage, frozen=True, omit_defaults=True):
    """Worker -> router: consecutive tokens from `start_index`, the answer to a Resend.

    One message, so the run arrives whole even on a link that reorders.
    logprobs is empty, or holds one record per token (the request asks).
    """

    assignment: Assignment
    start_index: Count
    token_ids: tuple[TokenId, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    taken_after: Count | None = None  # as Token's: on a run from the attempt's first token

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError("a TokenRun has one logprob record per token, or none")


class Finished(WireMessage, frozen=True):
    """Worker -> router: the assignment ended after `completion_tokens` tokens."""

    assignment: Assignment
    reason: FinishReason
    completion_tokens: Count


CacheKey = Annotated[int, Meta(ge=0, le=2**63 - 1)]
MAX_CACHE_KEYS = 512


class CacheReport(Struct, frozen=True, array_like=True):
    """What a worker's prefix cache holds, carried in its heartbeats (core/blocks.py).

    keys are chain keys of full blocks (block_hash), most useful first; a
    router that finds a request's leading chain keys here may expect that many
    tokens to be reused. It is a hint: possibly stale, never trusted for
    correctness. prefill_rate is the worker's measured prefill speed in tokens
    per second (0: not measured yet); prompt_tokens and computed_tokens count,
    over the worker process's life, context tokens submitted for prefill and
    those actually computed (the rest came from the cache). total_blocks,
    free_blocks and cached_blocks say how the KV pool stands (cached: kept for
    reuse, held by no sequence; the rest of the pool is held by running ones), for
    dashboards; 0 and 0 from a worker that does not say. spec_rows,
    spec_proposed and spec_accepted count speculative decoding over the
    process's life: sequence-steps that verified guesses, the tokens guessed,
    and of those the ones equal to the model's own draw. They come last, so a
    router decodes an older worker's shorter report (upgrade routers first).
    """

    block_size: Positive
    keys: Annotated[tuple[CacheKey, ...], Meta(max_length=MAX_CACHE_KEYS)] = ()
    prefill_rate: Annotated[float, Meta(ge=0.0, le=1e12)] = 0.0
    prompt_tokens: Count = 0
    computed_tokens: Count = 0
    total_blocks: Count = 0
    free_blocks: Count = 0
    cached_blocks: Count = 0
    spec_rows: Count = 0
    spec_proposed: Count = 0
    spec_accepted: Count = 0


class Heartbeat(WireMessage, frozen=True):
    """Worker -> router: liveness, capacity, the assignments the worker holds, and
    (when its decoder has a prefix cache) what that cache holds."""

    worker_id: WorkerId
    epoch: Count
    seq: Count
    slots: Count
    free_slots: Count
    max_context: Count
    active: tuple[Assignment, ...] = ()
    cache: CacheReport | None = None


class HandOff(WireMessage, frozen=True):
    """Worker -> router: the worker is draining and gives these of the router's
    assignments up. The router continues each on another worker from its delivered
    index and cancels it here only once the continuation is accepted; until then the
    worker keeps decoding it, so that a continuation that fails falls back to it
    (core/requests.py, "Handoff"). Fenced like a heartbeat: the epoch must be the one
    the router knows the worker by. A draining worker sends it again with each
    heartbeat for what it still holds, so a stream no other worker could take at
    first is handed off once one can."""

    worker_id: WorkerId
    epoch: Count
    assignments: tuple[Assignment, ...]


class Register(WireMessage, frozen=True):
    """Worker -> router, the first frame of a connection: the id it serves under.
    The router answers Registered (with the epoch it hands out) or Refused."""

    worker_id: WorkerId
    takeover: bool = False  # replace a live worker of this id instead of being refused


class Registered(WireMessage, frozen=True):
    """Router -> worker: serve under this epoch (the router's, never a host clock's).
    router_id is the router's identity: its assignments carry it, and a worker
    linked to several routers keys each link by it."""

    worker_id: WorkerId
    epoch: Count
    router_id: RouterId = ""


class Refused(WireMessage, frozen=True):
    """Router -> worker: this id is taken by a live worker; the connection ends.
    router_id names the refusing router, so a worker reaching a router it is linked
    to already (through a second address) can tell that from a taken id."""

    worker_id: WorkerId
    reason: str
    router_id: RouterId = ""


ToWorker = Offer | Cancel | Resend
FromWorker = OfferResult | Token | TokenRun | Finished | Heartbeat | HandOff
AnyWireMessage = (
    Offer | Cancel | Resend | OfferResult | Token | TokenRun | Finished | Heartbeat
    | HandOff | Register | Registered | Refused
)  # fmt: skip


# --- timers: a key names a timer; arming a key again replaces its deadline ---


class OfferTimer(Struct, frozen=True):
    assignment: Assignment


class LivenessTimer(Struct, frozen=True):
    worker_id: str


class ProgressTimer(Struct, frozen=True):
    """An accepted attempt's progress deadline: its first token, then each next one."""

    assignment: Assignment


class HeartbeatTimer(Struct, frozen=True):
    pass


TimerKey = OfferTimer | LivenessTimer | ProgressTimer | HeartbeatTimer


class TimerFired(Struct, frozen=True):
    key: TimerKey


class ArmTimer(Struct, frozen=True):
    key: TimerKey
    deadline: float


class DisarmTimer(Struct, frozen=True):
    key: TimerKey


# --- router events and effects ---


class Submit(Struct, frozen=True):
    """A client asks for a generation."""

    request: GenerationRequest


class ClientCancel(Struct, frozen=True):
    """The client went away or its stop condition matched; deliver nothing more."""

    request_id: str


class FromWorkerMessage(Struct, frozen=True):
    """A frame that arrived from the connection of `worker_id`."""

    worker_id: str
    message: FromWorker


class WorkerGone(Struct, frozen=True):
    """The transport lost the connection of `worker_id` at `epoch` (closed, broken, or
    dropped because it could not keep up). Faster than waiting for heartbeats to stop;
    anything that epoch says afterwards is stale."""

    worker_id: str
    epoch: int
    reason: str


class RegisterWorker(Struct, frozen=True):
    """A worker connection opened with Register: may it serve, and under which epoch?"""

    worker_id: str
    takeover: bool = False


RouterEvent = Submit | ClientCancel | FromWorkerMessage | WorkerGone | TimerFired | RegisterWorker


class SendToWorker(Struct, frozen=True):
    worker_id: str
    message: ToWorker


class DeliverToken(Struct, frozen=True):
    """The next token of a client's stream, index = number delivered before it."""

    request_id: str
    index: int
    token_id: int
    logprob: TokenLogprob | None = None


class DeliverFinished(Struct, frozen=True):
    """Terminal: the generation completed."""

    request_id: str
    reason: ClientFinishReason
    completion_tokens: int


class DeliverError(Struct, frozen=True):
    """Terminal: the generation ended without completing."""

    request_id: str
    kind: ErrorKind
    message: str


Delivery = DeliverToken | DeliverFinished | DeliverError


class Registration(Struct, frozen=True):
    """The answer to RegisterWorker: an epoch to serve under, or None and why not."""

    worker_id: str
    epoch: int | None
    reason: str = ""


RouterEffect = (
    SendToWorker | ArmTimer | DisarmTimer | DeliverToken | DeliverFinished | DeliverError
    | Registration
)  # fmt: skip


# --- worker events and effects ---


class WorkerStart(Struct, frozen=True):
    """The worker process is up: announce it and start heartbeating."""


class FromRouterMessage(Struct, frozen=True):
    """A frame that arrived on the link to router `router_id`."""

    message: ToWorker
    router_id: str = ""


class RouterLinked(Struct, frozen=True):
    """A connection to router `router_id` registered: serve it under `epoch`.
    A link that router already had is over (its assignments end first)."""

    router_id: str
    epoch: int


class RouterUnlinked(Struct, frozen=True):
    """The connection to router `router_id` is gone (closed, broken, or the router
    died): what that router's assignments were for, nobody will receive."""

    router_id: str
    reason: str = ""


class Decoded(Struct, frozen=True):
    """The decoder produced the token at `index` for an assignment (with its
    log probabilities when the request asks for them)."""

    assignment: Assignment
    index: int
    token_id: int
    logprob: TokenLogprob | None = None


class DecodeDone(Struct, frozen=True):
    """The decoder stopped an assignment on its own (eos, length, or an error)."""

    assignment: Assignment
    reason: Literal["eos", "length", "failed"]


class DecoderFailed(Struct, frozen=True):
    """The whole decoder broke: every active assignment ends as failed."""

    message: str = ""


class Drain(Struct, frozen=True):
    """The worker is shutting down: decline new offers; with `handoff`, give the
    active assignments back to their routers (HandOff) to be continued elsewhere,
    otherwise let them finish here."""

    handoff: bool = True


DecoderEvent = Decoded | DecodeDone | DecoderFailed
"""What a decoder reports to its worker."""

WorkerEvent = (
    WorkerStart | FromRouterMessage | Decoded | DecodeDone | DecoderFailed | Drain | TimerFired
    | RouterLinked | RouterUnlinked
)  # fmt: skip


class SendToRouter(Struct, frozen=True):
    """A frame for the link to router `router_id`."""

    message: FromWorker
    router_id: str = ""


class StartDecode(Struct, frozen=True):
    assignment: Assignment
    request: GenerationRequest


class StopDecode(Struct, frozen=True):
    assignment: Assignment


WorkerEffect = SendToRouter | StartDecode | StopDecode | ArmTimer | DisarmTimer
