"""bench/faults.py's scenarios on a three-member etcd, with CI's short durations: the leader SIGKILLed during a
publish, under the edges' watches and under their lease renewals, and the member every node uses frozen (SIGSTOP).

Every node is given all three members with ``a`` first, and ``a`` is made the leader, so each fault lands on the
member every node talks to. The bar: no wrong byte, no failed read, no edge out of the ring for longer than its
lease, and a publish whole or failed, never half. The full runs and their table are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

import faults  # bench/faults.py, on sys.path through conftest.py

pytestmark = pytest.mark.timeout(180)


def check(row) -> None:
    print(faults.table([row]))
    assert row.reads > 100, "the readers hardly read: the scenario proves nothing"
    assert row.wrong == 0, f"{row.scenario}: {row.wrong} wrong bodies served"
    assert row.failed == 0, f"{row.scenario}: {row.failed} failed reads, why: {row.failed_why}"


async def test_etcd_leader_killed_mid_publish(tmp_path):
    row = await faults.etcd_leader_killed_publish(tmp_path, quick=True)
    check(row)
    n = row.notes
    assert n["job_outcome"] != "finished first", "the publish ended before the leader died: the test proves nothing"
    assert n["publish"] in ("landed whole", "failed, no manifest"), n["publish"]
    assert n["objects_without_record"] == 0


async def test_etcd_leader_killed_under_the_edges_watches(tmp_path):
    row = await faults.etcd_leader_killed_watch(tmp_path, quick=True)
    check(row)
    n = row.notes
    assert n["watch_failures_logged"] > 0, "no watch broke: the leader was not the edges' member"
    # the policy written during the election reached every edge; the stopped edge left, the restarted one came back
    assert row.heal_s < 30 and n["edge_left_every_ring_s"] < 10 and n["edge_joined_every_ring_s"] < 30


async def test_etcd_leader_killed_under_lease_renewals(tmp_path):
    row = await faults.etcd_leader_killed_leases(tmp_path, quick=True)
    check(row)
    n = row.notes
    # A lease no member could renew during the election is alive after it (a new leader extends every lease):
    # the edges keep renewing it, and their keys never leave the registry.
    assert n["longest_absence_s"] <= n["lease_ttl_s"], n
    assert n["node_key_deletes"] == 0, n


async def test_etcd_member_frozen_with_sigstop(tmp_path):
    row = await faults.etcd_member_stopped(tmp_path, quick=True)
    check(row)
    n = row.notes
    # each node's keep-alive gives a frozen member a third of the lease, then asks the next member. The bar is the
    # issue's: no edge out of the ring for longer than its lease. On a quiet machine no key is deleted at all
    # (bench/faults.py's recorded row); on CI's two cores shared with the whole suite a 2 s lease was seen to lapse
    # (3 of 4 nodes once, each back within 0.32 s): at most once per node is allowed here.
    assert n["longest_absence_s"] <= n["lease_ttl_s"], n
    assert n["node_key_deletes"] <= 4, n
    assert row.heal_s < 30
