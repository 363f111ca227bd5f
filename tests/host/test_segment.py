"""The segment and the socket are readable only by the host's user (or its engines' group), engines map only the
file the host made and cannot write it, and a second host never takes over a live one's socket."""

from __future__ import annotations

import grp
import os
import socket
import stat

import pytest
from host_helpers import Shelf, host_config, running

from kdn.errors import InvalidInput, KDNError
from kdn.client.host import HostClient
from kdn.client.host import Identity, map_readonly
from kdn.host.segment import Segment
from kdn.host.server import check_socket_free


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_socket_and_segment_are_the_users_alone_by_default(short_dir):
    async with running(host_config(short_dir), Shelf()) as tier:
        assert mode(tier.config.socket) == 0o600 and mode(tier.config.segment) == 0o600
        assert os.stat(tier.config.segment).st_size == tier.config.segment_bytes
    assert not os.path.exists(tier.config.socket) and not os.path.exists(tier.config.segment)


async def test_with_a_group_the_engines_group_reads_the_segment_and_connects(short_dir):
    group = grp.getgrgid(os.getgid()).gr_name
    async with running(host_config(short_dir, group=group), Shelf()) as tier:
        assert mode(tier.config.socket) == 0o660 and mode(tier.config.segment) == 0o640
        assert os.stat(tier.config.segment).st_gid == os.getgid()


def test_an_engine_maps_the_segment_read_only_and_only_the_hosts_file(short_dir):
    seg = Segment.create(short_dir / "s.seg", 1 << 20)
    try:
        seg.view[:4] = b"kdn!"
        mm, view = map_readonly(seg.path, seg.identity)
        assert view.readonly and bytes(view[:4]) == b"kdn!"
        with pytest.raises(TypeError):
            view[:4] = b"evil"  # PROT_READ: no write through the mapping
        view.release()
        mm.close()
        other = Identity(seg.identity.device, seg.identity.inode + 1, seg.identity.size)
        with pytest.raises(KDNError, match="not the segment"):
            map_readonly(seg.path, other)
    finally:
        seg.close()
    assert not seg.path.exists()


def test_a_segment_the_machine_cannot_hold_fails_at_start_in_one_line(short_dir):
    with pytest.raises(InvalidInput, match="no room for"):
        Segment.create(short_dir / "huge.seg", 1 << 50)
    assert not (short_dir / "huge.seg").exists()


async def test_a_second_host_on_a_live_socket_is_refused_and_a_stale_one_replaced(short_dir):
    async with running(host_config(short_dir), Shelf()) as tier:
        with pytest.raises(InvalidInput, match="another host tier serves"):
            await check_socket_free(tier.config.socket)
        async with HostClient(tier.config.socket) as c:  # untouched, still serving
            assert (await c.stats())["connections"] == 1
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(short_dir / "h.sock"))  # a host that died: its file, nobody listening
    dead.close()
    await check_socket_free(short_dir / "h.sock")
    assert not (short_dir / "h.sock").exists()
    (short_dir / "h.sock").write_text("not a socket")
    with pytest.raises(InvalidInput, match="not a socket"):
        await check_socket_free(short_dir / "h.sock")


def test_a_second_host_on_a_live_segment_is_refused(short_dir):
    seg = Segment.create(short_dir / "s.seg", 1 << 20)
    seg.view[:4] = b"old!"
    try:
        with pytest.raises(InvalidInput, match="a running host tier holds"):
            Segment.create(short_dir / "s.seg", 1 << 20)
        assert os.stat(seg.path).st_ino == seg.identity.inode  # untouched
    finally:
        seg.close(unlink=False)  # (a host that died: its file stays, unlocked)
    again = Segment.create(short_dir / "s.seg", 1 << 20)  # a stale file is replaced by a new, empty one
    try:
        assert bytes(again.view[:4]) == b"\0\0\0\0"
    finally:
        again.close()


async def test_on_map_sees_each_mapping_and_its_undo_runs_before_the_unmap(short_dir):
    """``HostClient(on_map=)`` (the GPU engines' page-locking, ``kdn.kernels.pinned.pin_mapping``): called with the
    whole read-only segment at connect and again after a restart's reconnect, its undo called before each
    mapping goes, while the view is still readable. On this CPU machine ``pin_mapping`` itself registers nothing."""
    from kdn.kernels.pinned import pin_mapping

    events: list[tuple[str, int]] = []

    def on_map(view: memoryview):
        events.append(("map", len(view)))
        return lambda: events.append(("undo", view[0] if len(view) else -1))  # (reads it: still mapped)

    async with running(host_config(short_dir), Shelf()) as tier:
        host = await HostClient(tier.config.socket, on_map=on_map).connect()
        assert events == [("map", tier.config.segment_bytes)]
        await host.reconnect()
        assert [e for e, _ in events] == ["map", "undo", "map"]
        await host.close()
        assert [e for e, _ in events] == ["map", "undo", "map", "undo"]
    assert pin_mapping(memoryview(b"x" * 4096)) is None  # no CUDA device here: nothing page-locked, copies pageable
