"""``kdn.client.versions.VersionFile``: a manifest's high-water mark is raised only once it is on disk."""

from __future__ import annotations

import pytest

from kdn.client.versions import VersionFile


def test_a_mark_whose_write_failed_is_written_by_the_next_rise_to_it(tmp_path):
    """Second reading of #28 item 4: the mark was raised in memory before its write, so after a failed write
    (a full disk, say) the same version was never written again and a restart could take the replay."""
    vf = VersionFile(tmp_path / "versions.json")
    real = vf._write

    def full_disk(table):
        raise OSError(28, "No space left on device")

    vf._write = full_disk
    with pytest.raises(OSError):
        vf["public/handbook"] = 7
    assert vf.get("public/handbook") is None  # not raised: it is not on disk
    vf._write = real
    vf["public/handbook"] = 7
    assert VersionFile(tmp_path / "versions.json").get("public/handbook") == 7  # a restart keeps it
