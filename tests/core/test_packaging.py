"""Packaging: one installed package `kdn`, its parts in top-level folders, and a light core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import re
import textwrap
from importlib.metadata import distribution, entry_points
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
PARTS = ("origin", "edge", "kernels", "adapters", "service", "up")


def run_python(code: str, cwd: Path) -> dict:
    """Run ``code`` with ``-P`` from ``cwd`` (outside the checkout); it prints one JSON value."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-P", "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_parts_are_kdn_subpackages_from_their_top_level_folders(tmp_path):
    got = run_python(
        """
        import importlib, json, sys
        out = {}
        for part in ("origin", "edge", "kernels", "adapters", "service", "up"):
            out["kdn." + part] = importlib.import_module("kdn." + part).__file__
            try:
                importlib.import_module(part)
                out[part] = "imported from " + str(sys.modules[part].__file__)
            except ModuleNotFoundError as e:
                out[part] = "ModuleNotFoundError: " + str(e.name)
        print(json.dumps(out))
        """,
        tmp_path,
    )
    for part in PARTS:
        assert Path(got[f"kdn.{part}"]).resolve().parent == CHECKOUT / part
        assert got[part] == f"ModuleNotFoundError: {part}", f"a generic top-level `{part}` is importable"


def test_core_import_stays_light(tmp_path):
    loaded = run_python(
        """
        import json, sys
        import kdn, kdn.format.address, kdn.format.objects, kdn.format.codecs, kdn.errors, kdn.format.store
        print(json.dumps(sorted(m for m in ("torch", "transformers", "aiohttp") if m in sys.modules)))
        """,
        tmp_path,
    )
    assert loaded == []


def test_the_edge_server_does_not_load_model_libraries(tmp_path):
    """An edge moves bytes: it runs on a host without torch (a cache node next to engines, not an engine), so
    nothing on its import path may pull torch or transformers in."""
    loaded = run_python(
        """
        import json, sys
        import kdn.edge.app, kdn.edge.node, kdn.edge.cli, kdn.edge.policies
        kdn.edge.app.create_app
        print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
        """,
        tmp_path,
    )
    assert loaded == []


def test_the_core_folder_holds_no_server_code():
    """Server plumbing lives in service/ (kdn.service), beside origin/ and edge/ that use it, not in the core."""
    offenders = [str(p.relative_to(CHECKOUT)) for p in sorted((CHECKOUT / "kdn").rglob("*.py"))
                 if re.search(r"^\s*(from aiohttp import web|from aiohttp\.web|import aiohttp\.web)", p.read_text(), re.M)]
    assert offenders == []


def test_cli_parser_does_not_load_model_libraries(tmp_path):
    loaded = run_python(
        """
        import json, sys
        import kdn.cli
        kdn.cli.build_parser()
        print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
        """,
        tmp_path,
    )
    assert loaded == []


def test_console_script_entry_point():
    (ep,) = entry_points(group="console_scripts", name="kdn")
    assert ep.value == "kdn.cli:main"
    assert ep.dist is not None and ep.dist.name == "kdn"
    declared = re.search(r'^version = "([^"]+)"', (CHECKOUT / "pyproject.toml").read_text(), re.M)
    assert declared and distribution("kdn").version == declared.group(1)


def test_tests_import_the_installed_kdn_package():
    # tests/ is on sys.path; a tests/kdn/ folder would shadow the package as a namespace package.
    import kdn

    assert kdn.__file__ is not None, f"`kdn` is {kdn.__spec__}"
    assert Path(kdn.__file__).resolve() == CHECKOUT / "kdn" / "__init__.py"

