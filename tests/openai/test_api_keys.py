"""API keys on the OpenAI port: the right key gets in, nothing else reaches the router."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from adapters.cli.main import main
from adapters.cli.serve import ServeOptions
from adapters.openai.auth import ApiKeyError, ApiKeys, gather_keys, read_key_file
from tests.support.http_helpers import ServerThread, chat_body
from tests.support.process_helpers import LogWatcher, fencepost
from tests.support.runtime_helpers import kill_all

KEY = "sk-fencepost-test-0123456789"
OTHER = "sk-fencepost-other-9876543210"


def test_only_a_bearer_header_with_a_configured_key_is_admitted() -> None:
    keys = ApiKeys([KEY, OTHER])
    assert keys.admits(f"Bearer {KEY}".encode()) and keys.admits(f"bearer {OTHER}".encode())
    assert keys.admits(f"  Bearer   {KEY}  ".encode())  # spaces around are no matter
    for wrong in (None, b"", KEY.encode(), f"Basic {KEY}".encode(), b"Bearer ", b"Bearer x",
                  f"Bearer {KEY}x".encode(), f"Bearer {KEY[:-1]}".encode()):  # fmt: skip
        assert not keys.admits(wrong), wrong
    assert ApiKeys().open and not keys.open and len(keys) == 2


def test_health_is_open_and_metrics_only_when_made_public() -> None:
    closed, public = ApiKeys([KEY]), ApiKeys([KEY], metrics_public=True)
    assert not closed.needs_key("/health") and closed.needs_key("/metrics")
    assert not public.needs_key("/metrics") and public.needs_key("/v1/models")
    assert not ApiKeys().needs_key("/v1/chat/completions")  # no key: open


def test_keys_come_from_flags_files_and_the_environment(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.write_text(f"# the team's keys\n\n{KEY}\n  {OTHER}  \n")
    assert read_key_file(file) == [KEY, OTHER]
    env = {"FENCEPOST_API_KEYS": "sk-a, sk-b sk-c"}
    assert gather_keys(["sk-x"], [file], env) == ["sk-x", KEY, OTHER, "sk-a", "sk-b", "sk-c"]
    (tmp_path / "empty").write_text("# nothing\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ApiKeyError, match=str(bad)):
            read_key_file(bad)
    with pytest.raises(ApiKeyError, match="--api-key"):
        gather_keys(["two words"], [], {})


def _sdk(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True, api_keys=(KEY, OTHER))) as server:
        yield server


def test_without_the_right_key_every_api_answers_401_and_nothing_is_submitted(
    guarded: ServerThread,
) -> None:
    def seen() -> tuple[float, int]:
        """(401s counted, requests that reached the router: outcomes plus those open)."""
        headers = {"Authorization": f"Bearer {KEY}"}
        page = requests.get(f"{guarded.base_url}/metrics", headers=headers, timeout=10).text
        found = re.search(r"^fencepost_unauthorized_requests_total (\S+)$", page, re.MULTILINE)
        assert found is not None, page
        router = guarded.statistics().router
        return float(found[1]), sum(router.outcomes.values()) + sum(
            router.requests_by_phase.values()
        )

    refused_before, reached_before = seen()
    with pytest.raises(openai.AuthenticationError) as refused:
        _sdk(guarded, "sk-wrong").chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert refused.value.code == "invalid_api_key"
    attempts = [
        ("post", "/v1/chat/completions", {}),
        ("post", "/v1/completions", {"Authorization": OTHER}),  # no scheme
        ("post", "/v1/responses", {"Authorization": f"Basic {KEY}"}),
        ("post", "/v1/chat/completions", {"X-Api-Key": KEY}),  # not where OpenAI sends it
        ("get", "/v1/models", {"Authorization": "Bearer "}),
        ("get", "/v1/responses/resp_1", {"Authorization": f"Bearer {KEY[:-1]}"}),
        ("get", "/metrics", {}),
        ("get", "/no/such/route", {}),  # no key: not even whether a route exists
    ]
    bodies = set()
    for method, path, headers in attempts:
        response = requests.request(
            method, guarded.base_url + path, headers=headers, json=chat_body(), timeout=10
        )
        assert response.status_code == 401, (path, headers, response.text)
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        bodies.add(response.text)
    assert len(bodies) == 1  # one answer whatever was wrong: no hint of which keys exist
    assert '"code":"invalid_api_key"' in bodies.pop()
    assert requests.get(f"{guarded.base_url}/health", timeout=10).status_code == 200
    assert seen() == (refused_before + 1 + len(attempts), reached_before)  # none reached it


def test_with_either_key_the_sdk_is_served(guarded: ServerThread) -> None:
    for key in (KEY, OTHER):
        client = _sdk(guarded, key)
        # Greedy: a sampled fake answer may end at its first token, with no text.
        answer = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        assert answer.choices[0].message.content
        assert [m.id for m in client.models.list()] == ["fake"]
        streamed = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            temperature=0,
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)


def test_a_refusal_closes_the_connection_without_reading_the_body(guarded: ServerThread) -> None:
    port = int(guarded.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # A body declared at 100 MB and never sent: the answer must not wait for it.
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n"
        sock.sendall(head + b"Content-Type: application/json\r\n\r\n{")
        received = b""
        while chunk := sock.recv(4096):  # until the server closes (the timeout bounds it)
            received += chunk
    assert received.startswith(b"HTTP/1.1 401")


def test_metrics_public_leaves_metrics_open_and_the_api_closed() -> None:
    options = ServeOptions(port=0, fake=True, api_keys=(KEY,), metrics_public=True)
    with ServerThread(options) as server:
        assert requests.get(f"{server.base_url}/metrics", timeout=10).status_code == 200
        assert requests.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401


def test_serve_reads_a_key_file_says_it_is_guarded_and_refuses_a_bad_file(
    tmp_path: Path,
) -> None:
    assert main(["serve", "--fake", "--api-key-file", str(tmp_path / "missing")]) == 2
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    processes: list[subprocess.Popen[str]] = []
    try:
        processes.append(fencepost("serve", "--fake", "--port", "0", "--api-key-file", str(keys)))
        log = LogWatcher(processes[0])
        port = log.find(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1")[1]
        log.find(
            r"the OpenAI port needs an API key \(1 configured\); "
            r"/metrics and /dashboard\.json behind the key"
        )
        base = f"http://127.0.0.1:{port}"
        assert requests.get(f"{base}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model="fake", prompt="a", max_tokens=2).choices
    finally:
        kill_all(processes)


def test_an_open_port_says_so_at_start() -> None:
    processes = [fencepost("serve", "--fake", "--port", "0")]
    try:
        LogWatcher(processes[0]).find(r"the OpenAI port is open: no API key is set")
    finally:
        kill_all(processes)
