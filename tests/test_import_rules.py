"""The import boundary holds for the project, and the checker catches a violation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_rules import violations

ROOT = Path(__file__).resolve().parent.parent


def test_the_project_keeps_its_layers() -> None:
    assert violations(ROOT) == []


def _tree(tmp_path: Path, package: str, source: str) -> Path:
    for name in ("core", "sim"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / package / "bad.py").write_text(source)
    return tmp_path


@pytest.mark.parametrize(
    ("package", "source", "expected"),
    [
        ("core", "import time\n", "core imports forbidden time"),
        ("core", "from random import Random\n", "core imports forbidden random"),
        ("core", "import trio.lowlevel\n", "core imports forbidden trio"),
        ("core", "from adapters.cli import main\n", "core imports forbidden adapters"),
        ("core", "from sim.cluster import Cluster\n", "core imports forbidden sim"),
        ("core", "import json\n", "core imports json, not on its allowlist"),
        (
            "core",
            "m = __import__('socket')\n",
            "core imports <dynamic import>, not on its allowlist",
        ),
        ("sim", "from adapters import cli\n", "sim imports adapters"),
        ("sim", "import trio\n", "sim imports trio"),
    ],
)
def test_a_deliberate_violation_is_caught(
    tmp_path: Path, package: str, source: str, expected: str
) -> None:
    [problem] = violations(_tree(tmp_path, package, source))
    assert problem.endswith(expected)


def test_allowed_imports_pass(tmp_path: Path) -> None:
    root = _tree(tmp_path, "core", "from collections import deque\nfrom core import protocol\n")
    (root / "sim" / "ok.py").write_text("import heapq\nfrom core.router import Router\n")
    assert violations(root) == []
