"""The layering rule, checked from source: core is pure, sim drives core, adapters do IO.

core/ may import only a small allowlist (typing helpers, containers, msgspec,
hashlib for the KV cache's chain keys (a pure function of its input), and
core itself); the modules the design forbids by name are listed separately so
a violation reads as what it is. sim/ may import core, sim and the standard
library, never adapters or a third-party package.

adapters/ is production code; the benches live in their own top-level home
(BENCH_PACKAGES: bench/); the benches and the commands that run the simulator
or a bench: those alone may import sim, and only the benches and their command
may import a bench, so a server never carries either. adapters/engine turns
assignments into tokens on its own thread and knows nothing of the runtime,
the HTTP boundary, the command line or the async stack they run on.

The floors (FLOORS), bottom to top:

    core < adapters.engine < adapters.runtime < adapters.openai < adapters.cli < the benches

A module may import its own floor and the floors below it; an import that
reaches a floor above is an arrow up, and reported. sim stands beside the
adapters' floors, on core only: the two rules above keep it there. Who may
reach the top floor is the bench rule's to say (the `bench` command may), and
core's allowlist already keeps it on the ground floor, so the floor check
reads adapters/ and the bench homes. Every import counts here, those under
`if TYPE_CHECKING:` too: a type named from above is still a dependency up.

No circle inside a package (PACKAGES): within each of core, sim, the four
adapters packages and each bench home, the modules' imports, function-local
ones included, form no circle, each reported as a chain "a -> b -> a" with
the line of every arrow. An import under `if TYPE_CHECKING:` does not count:
it never runs, so it closes no circle when the modules load.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections.abc import Mapping
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

# The benches' home (one: top-level bench/); every rule below follows this tuple.
BENCH_PACKAGES = ("bench",)
BENCHES = tuple(package.replace(".", "/") + "/" for package in BENCH_PACKAGES)
# Paths (a folder ends in "/") that may import sim, and the benches.
MAY_IMPORT_SIM = (
    *BENCHES,
    "adapters/cli/bench.py",
    "adapters/cli/sim.py",
    "adapters/cli/mutants.py",
)
MAY_IMPORT_BENCH = (*BENCHES, "adapters/cli/bench.py")
ENGINE = "adapters/engine/"
ENGINE_FORBIDDEN = ("adapters.runtime", "adapters.openai", "adapters.cli", "trio", "quart",
                    "quart_trio", "hypercorn")  # fmt: skip
DYNAMIC = "<dynamic import>"
# Bottom to top: a module may import its own floor and the floors below, never one above.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("adapters.engine",),
    ("adapters.runtime", "adapters.state"),  # the state store beside the runtime
    ("adapters.openai",),
    ("adapters.cli",),
    BENCH_PACKAGES,
)
# Inside each of these, the modules import one another without a circle.
PACKAGES = ("core", "sim", "adapters.engine", "adapters.runtime", "adapters.state",
            "adapters.openai", "adapters.cli", *BENCH_PACKAGES)  # fmt: skip


@dataclass(frozen=True)
class Import:
    """One imported module: `import module`, or `from module import *names`."""

    line: int
    module: str  # dotted, relative imports resolved; DYNAMIC for __import__/import_module
    names: tuple[str, ...] = ()
    typing_only: bool = False  # under `if TYPE_CHECKING:`: read by mypy, never run

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    @property
    def names_in_full(self) -> list[str]:
        """module.name for each name imported from the module."""
        return [f"{self.module}.{name}" for name in self.names]

    def reaches(self, package: str) -> str | None:
        """What of `package` this imports (the module, or module.name), if anything."""
        for name in (self.module, *self.names_in_full):
            if name == package or name.startswith(package + "."):
                return name
        return None


def imports(path: Path, root: Path) -> list[Import]:
    """Every import in a file under root, dynamic ones and those inside functions included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root).parent.parts
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for statement in node.body  # not orelse: that branch runs
        for inner in ast.walk(statement)
    }
    found: list[Import] = []
    for node in ast.walk(tree):
        guarded = id(node) in typing_only
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, (), guarded) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            names = tuple(a.name for a in node.names)
            found.append(Import(node.lineno, module, names, guarded))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in {"__import__", "importlib.import_module", "import_module"}:
                found.append(Import(node.lineno, DYNAMIC, (), guarded))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def module_name(path: Path, root: Path) -> str:
    """The dotted name a file under root is imported by (a package by its folder's)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(name: str) -> int | None:
    """Which of FLOORS a dotted module name stands on (0 the lowest), if any."""
    for height, packages in enumerate(FLOORS):
        if any(name == package or name.startswith(package + ".") for package in packages):
            return height
    return None


def _sources(root: Path, package: str) -> list[Path]:
    folder = root / package.replace(".", "/")
    return sorted(folder.rglob("*.py")) if folder.is_dir() else []


def violations(root: Path) -> list[str]:
    """Every import under root's packages that breaks the layering, then every circle."""
    return [*_core(root), *_sim(root), *_adapters(root), *circles(root)]


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
    """adapters/ and any bench home outside it: sim and the benches kept out, the floors."""
    outside = [package for package in BENCH_PACKAGES if not package.startswith("adapters.")]
    problems: list[str] = []
    for path in [*_sources(root, "adapters"), *(p for b in outside for p in _sources(root, b))]:
        where = path.relative_to(root).as_posix()
        module = module_name(path, root)
        for found in imports(path, root):
            at = f"{path}:{found.line}:"
            named: list[str] = []  # arrows the engine's rule reports: not reported twice
            if found.module == DYNAMIC and not where.startswith(BENCHES):
                problems.append(
                    f"{at} adapters code makes a dynamic import, which no rule can check"
                )
            if (name := found.reaches("sim")) and not where.startswith(MAY_IMPORT_SIM):
                problems.append(f"{at} production code imports {name}")
            for bench in BENCH_PACKAGES:
                if (name := found.reaches(bench)) and not where.startswith(MAY_IMPORT_BENCH):
                    problems.append(f"{at} code outside the benches imports {name}")
            if where.startswith(ENGINE):
                reached = (found.reaches(package) for package in ENGINE_FORBIDDEN)
                named += [name for name in reached if name]
                problems += [f"{at} the engine imports {name}" for name in named]
            problems += [
                f"{at} an arrow up the floors: {module} imports {name}"
                for name in _upward(module, found)
                if not any(name == n or name.startswith(n + ".") for n in named)
            ]
    return problems


def _upward(module: str, found: Import) -> list[str]:
    """What of a floor above module's this import reaches, the benches' floor aside.

    Who may import a bench is the bench rule's to say (its command may), so the
    top floor is left to it; every other floor is for the floors above it only.
    """
    here = floor(module)
    if here is None:
        return []
    # `from adapters import cli, openai` reaches two floors; `from adapters.cli import x`, one
    names = [found.module] if floor(found.module) is not None else found.names_in_full
    heights = ((name, floor(name)) for name in names)
    return [name for name, there in heights if there is not None and here < there < len(FLOORS) - 1]


def circles(root: Path) -> list[str]:
    """Every circle of imports among one package's modules, as a chain a -> b -> a.

    A function-local import counts (it runs, only later); an import under `if
    TYPE_CHECKING:` does not. An arrow goes to the module an import names: `from
    p import m` to p.m where that is a module, else to p; not to the packages
    above it, which Python runs first but which name no module of their own here.
    """
    problems: list[str] = []
    for package in PACKAGES:
        paths = {module_name(path, root): path for path in _sources(root, package)}
        arrows = {module: _arrows(path, root, paths) for module, path in paths.items()}
        for chain in _cycles(arrows):
            steps = list(itertools.pairwise(chain))
            names = " -> ".join(module[len(package) + 1 :] or "__init__" for module in chain)
            folder = root / package.replace(".", "/")
            lines = ", ".join(
                f"{paths[a].relative_to(folder).as_posix()}:{arrows[a][b]}" for a, b in steps
            )
            first, after = steps[0]
            problems.append(
                f"{paths[first]}:{arrows[first][after]}: import circle in {package}: "
                f"{names} ({lines})"
            )
    return problems


def _arrows(path: Path, root: Path, modules: Mapping[str, Path]) -> dict[str, int]:
    """The modules of `modules` that a file imports, each with the line of its first import."""
    arrows: dict[str, int] = {}
    for found in imports(path, root):
        if found.typing_only or found.module == DYNAMIC:
            continue
        targets = [name for name in found.names_in_full if name in modules]
        if not targets and found.module in modules:
            targets = [found.module]
        for target in targets:
            arrows.setdefault(target, found.line)
    return arrows


def _cycles(arrows: Mapping[str, Mapping[str, int]]) -> list[tuple[str, ...]]:
    """Every elementary circle, each once: starting at its least module, closed."""
    found: list[tuple[str, ...]] = []

    def walk(start: str, path: list[str]) -> None:
        for target in sorted(arrows.get(path[-1], {})):
            if target == start:
                found.append((*path, start))
            elif target > start and target not in path:
                walk(start, [*path, target])

    for start in sorted(arrows):
        walk(start, [start])
    return sorted(found)
