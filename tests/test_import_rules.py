"""The import boundary holds for the project, and the checker catches a violation."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_rules import violations

ROOT = Path(__file__).resolve().parent.parent


def test_the_project_keeps_its_layers() -> None:
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A project under tmp_path: core/ and sim/, plus `files` in their packages."""
    for name in ("core", "sim"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "__init__.py").write_text("")
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in Path(name).parents[:-1]:  # each package folder, not the root
            (tmp_path / folder / "__init__.py").touch()
        path.write_text(source)
    return tmp_path


def _messages(root: Path) -> list[str]:
    return [problem.split(": ", 1)[1] for problem in violations(root)]


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("core/bad.py", "import time\n", ["core imports forbidden time"]),
        ("core/bad.py", "from random import Random\n", ["core imports forbidden random"]),
        ("core/bad.py", "import trio.lowlevel\n", ["core imports forbidden trio"]),
        ("core/bad.py", "from adapters.cli import main\n", ["core imports forbidden adapters"]),
        ("core/bad.py", "from sim.cluster import Cluster\n", ["core imports forbidden sim"]),
        ("core/bad.py", "import json\n", ["core imports json, not on its allowlist"]),
        (
            "core/bad.py",
            "m = __import__('socket')\n",
            ["core imports <dynamic import>, not on its allowlist"],
        ),
        ("sim/bad.py", "from adapters import cli\n", ["sim imports adapters"]),
        ("sim/bad.py", "import trio\n", ["sim imports trio"]),
        (
            "adapters/runtime/x.py",
            "from sim.cluster import EOS_TOKEN, FakeContext\n",
            ["production code imports sim.cluster"],
        ),
        (
            "adapters/cli/serve.py",
            "def run() -> None:\n    import sim.simulator\n",
            ["production code imports sim.simulator"],
        ),
        (
            "adapters/openai/x.py",
            "from adapters.bench.harness import scrape\n",
            ["code outside the benches imports adapters.bench.harness"],
        ),
        (
            "adapters/openai/x.py",
            "from adapters import bench\n",
            ["code outside the benches imports adapters.bench"],
        ),
        (
            "adapters/cli/sim.py",
            "from sim.simulator import Scenario\nfrom adapters.bench import harness\n",
            ["code outside the benches imports adapters.bench"],
        ),
        (
            "adapters/engine/x.py",
            "from adapters.runtime.loop import Serial\nimport trio\n",
            ["the engine imports adapters.runtime.loop", "the engine imports trio"],
        ),
        (
            "adapters/engine/x.py",
            "from ..openai import server\n",
            ["the engine imports adapters.openai"],
        ),
        (
            "adapters/engine/x.py",
            "from quart_trio import QuartTrio\n",
            ["the engine imports quart_trio"],
        ),
        (
            "adapters/runtime/x.py",
            "import importlib\nsim = importlib.import_module('sim')\n",
            ["adapters code makes a dynamic import, which no rule can check"],
        ),
    ],
)
def test_a_deliberate_violation_is_caught(
    tmp_path: Path, path: str, source: str, expected: list[str]
) -> None:
    assert _messages(_tree(tmp_path, {path: source})) == expected


def test_allowed_imports_pass(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "core/ok.py": "from collections import deque\nfrom core import protocol\n",
            "sim/ok.py": "import heapq\nfrom core.router import Router\n",
            "adapters/cli/sim.py": "def run() -> None:\n    from sim.simulator import Scenario\n",
            "adapters/cli/mutants.py": "import subprocess\nfrom sim import sweep\n",
            "adapters/cli/bench.py": "def run() -> None:\n    from adapters.bench import router\n",
            "adapters/bench/drill.py": "from adapters.bench.harness import Server\nimport sim\n",
            "adapters/engine/ok.py": "import torch\nfrom core.batching import BatchLimits\n"
            "from . import llama\n",
            "adapters/runtime/ok.py": "import trio\nfrom adapters.engine.engine import Engine\n",
        },
    )
    assert violations(root) == []


# Build the command line, parse a serving command's flags, and list what got loaded.
_PARSE_AND_LIST = """
import sys
from adapters.cli.main import parser
parser().parse_args(sys.argv[1:])
print("\\n".join(sys.modules))
"""


@functools.cache
def _loaded_by(*argv: str) -> frozenset[str]:
    command = [sys.executable, "-c", _PARSE_AND_LIST, *argv]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return frozenset(done.stdout.split())


@pytest.mark.parametrize(
    "argv",
    [("serve", "--fake", "--port", "0"), ("worker", "--connect", "127.0.0.1:9000", "--fake")],
)
@pytest.mark.parametrize("package", ["adapters.bench", "sim"])
def test_serving_commands_load_neither_the_simulator_nor_the_benches(
    argv: tuple[str, ...], package: str
) -> None:
    loaded = _loaded_by(*argv)
    assert "adapters.cli.serve" in loaded  # the parser was built
    assert sorted(m for m in loaded if m == package or m.startswith(package + ".")) == []
