"""A real headless Chromium for the browser tests, driven over its DevTools protocol.

The pages under test (the simulator's timeline, the router's /dashboard) are plain
HTML with their own script, so the only honest check is a browser that runs it. This
module starts Debian's `chromium` (installed by scripts/install-browser; tests skip
with that hint where it is absent), opens one page per test over a WebSocket spoken
with wsproto (already here as Hypercorn's), and gives the tests four things: run an
expression in the page, wait for one to hold, the errors the page's own script raised
(exceptions and console errors), and every URL the page asked the network for (so a
test can prove that nothing came from outside the server). Every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    Request,
    TextMessage,
)

INSTALL_HINT = "no chromium here: run scripts/install-browser (apt-get install chromium)"
_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    override = os.environ.get("FENCEPOST_CHROMIUM")
    if override:
        return override if Path(override).exists() else None
    for name in _NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Page:
    """One tab, spoken to over its own DevTools WebSocket."""

    def __init__(self, ws_url: str, timeout_s: float) -> None:
        match = re.match(r"ws://([^/]+)(/.*)", ws_url)
        if match is None:
            raise BrowserError(f"odd DevTools address {ws_url}")
        host, path = match.groups()
        name, port = host.rsplit(":", 1)
        self._sock = socket.create_connection((name, int(port)), timeout=timeout_s)
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._timeout_s = timeout_s
        self._next_id = 0
        self._partial: list[str] = []
        self._inbox: list[dict[str, Any]] = []
        self.errors: list[str] = []  # the page's uncaught exceptions and console errors
        self.requested: list[str] = []  # every URL the page asked the network for
        self._loaded = False
        self._sock.sendall(self._ws.send(Request(host=host, target=path)))
        self._until(lambda: self._open, "the DevTools handshake")
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    _open = False

    def close(self) -> None:
        with suppress(OSError):
            self._sock.sendall(self._ws.send(CloseConnection(code=1000)))
        self._sock.close()

    # --- the protocol ---

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        text = json.dumps({"id": ident, "method": method, "params": params})
        self._sock.sendall(self._ws.send(Message(data=text)))
        found: list[dict[str, Any]] = []

        def answered() -> bool:
            for message in self._inbox:
                if message.get("id") == ident:
                    found.append(message)
                    self._inbox.remove(message)
                    return True
            return False

        self._until(answered, method)
        reply = found[0]
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def _until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"timed out waiting for {what}")
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not data:
                raise BrowserError(f"the browser closed the connection during {what}")
            self._ws.receive_data(data)
            for event in self._ws.events():
                self._on(event)

    def _on(self, event: object) -> None:
        match event:
            case AcceptConnection():
                self._open = True
            case Ping():
                self._sock.sendall(self._ws.send(event.response()))
            case TextMessage(data=data, message_finished=finished):
                self._partial.append(data)
                if finished:
                    message = json.loads("".join(self._partial))
                    self._partial.clear()
                    self._note(message)
                    if "id" in message:
                        self._inbox.append(message)
            case CloseConnection():
                raise BrowserError("the browser closed the page's connection")

    def _note(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            args = [str(a.get("value", a.get("description", ""))) for a in params["args"]]
            self.errors.append("console.error: " + " ".join(args))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')}")
        elif method == "Network.requestWillBeSent":
            self.requested.append(params["request"]["url"])
        elif method == "Page.loadEventFired":
            self._loaded = True

    # --- what the tests use ---

    def open(self, url: str, width: int = 1400, height: int = 900) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self._loaded = False
        reply = self.call("Page.navigate", url=url)
        if reply.get("errorText"):
            raise BrowserError(f"navigating to {url}: {reply['errorText']}")
        self._until(lambda: self._loaded, f"{url} to load")

    def evaluate(self, expression: str) -> Any:
        reply = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression!r} threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 10.0) -> Any:
        """Poll `expression` until it is truthy (bounded), and return its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression!r} stayed falsy for {timeout_s} s")
            time.sleep(0.05)

    def screenshot(self, path: Path) -> None:
        reply = self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(reply["data"]))


@contextmanager
def chromium(timeout_s: float = 30.0) -> Iterator[Page]:
    """A fresh headless Chromium with one blank page; everything ends on exit."""
    binary = find_chromium()
    if binary is None:
        raise BrowserError(INSTALL_HINT)
    profile = tempfile.mkdtemp(prefix="fencepost-chromium-")
    process = subprocess.Popen(
        [
            binary,
            "--headless=new",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={profile}",
            "--no-sandbox",  # the tests run as root in CI, where the sandbox refuses
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--metrics-recording-only",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    page: Page | None = None
    try:
        port = _devtools_port(process, profile, timeout_s)
        page = Page(_page_socket(port, timeout_s), timeout_s)
        yield page
    finally:
        if page is not None:
            page.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(process: subprocess.Popen[str], profile: str, timeout_s: float) -> int:
    """Chromium writes the port it chose into DevToolsActivePort in its profile."""
    marker = Path(profile) / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read() if process.stderr is not None else ""
            raise BrowserError(f"chromium exited {process.returncode}: {err[-2000:]}")
        if marker.exists():
            first = marker.read_text().split("\n", 1)[0].strip()
            if first.isdigit():
                return int(first)
        time.sleep(0.05)
    raise BrowserError(f"chromium did not open its DevTools port within {timeout_s} s")


def _page_socket(port: int, timeout_s: float) -> str:
    """The WebSocket address of the blank tab the browser started with."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as reply:
            targets = json.loads(reply.read())
        for target in targets:
            if target.get("type") == "page" and "webSocketDebuggerUrl" in target:
                return str(target["webSocketDebuggerUrl"])
        time.sleep(0.05)
    raise BrowserError("chromium opened no page")
