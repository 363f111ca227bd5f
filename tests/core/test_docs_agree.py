"""What the docs say about the tree and its defaults, checked: the README's layout table names every product
module (it once missed 35 of them); the defaults operations.md quotes are the code's; the edge and the client
import no torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ["kdn", "kdn/format", "kdn/wire", "kdn/registry", "kdn/client", "host", "service", "up", "origin", "origin/console", "edge", "kernels", "adapters/hf",
           "adapters/vllm", "adapters/sglang", "adapters/lmcache"]


def layout_rows() -> dict[str, str]:
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| `([a-z/]+)/` \| [^|]+ \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_readme_layout_table_names_every_module(folder):
    rows = layout_rows()
    row = rows.get(folder) or rows.get(folder.split("/")[0])
    assert row is not None, f"README's layout table has no row for {folder}/"
    modules = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if f"`{m}`" not in row]
    assert not missing, f"README's layout row for {folder}/ does not name {missing}"


def test_every_product_folder_is_checked():
    """A new product folder needs a row (and a place in FOLDERS)."""
    packages = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("*/**/__init__.py")
                if p.relative_to(ROOT).parts[0] not in ("tests", "bench", "deploy", "build", "docs")
                and not any(part.startswith(".") or part.endswith(".egg-info") or part == "site-packages"
                            for part in p.relative_to(ROOT).parts)}
    unnamed = {p for p in packages - set(FOLDERS) if not any(f.startswith(p + "/") for f in FOLDERS)}
    assert not unnamed, sorted(unnamed)  # (adapters/ holds only the hf/ and vllm/ rows' packages)


def test_the_ring_default_the_docs_quote_is_the_codes():
    """operations.md sized disks with 160 vnodes for a while after the code's default became 320."""
    import inspect

    from kdn.edge.membership import Membership
    from kdn.ring import Ring

    default = inspect.signature(Ring).parameters["vnodes"].default
    assert inspect.signature(Membership).parameters["vnodes"].default == default
    ops = (ROOT / "docs" / "operations.md").read_text()
    quoted = {int(n) for n in re.findall(r"default (\d+) vnodes", ops)} | {int(n) for n in re.findall(r"Ring\(vnodes=(\d+)\)", ops)}
    assert quoted == {default}, quoted


def test_the_edge_and_the_client_import_no_torch():
    """The edge runs without torch (README: "edge/ ... no torch"), and so does the fetch client: a fresh
    interpreter importing their modules, CLI included, never loads it (nor transformers)."""
    import subprocess
    import sys

    code = ("import sys, kdn.edge.app, kdn.edge.cli, kdn.edge.fill, kdn.client, kdn.wire.fetch, kdn.cli, kdn.service; "
            "print(','.join(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", f"loaded {r.stdout.strip()}"


REF = re.compile(r"(?<![\w/.-])((?:bench|docs|tests|kdn|edge|origin|adapters|kernels|service|up|deploy|scripts|\.ci)/"
                 r"[\w/.-]*\w\.(?:py|md|yaml|yml|json|jsonl|sh|png|toml|txt))(?![\w.])")


def test_every_file_the_docs_and_docstrings_name_exists():
    """A path named in the README, docs/ or a module's text is a file in the tree (outputs under bench/work/
    and placeholders in capitals excepted). Two named tests/kdn/, which moved to tests/core/ long ago."""
    texts = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("deploy/**/*.md")]
    texts += [p for d in FOLDERS + ["bench", "scripts"] for p in (ROOT / d).glob("*.py")]
    broken = []
    for f in texts:
        for m in REF.finditer(f.read_text(errors="replace")):
            ref = m.group(1)
            if ref.startswith("bench/work/") or re.search(r"/[A-Z]+\.\w+$", ref):
                continue
            # the installed names of the parts: kdn/edge/app.py is edge/app.py in the tree
            if not ((ROOT / ref).exists() or (ref.startswith("kdn/") and (ROOT / ref[4:]).exists())):
                broken.append(f"{f.relative_to(ROOT)}: {ref}")
    assert not broken, broken


def test_nothing_in_bench_imports_tests():
    """What benches and tests share lives in bench/lib (the design's rule: bench/ imports no tests/ module)."""
    shared = {p.stem for d in (ROOT / "bench", ROOT / "bench" / "lib") for p in d.glob("*.py")}
    test_only = {p.stem for p in (ROOT / "tests").rglob("*.py")} - shared
    offenders = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if (ROOT / "bench" / "work") in path.parents:  # (scratch: e.g. bench/ttft_ab.py's checkout of another commit)
            continue
        text = path.read_text()
        if re.search(r'ROOT\s*/\s*"tests"|["\']tests/', text.split('"""', 2)[-1] if text.startswith('"""') else text):
            offenders.append(f"{path.relative_to(ROOT)}: puts tests/ on its path")
        for m in re.finditer(r"^\s*(?:from|import)\s+(\w+)", text, re.M):
            if m.group(1) in test_only and not m.group(1).startswith("test_"):
                offenders.append(f"{path.relative_to(ROOT)}: imports {m.group(1)} from tests/")
    assert not offenders, offenders
