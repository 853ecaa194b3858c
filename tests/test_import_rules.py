"""The import boundary holds for the project, and the checker catches a violation."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_rules import BENCH_PACKAGES, violations

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
            "from bench.harness import scrape\n",
            ["code outside the benches imports bench.harness"],
        ),
        (
            "adapters/openai/x.py",
            "import bench\n",
            ["code outside the benches imports bench"],
        ),
        (
            "adapters/cli/sim.py",
            "from sim.simulator import Scenario\nfrom bench import harness\n",
            ["code outside the benches imports bench"],
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
        (
            "adapters/openai/x.py",
            "from bench.gpu_check import main\n",
            ["code outside the benches imports bench.gpu_check"],
        ),
        # the floors: core < engine < runtime < openai < cli < the benches
        (
            "adapters/runtime/x.py",
            "from adapters.openai.server import FencepostApp\n",
            ["an arrow up the floors: adapters.runtime.x imports adapters.openai.server"],
        ),
        (
            "adapters/runtime/x.py",
            "def run() -> None:\n    from adapters import cli, engine, openai\n",
            [
                "an arrow up the floors: adapters.runtime.x imports adapters.cli",
                "an arrow up the floors: adapters.runtime.x imports adapters.openai",
            ],
        ),
        (
            "adapters/openai/x.py",
            "from ..cli.serve import ServeOptions\n",
            ["an arrow up the floors: adapters.openai.x imports adapters.cli.serve"],
        ),
        (
            "adapters/runtime/x.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from adapters.openai.server import FencepostApp\n",
            ["an arrow up the floors: adapters.runtime.x imports adapters.openai.server"],
        ),
        (  # the engine's own rule names it, once
            "adapters/engine/x.py",
            "from adapters.cli import main\n",
            ["the engine imports adapters.cli"],
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
            "adapters/cli/bench.py": "def run() -> None:\n    from bench import router\n",
            "bench/drill.py": "from bench.harness import Server\nimport sim\n",
            "adapters/engine/ok.py": "import torch\nfrom core.batching import BatchLimits\n"
            "from . import llama\n",
            "adapters/runtime/ok.py": "import trio\nfrom adapters.engine.engine import Engine\n",
        },
    )
    assert violations(root) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "adapters/engine/a.py": "from adapters.engine.b import B\n",
                "adapters/engine/b.py": "def f() -> None:\n    from adapters.engine import a\n",
            },
            ["import circle in adapters.engine: a -> b -> a (a.py:1, b.py:2)"],
        ),
        (
            {
                "core/a.py": "from .b import x\n",
                "core/b.py": "from . import c\n",
                "core/c.py": "import core.a\n",
            },
            ["import circle in core: a -> b -> c -> a (a.py:1, b.py:1, c.py:1)"],
        ),
        (  # two circles through one module: both told
            {
                "sim/hub.py": "from sim import left, right\n",
                "sim/left.py": "from sim.hub import x\n",
                "sim/right.py": "from sim.hub import y\n",
            },
            [
                "import circle in sim: hub -> left -> hub (hub.py:1, left.py:1)",
                "import circle in sim: hub -> right -> hub (hub.py:1, right.py:1)",
            ],
        ),
        (
            {
                "adapters/cli/__init__.py": "from adapters.cli.main import parser\n",
                "adapters/cli/main.py": "from adapters.cli import positive\n",
            },
            [
                "import circle in adapters.cli: __init__ -> main -> __init__"
                " (__init__.py:1, main.py:1)"
            ],
        ),
        (
            {
                "adapters/engine/families/llama.py": "from adapters.engine.spec import Spec\n",
                "adapters/engine/spec.py": "from adapters.engine.families import llama\n",
            },
            [
                "import circle in adapters.engine: families.llama -> spec -> families.llama"
                " (families/llama.py:1, spec.py:1)"
            ],
        ),
        (
            {"bench/a.py": "import bench.b\n", "bench/b.py": "from bench import a\n"},
            ["import circle in bench: a -> b -> a (a.py:1, b.py:1)"],
        ),
        (  # only the TYPE_CHECKING branch is left out; its else runs
            {
                "adapters/runtime/a.py": "from adapters.runtime.b import B\n",
                "adapters/runtime/b.py": "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    pass\nelse:\n    from adapters.runtime.a import A\n",
            },
            ["import circle in adapters.runtime: a -> b -> a (a.py:1, b.py:5)"],
        ),
    ],
)
def test_an_import_circle_inside_a_package_is_caught(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    assert _messages(_tree(tmp_path, files)) == expected


def test_arrows_down_the_floors_and_type_only_imports_back_pass(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "adapters/engine/a.py": "from core.protocol import Token\nfrom . import b\n",
            "adapters/engine/b.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from adapters.engine.a import A\n",
            "adapters/runtime/a.py": "from adapters.engine import a\nfrom core import protocol\n",
            "adapters/openai/a.py": "from adapters.runtime.a import X\n"
            "from adapters.engine.a import Y\n",
            "adapters/cli/serve.py": "from adapters.openai import a\n"
            "from adapters import runtime\n",
            "adapters/cli/bench.py": "def run() -> None:\n    from bench import drill\n"
            "    import bench.gpu_check\n",
            "bench/drill.py": "from adapters.cli import serve\nimport bench.gpu_check\n",
            "bench/gpu_check.py": "from bench.harness import x\n"
            "from adapters.openai import a\nimport sim\n",
            # the same module names in two packages are two modules: no circle
            "sim/a.py": "from core import a\n",
            "core/a.py": "from core import protocol\n",
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
@pytest.mark.parametrize("package", [*BENCH_PACKAGES, "sim"])
def test_serving_commands_load_neither_the_simulator_nor_the_benches(
    argv: tuple[str, ...], package: str
) -> None:
    loaded = _loaded_by(*argv)
    assert "adapters.cli.serve" in loaded  # the parser was built
    assert sorted(m for m in loaded if m == package or m.startswith(package + ".")) == []
