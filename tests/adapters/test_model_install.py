"""The converted-model folder appears atomically and a second converter never deletes the first one's folder."""

from __future__ import annotations

import json
from pathlib import Path

from kdn.adapters.hf.models import _install


def _folder(root: Path, name: str, stamp: dict, weights: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "model.safetensors").write_text(weights)
    (d / "kdn-source.json").write_text(json.dumps(stamp))
    return d


STAMP = {"source": "/x/model.gguf", "size": 10, "mtime_ns": 1}


def test_first_conversion_is_renamed_into_place(tmp_path: Path) -> None:
    tmp = _folder(tmp_path, ".m.tmp", STAMP, "new")
    _install(tmp, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_text() == "new"
    assert not tmp.exists()


def test_a_late_converter_keeps_the_winners_folder(tmp_path: Path) -> None:
    # Two processes loaded the model for the first time at once; the first finished and is loading from
    # its folder. The second must leave that folder alone (it used to delete it, and the first failed).
    dest = _folder(tmp_path, "m", STAMP, "winner")
    inode = (dest / "model.safetensors").stat().st_ino
    tmp = _folder(tmp_path, ".m.tmp", STAMP, "loser")
    _install(tmp, dest)
    assert (dest / "model.safetensors").read_text() == "winner"
    assert (dest / "model.safetensors").stat().st_ino == inode


def test_a_stale_conversion_is_replaced_whole(tmp_path: Path) -> None:
    dest = _folder(tmp_path, "m", {**STAMP, "mtime_ns": 0}, "old")
    (dest / "extra.bin").write_text("from the old source")
    tmp = _folder(tmp_path, ".m.tmp", STAMP, "new")
    _install(tmp, dest)
    assert (dest / "model.safetensors").read_text() == "new"
    assert not (dest / "extra.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing left aside
