"""Where the engine keeps what it saves between starts, and the names those files go by.

Everything fencepost writes for a later start (a GGUF file's config and tokenizer,
compiled native kernels, quality-gate scores, weight-format decisions) lives under
one folder, `cache_root()`, and is named by `fingerprint` of the model it was made
for, so that a changed model finds nothing stale. These helpers sit apart from
model-finding (model.py) because the kernel build and the format choice need them
too, and neither has any business importing the code that finds a model.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """The folder of everything kept between starts: FENCEPOST_CACHE, else fencepost/
    under the user's cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("FENCEPOST_CACHE", Path(base) / "fencepost"))


def fingerprint(path: Path) -> str:
    """A short name for a model source in cache keys. A file (a GGUF) is named by its
    content, so every copy of it (a reinstall, another virtual environment, a fresh
    clone) finds what was saved for it already; a directory is named by its path,
    size and time."""
    stat = path.stat()
    if path.is_file():
        return _content_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return hashlib.sha256(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]


@functools.lru_cache(maxsize=16)
def _content_digest(resolved: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file's bytes (about 0.06 s for the default 98 MB GGUF), computed once
    per process for each (path, size, time): a file rewritten in place is read again."""
    del size, mtime_ns  # part of the memo's key only
    with open(resolved, "rb") as source:
        return hashlib.file_digest(source, "sha256").hexdigest()[:12]
