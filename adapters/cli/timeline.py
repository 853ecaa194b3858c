"""`fencepost sim --seed N --html FILE`: one run as a picture.

The run's Timeline (sim/timeline.py) is put into timeline.html beside this module
as inline JSON, so the file is whole by itself: no network when it is viewed, no
files beside it. The page's own script draws only what is in view, and counts
messages per lane where they are too many to draw, so a long run stays usable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("timeline.html")


def render(data: dict[str, Any]) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    # Inside <script>, "</" could end the element early (a request id never holds it,
    # a violation's text might): JSON allows the escaped slash.
    text = text.replace("</", "<\\/")
    page = TEMPLATE.read_text(encoding="utf-8")
    return page.replace("__SEED__", str(int(data["seed"]))).replace("__DATA__", text)


def write(data: dict[str, Any], path: Path) -> int:
    """Write the page; returns its size in bytes."""
    page = render(data).encode()
    path.write_bytes(page)
    return len(page)
