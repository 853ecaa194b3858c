"""API keys on the OpenAI port: who may use it, checked before anything else runs.

A request must carry `Authorization: Bearer <key>` with one of the configured
keys, as every OpenAI client sends it. The check runs in the ASGI entry point,
ahead of Quart: a refused request reads no body, builds no job, and never
reaches the controller, so refusing is cheap however many arrive. Keys are
held as SHA-256 digests and each presented key is compared with every digest
in constant time (hmac.compare_digest, no early exit), so neither the reply
nor its timing says how much of a key was right or how many keys there are.
Every refusal gets the same 401 (code `invalid_api_key`, whatever was wrong:
no header, another scheme, an unknown key).

/health and /live stay open for probes, and /dashboard (a static page with no data
in it: its script asks /dashboard.json, sending the key the viewer types in). The
figures, /metrics and /dashboard.json, are open only when the operator says so
(`--metrics-public`). The front door (front.py) and the ASGI check both ask
`needs_key`, so the two agree on every path. With no key configured the port is
open to anyone who reaches it, and the server says so at start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from adapters.openai.errors import OpenAIError

ENV_KEYS = "FENCEPOST_API_KEYS"  # keys separated by commas or whitespace
OPEN_PATHS = frozenset({"/health", "/live", "/dashboard"})  # probes; a page with no data
FIGURE_PATHS = frozenset({"/metrics", "/dashboard.json"})  # open with --metrics-public

UNAUTHORIZED = OpenAIError(
    401,
    "Invalid or missing API key: send it as 'Authorization: Bearer <key>'.",
    "invalid_request_error",
    None,
    "invalid_api_key",
)
REFUSAL_BODY = msgspec.json.encode(UNAUTHORIZED.body())  # every 401's body, wherever refused
# ... and its headers, the same from the front door (front.py) and the ASGI check
REFUSAL_HEADERS = (
    (b"content-type", b"application/json"),
    (b"content-length", str(len(REFUSAL_BODY)).encode()),
    (b"www-authenticate", b'Bearer realm="fencepost"'),
    (b"connection", b"close"),  # its body, if any, is never read
)


class ApiKeyError(ValueError):
    """A key source that cannot be used (a missing or empty file, a malformed key)."""


def _digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


class ApiKeys:
    """The keys the port accepts; none means the port is open."""

    def __init__(self, keys: Iterable[str] = (), *, metrics_public: bool = False) -> None:
        self._digests = [_digest(key) for key in dict.fromkeys(keys)]
        self.metrics_public = metrics_public

    @property
    def open(self) -> bool:
        return not self._digests

    def __len__(self) -> int:
        return len(self._digests)

    def needs_key(self, path: str) -> bool:
        """Whether a request for `path` must show a key."""
        if self.open or path in OPEN_PATHS:
            return False
        return not (self.metrics_public and path in FIGURE_PATHS)

    def admits(self, authorization: bytes | None) -> bool:
        """Whether an Authorization header's value carries an accepted key."""
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return False
        presented = _digest(token)
        found = False
        for digest in self._digests:  # every one, whatever matched: constant time
            found |= hmac.compare_digest(presented, digest)
        return found


def _checked(key: str, where: str) -> str:
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ApiKeyError(f"{where}: an API key must be printable, without spaces")
    return key


def read_key_file(path: Path) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ApiKeyError(f"cannot read the API key file {path}: {error.strerror}") from None
    keys = [
        _checked(line.strip(), f"{path} line {n}")
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise ApiKeyError(f"the API key file {path} holds no key")
    return keys


def gather_keys(
    flags: Sequence[str] = (), files: Sequence[Path] = (), environ: dict[str, str] | None = None
) -> list[str]:
    """Every configured key: --api-key values, --api-key-file contents, and the
    FENCEPOST_API_KEYS variable."""
    keys = [_checked(key, "--api-key") for key in flags]
    for path in files:
        keys.extend(read_key_file(path))
    env = (os.environ if environ is None else environ).get(ENV_KEYS, "")
    keys.extend(_checked(key, ENV_KEYS) for key in env.replace(",", " ").split())
    return keys
