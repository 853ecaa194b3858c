"""The layering rule, checked from source: core is pure, sim drives core, adapters do IO.

core/ may import only a small allowlist (typing helpers, containers, msgspec,
hashlib for the KV cache's chain keys (a pure function of its input), and
core itself); the modules the design forbids by name are listed separately so
a violation reads as what it is. sim/ may import core, sim and the standard
library, never adapters or a third-party package.

adapters/ is production code except for the benches (adapters/bench/) and
the commands that run the simulator or a bench: those alone may import sim,
and only the benches and their command may import adapters.bench, so a server
never carries either. adapters/engine turns assignments into tokens on its
own thread and knows nothing of the runtime, the HTTP boundary, the command
line or the async stack they run on.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

CORE_FORBIDDEN = frozenset(
    {
        "sim", "adapters", "trio", "asyncio", "threading", "socket", "time", "random",
        "torch", "transformers", "quart", "quart_trio", "hypercorn", "datetime", "os",
        "logging", "secrets", "uuid", "subprocess", "multiprocessing", "selectors",
    }
)  # fmt: skip
CORE_ALLOWED = frozenset(
    {
        "__future__", "typing", "enum", "dataclasses", "collections", "abc", "functools",
        "itertools", "heapq", "bisect", "math", "hashlib", "types", "msgspec", "core",
    }
)  # fmt: skip
SIM_ALLOWED_PACKAGES = frozenset({"core", "sim"})

# Paths under adapters/ (a folder ends in "/") that may import sim, and adapters.bench.
BENCHES = "adapters/bench/"
MAY_IMPORT_SIM = (
    BENCHES,
    "adapters/cli/bench.py",
    "adapters/cli/sim.py",
    "adapters/cli/mutants.py",
)
MAY_IMPORT_BENCH = (BENCHES, "adapters/cli/bench.py")
ENGINE = "adapters/engine/"
ENGINE_FORBIDDEN = ("adapters.runtime", "adapters.openai", "adapters.cli", "trio", "quart",
                    "quart_trio", "hypercorn")  # fmt: skip
DYNAMIC = "<dynamic import>"


@dataclass(frozen=True)
class Import:
    """One imported module: `import module`, or `from module import *names`."""

    line: int
    module: str  # dotted, relative imports resolved; DYNAMIC for __import__/import_module
    names: tuple[str, ...] = ()

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def reaches(self, package: str) -> str | None:
        """What of `package` this imports (the module, or module.name), if anything."""
        for name in (self.module, *(f"{self.module}.{n}" for n in self.names)):
            if name == package or name.startswith(package + "."):
                return name
        return None


def imports(path: Path, root: Path) -> list[Import]:
    """Every import in a file under root, dynamic ones and those inside functions included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root).parent.parts
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            found.append(Import(node.lineno, module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in {"__import__", "importlib.import_module", "import_module"}:
                found.append(Import(node.lineno, DYNAMIC))
    return found


def violations(root: Path) -> list[str]:
    """Every import under root/core, root/sim and root/adapters that breaks the layering."""
    return [*_core(root), *_sim(root), *_adapters(root)]


def _core(root: Path) -> list[str]:
    problems: list[str] = []
    for path in sorted((root / "core").rglob("*.py")):
        for found in imports(path, root):
            if found.top in CORE_FORBIDDEN:
                problems.append(f"{path}:{found.line}: core imports forbidden {found.top}")
            elif found.top not in CORE_ALLOWED:
                problems.append(
                    f"{path}:{found.line}: core imports {found.top}, not on its allowlist"
                )
    return problems


def _sim(root: Path) -> list[str]:
    problems: list[str] = []
    for path in sorted((root / "sim").rglob("*.py")):
        for found in imports(path, root):
            stdlib = found.top in sys.stdlib_module_names or found.top == "__future__"
            if found.top not in SIM_ALLOWED_PACKAGES and not stdlib:
                problems.append(f"{path}:{found.line}: sim imports {found.top}")
    return problems


def _adapters(root: Path) -> list[str]:
    problems: list[str] = []
    for path in sorted((root / "adapters").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for found in imports(path, root):
            at = f"{path}:{found.line}:"
            if found.module == DYNAMIC and not where.startswith(BENCHES):
                problems.append(
                    f"{at} adapters code makes a dynamic import, which no rule can check"
                )
            if (name := found.reaches("sim")) and not where.startswith(MAY_IMPORT_SIM):
                problems.append(f"{at} production code imports {name}")
            if (name := found.reaches("adapters.bench")) and not where.startswith(MAY_IMPORT_BENCH):
                problems.append(f"{at} code outside the benches imports {name}")
            if where.startswith(ENGINE):
                reached = (found.reaches(package) for package in ENGINE_FORBIDDEN)
                problems += [f"{at} the engine imports {name}" for name in reached if name]
    return problems
