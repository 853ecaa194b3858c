"""An OpenAI request body in, a job (ChatJob, CompletionJob) or an OpenAIError out.

normalize_chat_request is /v1/chat/completions, normalize_completion_request
the legacy /v1/completions; both read the fields they share (stream, sampling,
stop, max tokens, the model) through the same functions. Pure: model lookup
and tokenization are injected, so this file decides what the server accepts
without knowing about models, HTTP or the controller. What it accepts is a
small, tested subset of the OpenAI API (docs/design/http.md has both tables):

- model; messages (system, developer, user, assistant; text content as a
  string or a list of text parts); max_completion_tokens (max_tokens is an
  alias; when both are given max_completion_tokens wins); stream and
  stream_options.include_usage; temperature [0, 2]; top_p (0, 1]; stop (a
  string or up to 4); seed; n (1 to 16 choices); logprobs and top_logprobs
  (chat: a boolean and 0 to 20; legacy completions: logprobs 0 to 20, not
  with echo); response_format (text, json_object, json_schema:
  adapters/openai/structured.py), on both endpoints.
- tools, tool_choice, parallel_tool_calls (tools.py reads them; a required
  call is held to the grammar of the model's call syntax, callsyntax.py);
  assistant messages with tool_calls and tool messages in the history.
- Known fields whose value asks for something we do not do (images,
  penalties, ...) are refused with 400 and `param` naming the field.
  Unknown fields are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from jinja2.exceptions import TemplateError
from msgspec.structs import replace

from adapters.openai.callsyntax import HERMES, CallSyntax
from adapters.openai.errors import OpenAIError, invalid
from adapters.openai.reasoning import AFTER, Thinking, ThinkingStart, after_thinking, start_state
from adapters.openai.structured import response_format
from adapters.openai.tools import Tool, ToolCall, ToolSetup, read_tool_calls, read_tools
from core.protocol import MAX_TOP_LOGPROBS, Constraint, GenerationRequest, Sampling
from core.seeds import GOLDEN, signed64, splitmix64

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOPS = 4
MAX_STOP_CHARS = 256
INT64 = 2**63
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's; core's in-memory default is greedy


class ModelInfo(msgspec.Struct, frozen=True):
    id: str
    max_context: int
    vocab_size: int
    constrains: bool = True  # its decoders can enforce a grammar (the fake model's cannot)
    call_syntax: CallSyntax = HERMES  # how it writes tool calls (its special markers bound)
    thinking: Thinking | None = None  # its thinking convention (reasoning.py), if it thinks
    reasoning_budget: int | None = None  # the server's thinking budget (--reasoning-budget)


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str  # "" for an assistant message that only calls tools
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's thinking (reasoning_content or reasoning)


class Prompt(msgspec.Struct, frozen=True):
    """One prompt of a legacy completion: its tokens, and its text when it came as text."""

    token_ids: tuple[int, ...]
    text: str | None  # None: given as token ids (echo decodes them)


class Shared(msgspec.Struct, frozen=True):
    """The fields chat and legacy completions read alike."""

    model: ModelInfo
    stream: bool
    include_usage: bool
    sampling: Sampling
    stop: tuple[str, ...]
    budget: int | None  # max tokens asked for; None: not given
    n: int  # choices per prompt
    logprobs: int | None = None  # alternatives per token; None: no log probabilities
    constraint: Constraint | None = None  # what response_format asks the output to be


class ChatJob(msgspec.Struct, frozen=True):
    """Everything the boundary needs to run one chat completion: a request per choice."""

    requests: tuple[GenerationRequest, ...]  # choice i is requests[i]
    shared: Shared  # model, stream, include_usage, sampling, stop, as asked
    tools: ToolSetup  # the answer is read for tool calls when tools.parses
    thinking: ThinkingStart | None = None  # a thinking model's: where its answers begin
    store: bool = False  # keep the completion (GET /v1/chat/completions/{id}, ...)
    metadata: dict[str, str] = {}  # what a stored completion is tagged with
    messages: tuple[Any, ...] = ()  # the request's messages as sent (what a stored one keeps)


class CompletionJob(msgspec.Struct, frozen=True):
    """Everything the boundary needs to run one legacy completion: a request per prompt."""

    requests: tuple[GenerationRequest, ...]  # choice i (prompt i // n) is requests[i]
    prompts: tuple[Prompt, ...]
    echo: bool
    shared: Shared  # model, stream, include_usage, sampling, stop, as asked


ResolveModel = Callable[[str], ModelInfo | None]
# (model id, messages, the tools to list in the prompt, chat_template_kwargs) -> token ids
TokenizeChat = Callable[
    [str, Sequence[ChatMessage], tuple[Tool, ...], dict[str, Any] | None], list[int]
]
Tokenize = Callable[[str, str], list[int]]  # (model id, text) -> token ids
MAX_PROMPTS = 16  # prompts in one legacy completion request
MAX_CHOICES = 16  # n: choices per prompt
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI default of /v1/completions


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


Refusal = tuple[str, Callable[[Any], bool], str]
_SHARED_UNSUPPORTED: tuple[Refusal, ...] = (
    ("logit_bias", lambda v: v != {}, "logit_bias is not supported"),
    ("presence_penalty", lambda v: not _is_number(v) or v != 0, "is not supported"),
    ("frequency_penalty", lambda v: not _is_number(v) or v != 0, "is not supported"),
)
# (field, predicate on a present, non-null value that means "unsupported", what to say)
_UNSUPPORTED: tuple[Refusal, ...] = (
    *_SHARED_UNSUPPORTED,
    ("functions", lambda v: v != [], "functions are not supported"),
    ("function_call", lambda v: v != "none", "function_call is not supported"),
    ("audio", lambda v: True, "audio output is not supported"),
    ("modalities", lambda v: v != ["text"], "only the text modality is supported"),
    ("prediction", lambda v: True, "predicted outputs are not supported"),
    ("web_search_options", lambda v: True, "web search is not supported"),
)
_COMPLETION_UNSUPPORTED: tuple[Refusal, ...] = (
    *_SHARED_UNSUPPORTED,
    ("best_of", lambda v: not _is_int(v) or v != 1, "only best_of=1 is supported"),
    ("suffix", lambda v: v != "", "suffix is not supported"),
)


def normalize_chat_request(
    body: object,
    resolve_model: ResolveModel,
    tokenize_chat: TokenizeChat,
    request_id: str,
) -> ChatJob | OpenAIError:
    def messages() -> list[ChatMessage] | OpenAIError:
        assert isinstance(body, dict)
        return _messages(body.get("messages"))

    job = chat_job(body, messages, resolve_model, tokenize_chat, request_id, _UNSUPPORTED)
    if isinstance(job, OpenAIError):
        return job
    assert isinstance(body, dict)
    storing = read_storing(body)
    if isinstance(storing, OpenAIError):
        return storing
    store, metadata = storing
    return replace(job, store=store is True, metadata=metadata, messages=tuple(body["messages"]))


def read_storing(body: dict[str, Any]) -> tuple[bool | None, dict[str, str]] | OpenAIError:
    """`store` (None when absent: each API has its own default) and `metadata`."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        return invalid("'store' must be a boolean", "store")
    metadata = read_metadata(body.get("metadata"))
    if isinstance(metadata, OpenAIError):
        return metadata
    return store, metadata


MAX_METADATA = 16  # keys, as OpenAI allows


def read_metadata(value: object) -> dict[str, str] | OpenAIError:
    """A request's `metadata`: at most 16 string keys (64 characters) to strings (512)."""
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()
        )
    ):
        return invalid(
            f"'metadata' must map at most {MAX_METADATA} keys (up to 64 characters) "
            "to strings (up to 512 characters)",
            "metadata",
        )
    return value


def chat_job(
    body: object,
    read_messages: Callable[[], list[ChatMessage] | OpenAIError],
    resolve_model: ResolveModel,
    tokenize_chat: TokenizeChat,
    request_id: str,
    refusals: tuple[Refusal, ...] = (),
) -> ChatJob | OpenAIError:
    """A chat job from a chat-shaped body whose history `read_messages` reads (after
    the other fields are checked): /v1/chat/completions' own, or the one the
    Responses API's request becomes (responses.py)."""
    shared = _shared(body, refusals, resolve_model)
    if isinstance(shared, OpenAIError):
        return shared
    assert isinstance(body, dict)
    logprobs = _chat_logprobs(body)
    if isinstance(logprobs, OpenAIError):
        return logprobs
    shared = replace(shared, logprobs=logprobs)
    tools = read_tools(body)
    if isinstance(tools, OpenAIError):
        return tools
    must_call = tools.mode in ("required", "function")
    if must_call and not shared.model.constrains:
        return invalid(
            f"'tool_choice': the model '{shared.model.id}' cannot constrain its output to a call",
            "tool_choice",
        )
    messages = read_messages()
    if isinstance(messages, OpenAIError):
        return messages
    model = shared.model
    thinking = _thinking_fields(body, model)
    if isinstance(thinking, OpenAIError):
        return thinking
    variables, thinking_budget = thinking
    try:
        prompt = tokenize_chat(model.id, messages, tools.prompted, variables)
    except TemplateError as error:  # the template refused these messages or variables
        return invalid(f"the chat template refused the request: {error}", "messages")
    budget = _budget(shared, len(prompt), None, "messages", "the messages take")
    if isinstance(budget, OpenAIError):
        return budget
    # A required call is all the answer can be, so its grammar replaces response_format's;
    # otherwise response_format's grammar (if any) holds, and the model answers in content.
    constraint = Constraint(model.call_syntax.grammar(tools)) if must_call else shared.constraint
    start = None
    if model.thinking is not None:
        # A thinking model's grammar holds after its thinking block, which the budget bounds.
        start = ThinkingStart(model.thinking, start_state(model.thinking, prompt))
        if start.state == AFTER and body.get("max_reasoning_tokens") is not None:
            return invalid(
                "'max_reasoning_tokens': thinking is off for this request", "max_reasoning_tokens"
            )
        grammar = after_thinking(
            start, thinking_budget, constraint.grammar if constraint is not None else None
        )
        constraint = Constraint(grammar) if grammar is not None else None
    requests = _choices(shared, request_id, tuple(prompt), budget, None, constraint)
    return ChatJob(requests, shared, tools, start)


EFFORTS = ("none", "minimal", "low", "medium", "high")
# apply_chat_template's own parameters: a template variable of one of these names would
# collide with them (a TypeError, or another kind of result).
TEMPLATE_PARAMETERS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
        "add_generation_prompt", "continue_final_message", "sanitize_control_tokens",
        "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def template_kwargs(value: object) -> dict[str, Any] | OpenAIError | None:
    """A request's chat_template_kwargs: an object of the template's own variables
    (any JSON values), none of them named as apply_chat_template's parameters."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for name in value:
        if name in TEMPLATE_PARAMETERS:
            where = f"chat_template_kwargs.{name}"
            return invalid(f"'{where}': '{name}' is not a template variable", where)
    return dict(value)


def _thinking_fields(
    body: dict[str, Any], model: ModelInfo
) -> tuple[dict[str, Any] | None, int | None] | OpenAIError:
    """chat_template_kwargs, reasoning_effort and max_reasoning_tokens: the template's
    variables (effort none/minimal: enable_thinking false) and the thinking budget."""
    kwargs = template_kwargs(body.get("chat_template_kwargs"))
    if isinstance(kwargs, OpenAIError):
        return kwargs
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            return invalid(
                f"'reasoning_effort' must be one of {', '.join(EFFORTS)}", "reasoning_effort"
            )
        if model.thinking is None:
            return invalid(
                f"'reasoning_effort': the model '{model.id}' does not think", "reasoning_effort"
            )
        kwargs = kwargs or {}
        if effort in ("none", "minimal"):
            if not model.thinking.switchable:
                return invalid(
                    f"'reasoning_effort': the template of '{model.id}' cannot turn thinking off",
                    "reasoning_effort",
                )
            kwargs.setdefault("enable_thinking", False)
        else:
            kwargs.setdefault("reasoning_effort", effort)  # for templates that read it
    budget = body.get("max_reasoning_tokens")
    if budget is not None:
        if not _is_int(budget) or budget < 1:
            return invalid(
                "'max_reasoning_tokens' must be a positive integer", "max_reasoning_tokens"
            )
        if model.thinking is None:
            return invalid(
                f"'max_reasoning_tokens': the model '{model.id}' does not think",
                "max_reasoning_tokens",
            )
    elif model.thinking is not None:
        budget = model.reasoning_budget
    return kwargs, budget


def normalize_completion_request(
    body: object,
    resolve_model: ResolveModel,
    tokenize: Tokenize,
    request_id: str,
) -> CompletionJob | OpenAIError:
    shared = _shared(body, _COMPLETION_UNSUPPORTED, resolve_model)
    if isinstance(shared, OpenAIError):
        return shared
    assert isinstance(body, dict)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        return invalid("'echo' must be a boolean", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            message = f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}"
            return invalid(message, "logprobs")
        if echo:  # it would need the log probability of every prompt token
            return invalid("'echo' together with 'logprobs' is not supported", "echo")
        shared = replace(shared, logprobs=int(logprobs))
    model = shared.model
    prompts = _prompts(body.get("prompt"), model, lambda text: tokenize(model.id, text))
    if isinstance(prompts, OpenAIError):
        return prompts
    requests: tuple[GenerationRequest, ...] = ()
    for i, prompt in enumerate(prompts):
        what = "the prompt takes" if len(prompts) == 1 else f"prompt {i} takes"
        budget = _budget(shared, len(prompt.token_ids), DEFAULT_COMPLETION_TOKENS, "prompt", what)
        if isinstance(budget, OpenAIError):
            return budget
        requests += _choices(
            shared, request_id, prompt.token_ids, budget, i * shared.n, shared.constraint
        )
    return CompletionJob(requests, tuple(prompts), bool(echo), shared)


def _shared(
    body: object, refusals: tuple[Refusal, ...], resolve_model: ResolveModel
) -> Shared | OpenAIError:
    """The fields both endpoints read; every check except the prompt's own."""
    if not isinstance(body, dict):
        return invalid("the request body must be a JSON object")
    model_name = body.get("model")
    if not isinstance(model_name, str) or not model_name:
        return invalid("'model' is required and must be a non-empty string", "model")
    for name, refused, why in refusals:
        value = body.get(name)
        if value is not None and refused(value):
            return invalid(f"'{name}': {why}", name)
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_CHOICES):
        return invalid(f"'n' must be an integer from 1 to {MAX_CHOICES}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return invalid("'stream' must be a boolean", "stream")
    include_usage = _include_usage(body.get("stream_options"), bool(stream))
    if isinstance(include_usage, OpenAIError):
        return include_usage
    sampling = _sampling(body)
    if isinstance(sampling, OpenAIError):
        return sampling
    stop = _stop(body.get("stop"))
    if isinstance(stop, OpenAIError):
        return stop
    budget = _max_tokens(body)
    if isinstance(budget, OpenAIError):
        return budget
    constraint = response_format(body.get("response_format"))
    if isinstance(constraint, OpenAIError):
        return constraint
    model = resolve_model(model_name)
    if model is None:
        return OpenAIError(
            404,
            f"the model '{model_name}' does not exist; GET /v1/models lists the served ones",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    if constraint is not None and not model.constrains:
        return invalid(
            f"'response_format': the model '{model.id}' cannot constrain its output",
            "response_format",
        )
    return Shared(
        model, bool(stream), include_usage, sampling, stop, budget, n or 1, constraint=constraint
    )


def _choices(
    shared: Shared,
    request_id: str,
    prompt: tuple[int, ...],
    budget: int,
    first: int | None,
    constraint: Constraint | None,
) -> tuple[GenerationRequest, ...]:
    """The n requests of one prompt, each with its own seed and its own id: the
    response's id and the choice index (choices first .. first + n - 1). first None:
    the one prompt of a chat completion, whose only choice keeps the response's id."""
    if first is None and shared.n == 1:
        ids = [request_id]
    else:
        ids = [f"{request_id}-{(first or 0) + i}" for i in range(shared.n)]
    requests = []
    for i, rid in enumerate(ids):
        sampling = shared.sampling
        if sampling.seed is not None:
            sampling = replace(sampling, seed=choice_seed(sampling.seed, i))
        requests.append(
            GenerationRequest(
                rid, prompt, budget, sampling, logprobs=shared.logprobs, constraint=constraint
            )
        )
    return tuple(requests)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a prompt whose request asked for `seed`.

    Choice 0 keeps the seed, so n=1 samples exactly as before; the others take
    splitmix64 of (seed, choice): deterministic, so a seeded request repeats, and
    far apart, so its choices differ. The result stays a signed 64-bit integer,
    as the protocol's seed is. A request without a seed gets none here: the
    controller draws one per submitted request, the one place seeds are drawn.
    """
    if choice == 0:
        return seed
    return signed64(splitmix64(seed + choice * GOLDEN))


def _budget(
    shared: Shared, prompt_tokens: int, default: int | None, param: str, what: str
) -> int | OpenAIError:
    """max_new_tokens for a prompt of this length: as asked, else the default (at most
    the rest of the context; no default: all of it)."""
    room = shared.model.max_context - prompt_tokens
    asked = shared.budget
    if room < 1 or (asked is not None and asked > room):
        plus = f" plus {asked} completion tokens" if asked is not None else ""
        return invalid(
            f"this model's maximum context length is {shared.model.max_context} tokens; "
            f"{what} {prompt_tokens}{plus}",
            param,
            "context_length_exceeded",
        )
    if asked is not None:
        return asked
    return room if default is None else min(default, room)


def _prompts(
    value: object, model: ModelInfo, tokenize: Callable[[str], list[int]]
) -> list[Prompt] | OpenAIError:
    """A string, a list of strings, a list of token ids, or a list of lists of them."""
    shape = (
        "'prompt' must be a string, an array of strings, an array of token ids, "
        "or an array of arrays of token ids"
    )
    if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])):
        items: list[object] = [value]
    elif isinstance(value, list) and value and len({isinstance(v, str) for v in value}) == 1:
        items = value  # all strings, or all (to be checked) arrays of token ids
    else:
        return invalid(shape, "prompt")
    if len(items) > MAX_PROMPTS:
        return invalid(f"'prompt': at most {MAX_PROMPTS} prompts in one request", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompt = Prompt(tuple(tokenize(item)), item)
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            if not all(0 <= t < model.vocab_size for t in item):
                return invalid(
                    f"'prompt': token ids must be from 0 to {model.vocab_size - 1}", "prompt"
                )
            prompt = Prompt(tuple(int(t) for t in item), None)
        else:
            return invalid(shape, "prompt")
        if not prompt.token_ids:
            return invalid("'prompt' must not be empty", "prompt")
        prompts.append(prompt)
    return prompts


def _messages(value: object) -> list[ChatMessage] | OpenAIError:
    if not isinstance(value, list) or not value:
        return invalid("'messages' must be a non-empty array", "messages")
    out: list[ChatMessage] = []
    for i, message in enumerate(value):
        chat = _message(message, f"messages[{i}]", out)
        if isinstance(chat, OpenAIError):
            return chat
        out.append(chat)
    return out


def _message(message: object, where: str, before: list[ChatMessage]) -> ChatMessage | OpenAIError:
    """One message of the history; `before` are those before it (a tool message must
    answer a call made in the assistant turn before it)."""
    if not isinstance(message, dict):
        return invalid(f"'{where}' must be an object", where)
    role = message.get("role")
    if not isinstance(role, str):
        return invalid(f"'{where}.role' must be a string", f"{where}.role")
    if role == "function":
        return invalid(f"'{where}.role': the role 'function' is not supported", f"{where}.role")
    if role not in ROLES:
        return invalid(f"'{where}.role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
    for refused in ("function_call", "audio"):
        if message.get(refused) is not None:
            return invalid(f"'{where}.{refused}' is not supported", f"{where}.{refused}")
    calls: tuple[ToolCall, ...] = ()
    if message.get("tool_calls") is not None:
        if role != "assistant":
            where_calls = f"{where}.tool_calls"
            return invalid(f"'{where_calls}': only assistant messages call tools", where_calls)
        read = read_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if isinstance(read, OpenAIError):
            return read
        calls = read
    reasoning = _reasoning(message, role, where)
    if isinstance(reasoning, OpenAIError):
        return reasoning
    raw = message.get("content")
    if raw is None and (calls or reasoning is not None):
        content: str | OpenAIError = ""  # an assistant turn that only calls tools (or thinks)
    else:
        content = text_content(raw, f"{where}.content")
    if isinstance(content, OpenAIError):
        return content
    if role != "tool":
        return ChatMessage(role, content, calls, reasoning=reasoning)
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        return invalid(
            f"'{where}.tool_call_id' must be a non-empty string", f"{where}.tool_call_id"
        )
    if call_id not in _open_calls(before):
        return invalid(
            f"'{where}.tool_call_id': no assistant message before it made the call '{call_id}'",
            f"{where}.tool_call_id",
        )
    return ChatMessage(role, content, (), call_id)


def _reasoning(message: dict[str, Any], role: str, where: str) -> str | OpenAIError | None:
    """An assistant message's thinking, under either name clients send it by
    (`reasoning_content`, or vLLM's `reasoning`); the template decides what to show."""
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if value is None:
            continue
        if role != "assistant":
            return invalid(f"'{where}.{name}': only assistant messages think", f"{where}.{name}")
        if not isinstance(value, str):
            return invalid(f"'{where}.{name}' must be a string", f"{where}.{name}")
        return value
    return None


def _open_calls(before: list[ChatMessage]) -> set[str]:
    """The call ids a tool message may answer: those of the last assistant message,
    when only tool messages follow it."""
    for message in reversed(before):
        if message.role == "assistant":
            return {call.id for call in message.tool_calls}
        if message.role != "tool":
            return set()
    return set()


def text_content(
    value: object, where: str, kinds: frozenset[str] = frozenset({"text"})
) -> str | OpenAIError:
    """A string, or a list of text parts (of these `type`s) joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return invalid(f"'{where}' must be a string or an array of text parts", where)
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            return invalid(f"'{where}[{i}]' must be an object", f"{where}[{i}]")
        kind = part.get("type")
        if kind not in kinds:
            what = f"'{kind}' parts are" if isinstance(kind, str) else "this part is"
            return invalid(f"'{where}[{i}]': {what} not supported; only text", f"{where}[{i}]")
        text = part.get("text")
        if not isinstance(text, str):
            return invalid(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
        texts.append(text)
    return "".join(texts)


def _chat_logprobs(body: dict[str, Any]) -> int | OpenAIError | None:
    """Chat's logprobs (a boolean) and top_logprobs (0..20, only with logprobs true)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        return invalid("'logprobs' must be a boolean", "logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            return invalid(
                f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs"
            )
        if not asked:
            return invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return (top or 0) if asked else None


def _include_usage(value: object, stream: bool) -> bool | OpenAIError:
    if value is None:
        return False
    if not stream:
        return invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(value, dict):
        return invalid("'stream_options' must be an object", "stream_options")
    include = value.get("include_usage")
    if include is not None and not isinstance(include, bool):
        return invalid("'stream_options.include_usage' must be a boolean", "stream_options")
    return bool(include)


def _sampling(body: dict[str, Any]) -> Sampling | OpenAIError:
    temperature = body.get("temperature")
    if temperature is None:
        temperature = OPENAI_DEFAULT_TEMPERATURE
    elif not _is_number(temperature) or not 0 <= temperature <= 2:
        return invalid("'temperature' must be a number from 0 to 2", "temperature")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    elif not _is_number(top_p) or not 0 < top_p <= 1:
        return invalid("'top_p' must be a number greater than 0 and at most 1", "top_p")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -INT64 <= seed < INT64):
        return invalid("'seed' must be a 64-bit integer", "seed")
    return Sampling(float(temperature), float(top_p), seed)


def _stop(value: object) -> tuple[str, ...] | OpenAIError:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        return invalid(
            f"'stop' must be a non-empty string or an array of up to {MAX_STOPS} of them "
            f"(each at most {MAX_STOP_CHARS} characters)",
            "stop",
        )
    return tuple(dict.fromkeys(stops))


def _max_tokens(body: dict[str, Any]) -> int | OpenAIError | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            return invalid(f"'{name}' must be a positive integer", name)
        return int(value)
    return None
