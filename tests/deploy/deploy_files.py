"""Reading the deploy files as the tests need them: the kdn command lines in them, Helm templates without helm
(or with it, when it is on PATH), and compose's ``${VAR:-default}`` at its defaults."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml  # pyyaml: the dev extra

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "kdn"
COMPOSE = DEPLOY / "compose.yaml"
HELM = shutil.which("helm")

# Every kdn command a deploy file may run, longest first so "policy set" wins over a bare word.
COMMANDS = [
    ("origin", "serve"), ("edge", "serve"), ("host", "serve"), ("policy", "set"), ("policy", "ls"), ("policy", "rm"),
    ("ring", "show"), ("registry", "show"), ("registry", "ls"), ("registry", "nodes"),
    ("publish",), ("address",), ("up",),
]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# "kdn origin serve ..." on one logical line of a unit or a NOTES.txt example
TEXT_COMMAND = re.compile(r"(?<![\w-])kdn\s+(" + "|".join(r"\s+".join(c) for c in COMMANDS) + r")(?![\w-])")


# --- kdn command lines ------------------------------------------------------------------


def help_flags() -> dict[tuple[str, ...], set[str]]:
    """``{("edge", "serve"): {"--region", ...}, ...}`` from ``kdn CMD --help``, all commands run in parallel."""
    procs = {
        cmd: subprocess.Popen([sys.executable, "-P", "-m", "kdn.cli", *cmd, "--help"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in COMMANDS
    }
    out = {}
    for cmd, p in procs.items():
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, f"kdn {' '.join(cmd)} --help failed: {stderr[-2000:]}"
        out[cmd] = set(FLAG.findall(stdout))
    return out


def command_of(items: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """``(command, rest)`` if a command/args list runs kdn (``["kdn", "edge", "serve", ...]`` or without ``kdn``)."""
    words = [str(w) for w in items]
    if words and words[0].rsplit("/", 1)[-1] == "kdn":
        words = words[1:]
    for cmd in COMMANDS:
        if tuple(words[: len(cmd)]) == cmd:
            return cmd, words[len(cmd):]
    return None


def flags_in(words: list[str]) -> set[str]:
    return {m for w in words for m in FLAG.findall(w.split("=", 1)[0] if w.startswith("--") else w)}


def yaml_commands(node, where: str, found: list) -> None:
    """Every kdn invocation in ``command:``/``args:`` lists anywhere in a parsed YAML tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("command", "args", "entrypoint") and isinstance(v, list):
                hit = command_of(v)
                if hit is not None:
                    found.append((where, hit[0], flags_in(hit[1])))
            else:
                yaml_commands(v, where, found)
    elif isinstance(node, list):
        for v in node:
            yaml_commands(v, where, found)


def text_commands(text: str, where: str) -> list:
    """kdn invocations in unit files and notes: per logical line (backslash continuations joined)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        m = TEXT_COMMAND.search(line)
        if m:
            cmd = tuple(m.group(1).split())
            found.append((where, cmd, set(FLAG.findall(line[m.end():]))))
    return found


def check_flags(found: list, help_flags: dict) -> None:
    bad = [f"{where}: kdn {' '.join(cmd)} {flag}" for where, cmd, flags in found for flag in sorted(flags)
           if flag not in help_flags[cmd]]
    assert not bad, "flags that `kdn ... --help` does not list:\n  " + "\n  ".join(bad)


def cmds(found: list) -> set[tuple[str, ...]]:
    return {cmd for _, cmd, _ in found}


def options(words: list[str]) -> dict[str, str]:
    """``--flag=value`` words as ``{"flag": "value"}`` (the last one of a repeated flag)."""
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


# --- Helm templates ---------------------------------------------------------------------


_TPL_COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", re.S)
_TPL_ONLY_LINE = re.compile(r"^\s*(\{\{.*?\}\}\s*)+$")
_TPL = re.compile(r"\{\{.*?\}\}")


def strip_template(text: str) -> str:
    """A Helm template as plain YAML: comments and control-only lines dropped, inline actions -> ``x``.

    Both branches of an ``if`` stay, so every flag a template can emit is seen.
    """
    text = _TPL_COMMENT.sub("", text)
    lines = [ln for ln in text.splitlines() if not _TPL_ONLY_LINE.match(ln)]
    return "\n".join(_TPL.sub("x", ln) for ln in lines) + "\n"


def templates() -> list[Path]:
    return sorted(p for p in (CHART / "templates").iterdir() if p.suffix in (".yaml", ".yml"))


def helm_template(sets: list[str]) -> list[dict]:
    """The chart rendered by ``helm template`` (release ``t``, namespace ``default``) with ``--set`` each of
    ``sets``: its documents."""
    assert HELM is not None
    args = [HELM, "template", "t", str(CHART), "--set", "auth.existingSecret=kdn-tokens"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


# --- compose ----------------------------------------------------------------------------------


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def compose_at_defaults(path: Path) -> dict:
    """A compose file with each ``${VAR:-default}`` at its default (and ``${VAR:?...}`` / ``${VAR}`` as ``VAR``)."""
    return yaml.safe_load(_VAR.sub(lambda m: m.group(2) if m.group(2) is not None else m.group(1), path.read_text()))
