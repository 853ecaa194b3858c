"""`fencepost serve`: the OpenAI-compatible server, its controller and its workers.

By default one process holds everything: hypercorn serving the Quart-trio
app, the controller, and one in-process worker running the torch engine on
the embedded default model. `--worker-listen HOST:PORT` also accepts remote
`fencepost worker` processes (which must serve the same model);
`--no-local-worker` leaves the serving to them. `--fake` swaps the model for
FakeChatModel and FakeDecoder: no weights, instant tokens (tests, load runs).

Each start draws a router id (8 random hex digits, after the --router-id prefix
when one is given), logged at start: every assignment names it, and workers
shared by several routers tell their links apart by it. A restarted router is
a new id, so nothing of its previous life is mistaken for its own.

SIGTERM or SIGINT: stop accepting connections, refuse new requests with 503,
let open requests finish for up to --drain-timeout seconds, cancel the rest
(their clients get a clear error), then exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
from dataclasses import dataclass
from functools import partial
from typing import Literal

import trio
from hypercorn.config import Config as HypercornConfig

from adapters.cli import (
    add_engine_arguments,
    add_key_arguments,
    add_tls_arguments,
    natural,
    positive,
    tls_files,
    warn_unused,
)
from adapters.cli.worker import listen_address
from adapters.engine.options import EngineOptions
from adapters.openai.auth import ENV_KEYS, ApiKeyError, ApiKeys, gather_keys
from adapters.openai.front import FrontDoor, serve_http
from adapters.openai.models import ChatModel, FakeChatModel, ServedModel
from adapters.openai.server import FencepostApp, HttpLimits
from adapters.runtime.controller import Controller
from adapters.runtime.embedded import run_local_worker
from adapters.runtime.tcp_router import serve_workers
from adapters.runtime.tls import Credentials, TlsError, TlsFiles, server_context
from adapters.runtime.worker_host import Decoder, FakeOptions, make_decoder
from adapters.state import StateStore, StoreLimits, StoreUnavailable, open_store, parse_store
from adapters.state.store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RECORDS,
    DEFAULT_TTL_S,
    ENV_STORE,
    default_sqlite_path,
)
from core.config import RouterConfig
from core.fake_model import FAKE_CONTEXT
from core.worker import WorkerConfig

log = logging.getLogger("fencepost.serve")


_DEADLINES = RouterConfig()  # the router's default progress deadlines


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    served_model_name: str | None = None
    worker_listen: tuple[str, int] | None = None
    local_worker: bool = True
    slots: int = 16
    max_context: int | None = None  # None: the model's own (the fake model: 2048)
    threads: int | None = None
    weights: str = "auto"
    prefix_caching: bool = True
    kv_cache_tokens: int | None = None  # None: sized from memory (the fake: the default)
    decode: str = "auto"
    decode_attention: str = "auto"
    speculative: str = "auto"
    draft_model: str | None = None
    speculative_tokens: int = 8
    fake: bool = False
    fake_step_ms: float = 0.0
    fake_prefill_ms_per_token: float = 0.0
    fake_ignore_eos: bool = False
    drain_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 3.0
    max_resumes: int = 2
    keep_alive_timeout_s: float = 5.0
    read_timeout_s: int | None = None
    first_token_timeout_s: float = _DEADLINES.first_token_timeout_s
    prefill_timeout_per_token_s: float = _DEADLINES.prefill_timeout_per_token_s
    token_timeout_s: float = _DEADLINES.token_timeout_s
    stuck_probe_s: float = _DEADLINES.stuck_probe_s
    routing: Literal["cache-aware", "least-loaded"] = "cache-aware"
    limits: HttpLimits | None = None
    api_keys: tuple[str, ...] = ()  # none: the OpenAI port is open
    metrics_public: bool = False
    tls: TlsFiles | None = None  # mutual TLS on the worker port
    router_id: str | None = None  # a prefix for the drawn id (None: the drawn id alone)
    state_store: str = "memory"  # --state-store (the command line's default: a SQLite file)

    @property
    def engine(self) -> EngineOptions:
        """What the in-process worker's engine is built from (adapters/engine/build.py)."""
        return EngineOptions(
            model=self.model,
            max_context=self.max_context,
            slots=self.slots,
            threads=self.threads,
            weights=self.weights,
            decode=self.decode,
            attention=self.decode_attention,
            kv_cache_tokens=self.kv_cache_tokens,
            prefix_caching=self.prefix_caching,
            speculative=self.speculative,
            draft_model=self.draft_model,
            speculative_tokens=self.speculative_tokens,
        )


def router_identity(prefix: str | None) -> str:
    """This incarnation's router id: the prefix, if any, then 8 random hex digits."""
    drawn = secrets.token_hex(4)
    return f"{prefix}-{drawn}" if prefix else drawn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the id clients ask for")
    parser.add_argument(
        "--router-id", default=None, metavar="PREFIX",
        help="prefix of this router's id (each start adds 8 random hex digits)",
    )  # fmt: skip
    parser.add_argument("--worker-listen", type=listen_address, default=None, metavar="HOST:PORT")
    keys = add_key_arguments(parser)
    keys.add_argument(
        "--metrics-public", action="store_true",
        help="serve /metrics and /dashboard.json (the live page's data) without a key "
        "(default: behind the key once one is set)",
    )  # fmt: skip
    add_tls_arguments(parser, "--worker-listen")
    parser.add_argument(
        "--no-local-worker", dest="local_worker", action="store_false",
        help="serve only through remote workers",
    )  # fmt: skip
    add_engine_arguments(parser)
    parser.add_argument("--fake", action="store_true", help="a fake model: instant made-up words")
    parser.add_argument("--fake-step-ms", type=float, default=0.0)
    parser.add_argument(
        "--fake-prefill-ms-per-token", type=float, default=0.0, metavar="MS",
        help="the fake decoder's first token waits this per context token not found in "
        "its prefix cache",
    )  # fmt: skip
    parser.add_argument(
        "--fake-ignore-eos", action="store_true",
        help="the fake decoder runs every answer to its token budget (fixed-length outputs)",
    )  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="SECONDS")
    parser.add_argument(
        "--http-keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
        help="close an idle HTTP connection after this (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--http-read-timeout", type=int, default=None, metavar="SECONDS",
        help="close a connection whose client sends nothing for this long, even while "
        "a response streams to it (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--http-body-timeout", type=float, default=30.0, metavar="SECONDS",
        help="a request body must arrive within this, else 408 (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--state-store", default=None, metavar="STORE",
        help="where stored responses and chat completions live: sqlite:PATH (the default: "
        f"sqlite:{default_sqlite_path()}, kept across restarts), postgresql://USER@HOST/DB "
        "(shared by several routers: any of them continues any conversation), or memory "
        f"(forgotten at exit). ${ENV_STORE} is read when the flag is absent: put a "
        "password there, not on the command line",
    )  # fmt: skip
    parser.add_argument(
        "--response-store-max", type=natural, default=DEFAULT_MAX_RECORDS, metavar="N",
        help="stored responses and chat completions kept, the oldest finished out first "
        "(default %(default)s; 0 stores none)",
    )  # fmt: skip
    parser.add_argument(
        "--response-store-mib", type=positive, default=DEFAULT_MAX_BYTES // 2**20,
        metavar="MIB", help="and at most this many MiB of them, as JSON with their stream "
        "events (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--response-store-ttl", type=float, default=DEFAULT_TTL_S, metavar="SECONDS",
        help="and none older than this (default %(default).0f: 30 days)",
    )  # fmt: skip
    parser.add_argument(
        "--rejoin-grace", type=float, default=30.0, metavar="SECONDS",
        help="a stored stream whose client left goes on this long for it to rejoin "
        "(GET /v1/responses/ID?stream=true&starting_after=N), then is cancelled; "
        "background responses go on regardless (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--store-lease", type=float, default=10.0, metavar="SECONDS",
        help="this router's lease on its live responses in the store; a router that has not "
        "renewed it this long is taken for dead, and its live responses are failed by the "
        "others (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--reasoning-field", choices=("reasoning_content", "reasoning", "both"),
        default="reasoning_content",
        help="where a thinking model's thinking goes in chat messages and stream deltas: "
        "reasoning_content (DeepSeek's, llama.cpp's and SGLang's name, the default), "
        "reasoning (vLLM's), or both",
    )  # fmt: skip
    parser.add_argument(
        "--reasoning-budget", type=positive, default=None, metavar="TOKENS",
        help="a thinking model thinks at most this many tokens unless a request's "
        "max_reasoning_tokens says otherwise; then its thinking block is closed and the "
        "answer begins (default: no budget)",
    )  # fmt: skip
    deadlines = _DEADLINES
    parser.add_argument(
        "--first-token-timeout", type=float, default=deadlines.first_token_timeout_s,
        metavar="SECONDS",
        help="an accepted request's first token is due within this, plus "
        "--prefill-timeout-per-token per prompt token; else it fails over (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-timeout-per-token", type=float,
        default=deadlines.prefill_timeout_per_token_s, metavar="SECONDS",
    )  # fmt: skip
    parser.add_argument(
        "--token-timeout", type=float, default=deadlines.token_timeout_s, metavar="SECONDS",
        help="each next token is due within this; else the stream resumes elsewhere "
        "and the worker gets no offers for --stuck-probe seconds (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--stuck-probe", type=float, default=deadlines.stuck_probe_s, metavar="SECONDS"
    )
    parser.add_argument(
        "--routing", choices=("cache-aware", "least-loaded"), default="cache-aware",
        help="place a request on the worker with the least predicted time to first token, "
        "counting the prompt tokens its prefix cache reports it holds (cache-aware, the "
        "default), or on the one with the fewest requests (least-loaded)",
    )  # fmt: skip
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--max-resumes", type=int, default=2, metavar="N",
        help="continue a started stream on another worker up to N times (default 2)",
    )  # fmt: skip
    resume.add_argument(
        "--no-resume", dest="max_resumes", action="store_const", const=0,
        help="a started stream that loses its worker ends with worker_lost",
    )  # fmt: skip


def options_from(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        host=args.host,
        port=args.port,
        model=args.model,
        served_model_name=args.served_model_name,
        worker_listen=args.worker_listen,
        local_worker=args.local_worker,
        slots=args.slots,
        max_context=args.max_context,
        threads=args.threads,
        weights=args.weights,
        prefix_caching=not args.no_prefix_cache,
        kv_cache_tokens=args.kv_cache_tokens,
        decode=args.decode,
        decode_attention=args.decode_attention,
        speculative=args.speculative,
        draft_model=args.draft_model,
        speculative_tokens=args.speculative_tokens,
        fake=args.fake,
        fake_step_ms=args.fake_step_ms,
        fake_prefill_ms_per_token=args.fake_prefill_ms_per_token,
        fake_ignore_eos=args.fake_ignore_eos,
        drain_timeout_s=args.drain_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        max_resumes=args.max_resumes,
        keep_alive_timeout_s=args.http_keep_alive_timeout,
        read_timeout_s=args.http_read_timeout,
        limits=HttpLimits(
            body_timeout_s=args.http_body_timeout,
            store=StoreLimits(
                args.response_store_max, args.response_store_mib * 2**20, args.response_store_ttl
            ),
            rejoin_grace_s=args.rejoin_grace,
            lease_s=args.store_lease,
            reasoning_field=args.reasoning_field,
            reasoning_budget=args.reasoning_budget,
        ),
        first_token_timeout_s=args.first_token_timeout,
        prefill_timeout_per_token_s=args.prefill_timeout_per_token,
        token_timeout_s=args.token_timeout,
        stuck_probe_s=args.stuck_probe,
        routing=args.routing,
        router_id=args.router_id,
        state_store=state_store_address(args.state_store),
        api_keys=tuple(gather_keys(args.api_key, args.api_key_file)),
        metrics_public=args.metrics_public,
        tls=tls_files(args),
    )


_ENGINE_FLAGS = ("--threads", "--weights", "--decode", "--decode-attention")
_FAKE_FLAGS = ("--fake-step-ms", "--fake-prefill-ms-per-token", "--fake-ignore-eos")


def unused_flag_rules(args: argparse.Namespace) -> list[tuple[bool, tuple[str, ...], str]]:
    """The flags each mode never reads, and why (warn_unused names those given)."""
    local = args.local_worker
    return [
        (args.fake and local, ("--model", *_ENGINE_FLAGS), "--fake loads no model"),
        (args.fake and not local, ("--model",), "--fake loads no model"),
        (
            not local,
            ("--slots", *_ENGINE_FLAGS, "--kv-cache-tokens", "--no-prefix-cache", *_FAKE_FLAGS),
            "with --no-local-worker this process decodes nothing (each worker's own flags decide)",
        ),
        (not args.fake and local, _FAKE_FLAGS, "they shape the fake decoder (--fake only)"),
        (
            args.worker_listen is None,
            ("--tls-cert", "--tls-key", "--tls-ca"),
            "they secure the worker port (--worker-listen)",
        ),
    ]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warn_unused(args, add_arguments, unused_flag_rules(args), log)
    try:
        options = options_from(args)
        if options.tls is not None:
            server_context(options.tls)  # unreadable or mismatched files: said now
        trio.run(_check_store, options)  # unreachable, or a newer schema: said now
    except (ApiKeyError, TlsError, StoreUnavailable, ValueError) as error:
        log.error("%s", error)
        return 2
    model, decoder = build_model(options)
    trio.run(serve_until_signalled, options, model, decoder)
    return 0


def state_store_address(flag: str | None) -> str:
    """The flag, else the environment's, else the embedded default's SQLite file."""
    return flag or os.environ.get(ENV_STORE) or f"sqlite:{default_sqlite_path()}"


def build_store(options: ServeOptions) -> StateStore:
    limits = options.limits.store if options.limits is not None else StoreLimits()
    return open_store(parse_store(options.state_store), limits)


async def _check_store(options: ServeOptions) -> None:
    store = build_store(options)
    try:
        await store.open()
    finally:
        await store.close()
    log.info("state store: %s", store.name)


def _say_who_may_enter(options: ServeOptions, keys: ApiKeys, port: int) -> None:
    if keys.open:
        log.warning(
            "the OpenAI port is open: no API key is set (--api-key, --api-key-file, %s); "
            "anyone who reaches %s:%s is served",
            ENV_KEYS, options.host, port,
        )  # fmt: skip
    else:
        shown = "public" if keys.metrics_public else "behind the key"
        log.info(
            "the OpenAI port needs an API key (%d configured); /metrics and /dashboard.json %s",
            len(keys), shown,
        )  # fmt: skip
    if options.worker_listen is not None:
        if options.tls is None:
            log.warning(
                "the worker port is unauthenticated: any process that reaches it can register "
                "as a worker (--tls-cert, --tls-key, --tls-ca for mutual TLS)"
            )
        else:
            log.info("the worker port needs mutual TLS: certificates of %s", options.tls.ca)


def build_model(options: ServeOptions) -> tuple[ServedModel, Decoder | None]:
    """The served model's boundary half, and the decoder for an in-process worker."""
    fake = FakeOptions(
        options.fake_step_ms / 1000,
        prefill_s_per_token=options.fake_prefill_ms_per_token / 1000,
        ignore_eos=options.fake_ignore_eos,
    )
    if options.fake:
        name = options.served_model_name or "fake"
        if not options.local_worker:
            return FakeChatModel(name, options.max_context or FAKE_CONTEXT), None
        local = make_decoder(options.engine, fake)
        return FakeChatModel(name, local.max_context), local.decoder
    if not options.local_worker:  # a router only: the tokenizer, never the weights
        from adapters.engine.model import load_boundary
        from adapters.engine.options import served_context

        boundary = load_boundary(options.model)
        max_context = served_context(boundary.max_context, options.max_context)
        name = options.served_model_name or boundary.name
        return ChatModel(name, boundary.tokenizer, max_context), None
    local = make_decoder(options.engine, None)
    name = options.served_model_name or local.name or "model"
    return ChatModel(name, local.tokenizer, local.max_context), local.decoder


async def serve_until_signalled(
    options: ServeOptions, model: ServedModel, decoder: Decoder | None
) -> None:
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, options, model, decoder, stop)

            async def wait_for_signal() -> None:
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    stop.set()
                    return

            nursery.start_soon(wait_for_signal)
            await stop.wait()
    log.info("stopped")


@dataclass
class Serving:
    """What a running server reports once it is up."""

    http_port: int
    worker_port: int | None
    controller: Controller
    app: FencepostApp


async def serve(
    options: ServeOptions,
    model: ServedModel,
    decoder: Decoder | None,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `stop` is set, then drain and return."""
    router_id = router_identity(options.router_id)
    log.info("router id %s", router_id)
    router = RouterConfig(
        router_id=router_id,
        heartbeat_timeout_s=options.heartbeat_timeout_s,
        queue_limit=1024,
        max_resumes=options.max_resumes,
        routing=options.routing,
        first_token_timeout_s=options.first_token_timeout_s,
        prefill_timeout_per_token_s=options.prefill_timeout_per_token_s,
        token_timeout_s=options.token_timeout_s,
        stuck_probe_s=options.stuck_probe_s,
    )
    controller = Controller(router)
    keys = ApiKeys(options.api_keys, metrics_public=options.metrics_public)
    app = FencepostApp(controller, [model], options.limits, keys, build_store(options))
    config = HypercornConfig()
    config.bind = [f"{options.host}:{options.port}"]
    config.accesslog = None
    config.graceful_timeout = options.drain_timeout_s + 5
    config.keep_alive_timeout = options.keep_alive_timeout_s
    # Off by default: Hypercorn's read timeout also cuts a long streamed response
    # whose client sends nothing meanwhile, which is every streaming client.
    config.read_timeout = options.read_timeout_s
    door = FrontDoor(keys, app.metrics.unauthorized.inc, options.keep_alive_timeout_s)
    http_stop = trio.Event()

    async with trio.open_nursery() as nursery:
        await nursery.start(controller.run)
        worker_port = None
        if options.worker_listen is not None:
            host, port = options.worker_listen
            context = None if options.tls is None else Credentials(options.tls, server_context)
            worker_port = await nursery.start(
                partial(serve_workers, controller, host, port, tls=context)
            )
        if decoder is not None:
            worker = WorkerConfig("local", slots=options.slots, max_context=model.max_context)
            await nursery.start(run_local_worker, controller, worker, decoder)
        http_done = trio.Event()

        async def run_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await serve_http(
                    app.asgi, config, door, shutdown_trigger=http_stop.wait, task_status=task_status
                )
            finally:
                http_done.set()

        binds = await nursery.start(run_http)
        http_port = int(binds[0].rsplit(":", 1)[1])
        log.info("serving %s on http://%s:%d/v1", model.id, options.host, http_port)
        _say_who_may_enter(options, keys, http_port)
        task_status.started(Serving(http_port, worker_port, controller, app))
        await stop.wait()
        http_stop.set()  # stop accepting connections; open responses continue
        await controller.drain(options.drain_timeout_s)
        # Every request has its outcome now; give the responses a moment to carry
        # it out. (Idle keep-alive connections would hold hypercorn to its whole
        # graceful timeout, so it is not waited for longer than that.)
        with trio.move_on_after(1):
            await http_done.wait()
        nursery.cancel_scope.cancel()
