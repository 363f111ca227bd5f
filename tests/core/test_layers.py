"""The floor plan as a test: which room may import which (docs/design.md, "Which way imports run").

Read from the code with ``ast`` (every import, at module level or inside a function: a lazy import is still an
arrow), like tests/core/test_sizes.py. Rooms are the wings of the core (``kdn/format``, ``kdn/wire``,
``kdn/registry``, ``kdn/client``), the core's root primitives, the root CLI, and the other parts. The rules:

- ``LAYERS`` orders the rooms: a room imports only rooms at or below its own layer (no back-arrow);
- ``ALLOWED`` lists, for each room, every other room it may import at all;
- no module imports ``kdn.cli`` (the composition root reaches up into the parts, never the other way);
- no import circle between modules, lazy imports included (a circle is a file cut where there was no seam).

docs/design.md's diagram is checked against ``ALLOWED`` below (``test_the_design_diagram_is_these_rules``).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"kdn": "kdn", "origin": "kdn.origin", "edge": "kdn.edge", "kernels": "kdn.kernels",
         "adapters": "kdn.adapters", "service": "kdn.service", "up": "kdn.up", "host": "kdn.host"}
WINGS = ("format", "wire", "registry", "client")

# Rooms in layers, lowest first: a room may import only rooms of its own layer or below.
LAYERS: list[set[str]] = [
    {"errors"},
    {"format"},
    {"root"},  # kdn/*.py primitives: units, auth, ring, tls, emphasis, template, planner, chunk
    {"wire", "registry"},
    {"kernels"},
    {"client"},
    {"adapters", "service"},
    {"edge", "origin"},
    {"host"},
    {"up"},
    {"cli"},
]
# Every room another room may import (besides itself). "cli" is imported by no one.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "format": {"errors"},
    "root": {"errors", "format"},
    "wire": {"errors", "format", "root"},
    "registry": {"errors", "format", "root"},
    "kernels": {"errors", "format", "root", "wire"},
    "client": {"errors", "format", "root", "wire", "registry", "kernels"},
    "adapters": {"errors", "format", "root", "wire", "registry", "kernels", "client"},
    "service": {"errors", "format", "root", "wire", "registry"},
    "edge": {"errors", "format", "root", "wire", "registry", "client", "service"},
    "host": {"errors", "format", "root", "wire", "registry", "client", "service", "edge"},  # (edge's flight, eviction)
    "origin": {"errors", "format", "root", "wire", "registry", "kernels", "client", "adapters", "service"},
    "up": {"errors", "format", "root", "wire", "registry", "kernels", "client", "adapters", "service", "edge",
           "origin", "host"},
    "cli": {"errors", "format", "root", "wire", "registry", "kernels", "client", "adapters", "service", "edge",
            "origin", "host", "up"},
}


def modules() -> dict[str, Path]:
    """Every product module by its import name."""
    out = {}
    for folder, name in PARTS.items():
        base = ROOT / folder
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(base).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            if folder == "kdn" and rel.parts and rel.parts[0] in {f for f in PARTS if f != "kdn"}:
                continue
            out[".".join([name, *parts])] = p
    return out


def room(module: str) -> str:
    """The room a module lives in."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in {f for f in PARTS if f != "kdn"}:
        return parts[1]
    if len(parts) >= 2 and parts[1] in WINGS:
        return parts[1]
    if module == "kdn.cli":
        return "cli"
    if module == "kdn.errors":
        return "errors"
    return "root"


@cache
def imports(module: str) -> frozenset[str]:
    """The product modules ``module`` imports (the deepest existing name of each import)."""
    known = modules()
    path = known[module]
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module and not (n == "kdn" and not n.startswith("kdn.")):
                out.add(n)
    out.discard("kdn")  # `import kdn.x` names the package on the way
    return frozenset(out)


def arrows() -> list[tuple[str, str]]:
    return [(m, d) for m in modules() for d in imports(m)]


def layer(r: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if r in rooms)


def test_every_room_is_placed():
    rooms = {room(m) for m in modules()}
    assert rooms <= set(ALLOWED), rooms - set(ALLOWED)
    assert {r for layer_ in LAYERS for r in layer_} == set(ALLOWED)


def test_no_room_imports_one_it_may_not():
    bad = sorted(f"{m} -> {d}" for m, d in arrows()
                 if room(m) != room(d) and room(d) not in ALLOWED[room(m)])
    assert not bad, "imports across rooms the floor plan does not allow:\n" + "\n".join(bad)


def test_no_back_arrow():
    bad = sorted(f"{m} ({room(m)}) -> {d} ({room(d)})" for m, d in arrows() if layer(room(d)) > layer(room(m)))
    assert not bad, "arrows up the layers:\n" + "\n".join(bad)


def test_nothing_imports_the_root_cli():
    bad = sorted(m for m, d in arrows() if d == "kdn.cli")
    assert not bad, bad


def test_edge_and_origin_never_import_each_other():
    bad = sorted(f"{m} -> {d}" for m, d in arrows() if {room(m), room(d)} == {"edge", "origin"})
    assert not bad, bad


def test_inside_the_core_only_the_client_wing_imports_kernels():
    core = {"errors", "format", "root", "wire", "registry", "client", "cli"}
    bad = sorted(f"{m} -> {d}" for m, d in arrows() if room(m) in core - {"client", "cli"} and room(d) == "kernels")
    assert not bad, bad


def test_no_import_circle_between_modules():
    graph = {m: sorted(d for d in imports(m) if not modules()[d].name == "__init__.py") for m in modules()}
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    circles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        stack.append(m)
        for d in graph.get(m, []):
            if seen.get(d) == 1:
                circles.append(stack[stack.index(d):] + [d])
            elif d not in seen:
                visit(d, stack)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_design_diagram_is_these_rules():
    """docs/design.md's table of rooms lists, for each room, exactly the rooms ``ALLOWED`` lets it import."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("<!-- layers:begin -->")
    end = text.index("<!-- layers:end -->")
    rows = {}
    for line in text[start:end].splitlines():
        if line.startswith("| `") and "|" in line[1:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            name = cells[0].strip("`")
            rows[name] = {c.strip().strip("`") for c in cells[2].split(",") if c.strip() and c.strip() != "-"}
    assert rows == ALLOWED, "docs/design.md's import table differs from tests/core/test_layers.py ALLOWED"
