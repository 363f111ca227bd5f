"""House order (#31): no product module over 500 lines, no function over 60, but for the few named below.

The product is every folder pyproject.toml maps into the ``kdn`` package (kdn/, service/, up/, origin/, edge/,
kernels/, adapters/); bench/ and tests/ are not product. A module or function that grows past its limit fails
here: split it along a seam (one concern per module), or, if it truly cannot be, name it in EXCEPTIONS with why.
An exception that no longer applies fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# "path" (a module) or "path::qualname" (a function, as Python's __qualname__ spells it): why it stays.
EXCEPTIONS: dict[str, str] = {}  # none left: #31 split the last eleven


def product_folders() -> list[Path]:
    """The folders setuptools maps into ``kdn`` (package-dir), as scripts/typecheck finds them."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return sorted({ROOT / d for d in dirs.values()})


def _functions(node: ast.AST, prefix: str = ""):
    """(qualname, lines) of every function under ``node``, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            assert child.end_lineno is not None
            yield name, child.end_lineno - child.lineno + 1
            yield from _functions(child, name + ".<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        else:
            yield from _functions(child, prefix)


def oversize() -> dict[str, int]:
    """Every module and function over its limit: {"path" or "path::qualname": lines}."""
    found: dict[str, int] = {}
    for folder in product_folders():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text()
            lines = len(text.splitlines())
            if lines > MAX_MODULE_LINES:
                found[rel] = lines
            for name, n in _functions(ast.parse(text, rel)):
                if n > MAX_FUNCTION_LINES:
                    found[f"{rel}::{name}"] = n
    return found


def test_the_product_folders_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in product_folders()}
    assert {"kdn", "edge", "origin", "kernels", "adapters", "service", "up"} <= names, names


def test_no_module_over_500_lines_and_no_function_over_60():
    over = {k: n for k, n in oversize().items() if k not in EXCEPTIONS}
    assert not over, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {over}; split "
                      "it along a seam, or name it in EXCEPTIONS with why")


def test_every_exception_is_still_needed():
    stale = sorted(set(EXCEPTIONS) - set(oversize()))
    assert not stale, f"within the limits now (or gone): remove {stale} from EXCEPTIONS"
