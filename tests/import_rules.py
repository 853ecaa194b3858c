"""The layering rule, checked from source: core is pure, sim drives core, adapters do IO.

core/ may import only a small allowlist (typing helpers, containers, msgspec and
core itself); the modules the design forbids by name are listed separately so
a violation reads as what it is. sim/ may import core, sim and the standard
library, never adapters or a third-party package.
"""

from __future__ import annotations

import ast
import sys
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
        "itertools", "heapq", "bisect", "math", "msgspec", "core",
    }
)  # fmt: skip
SIM_ALLOWED_PACKAGES = frozenset({"core", "sim"})


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) for every import in a file, dynamic ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside the package being checked
                continue
            found.append((node.lineno, (node.module or "").split(".")[0]))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in {"__import__", "importlib.import_module", "import_module"}:
                found.append((node.lineno, "<dynamic import>"))
    return found


def violations(root: Path) -> list[str]:
    """Every import under root/core and root/sim that breaks the layering rule."""
    problems: list[str] = []
    for path in sorted((root / "core").rglob("*.py")):
        for line, module in imported_modules(path):
            if module in CORE_FORBIDDEN:
                problems.append(f"{path}:{line}: core imports forbidden {module}")
            elif module not in CORE_ALLOWED:
                problems.append(f"{path}:{line}: core imports {module}, not on its allowlist")
    for path in sorted((root / "sim").rglob("*.py")):
        for line, module in imported_modules(path):
            stdlib = module in sys.stdlib_module_names or module == "__future__"
            if module not in SIM_ALLOWED_PACKAGES and not stdlib:
                problems.append(f"{path}:{line}: sim imports {module}")
    return problems
