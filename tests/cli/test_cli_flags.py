"""Flags a mode never reads are named in one warning line, not silently dropped."""

from __future__ import annotations

import logging

import pytest

from adapters.cli import serve, warn_unused, worker
from adapters.cli.main import parser

LOG = logging.getLogger("test.cli")


def warnings_for(*argv: str) -> list[str]:
    args = parser().parse_args(list(argv))
    module = serve if args.command == "serve" else worker
    return warn_unused(args, module.add_arguments, module.unused_flag_rules(args), LOG)


def test_fake_serving_names_the_model_flags_it_ignores(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "test.cli"):
        lines = warnings_for(
            "serve", "--fake", "--model", "x.gguf", "--weights", "int4", "--threads", "3",
            "--decode", "eager", "--kv-cache-tokens", "4096",
        )  # fmt: skip
    assert lines == ["ignoring --model, --threads, --weights, --decode: --fake loads no model"]
    assert [r.getMessage() for r in caplog.records] == lines  # one line, logged


def test_a_router_without_a_local_worker_names_every_decoder_flag() -> None:
    lines = warnings_for(
        "serve", "--no-local-worker", "--worker-listen", "127.0.0.1:0", "--weights", "bf16",
        "--threads", "2", "--kv-cache-tokens", "4096", "--decode", "static", "--slots", "4",
        "--max-context", "512",
    )  # fmt: skip
    assert len(lines) == 1
    assert lines[0].startswith(
        "ignoring --slots, --threads, --weights, --decode, --kv-cache-tokens: with "
        "--no-local-worker this process decodes nothing"
    )
    assert "--max-context" not in lines[0]  # the router still caps contexts by it


def test_fake_decoder_flags_without_fake_and_a_fake_router_with_a_model() -> None:
    assert warnings_for("serve", "--fake-step-ms", "5") == [
        "ignoring --fake-step-ms: they shape the fake decoder (--fake only)"
    ]
    assert warnings_for("serve", "--fake", "--no-local-worker", "--model", "m") == [
        "ignoring --model: --fake loads no model"
    ]
    assert warnings_for("worker", "--connect", "h:1", "--fake", "--weights", "int8") == [
        "ignoring --weights: --fake loads no model"
    ]
    assert warnings_for("worker", "--connect", "h:1", "--fake-hang-after", "3") == [
        "ignoring --fake-hang-after: they shape the fake decoder (--fake only)"
    ]


def test_flags_a_mode_reads_or_leaves_at_their_default_say_nothing() -> None:
    assert warnings_for("serve") == []
    assert warnings_for("serve", "--fake", "--fake-step-ms", "5", "--slots", "4") == []
    assert warnings_for("serve", "--weights", "int4", "--threads", "2", "--decode", "eager") == []
    assert warnings_for("serve", "--no-local-worker", "--weights", "auto") == []  # the default
    assert warnings_for("worker", "--connect", "h:1", "--fake", "--kv-cache-tokens", "64") == []
