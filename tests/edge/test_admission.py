"""Operator-signed node admissions (#28 item 11, node records): a registry writer cannot add a node of its choice.

``kdn node admit`` signs (role, region, node id, URL, expiry) with an operator key; a node carries it in its
record (``--admission``); readers that require admissions (``kdn edge serve --require-admission``,
``KDNClient.from_registry(admitted_by=)``) leave out every other node record. Real registries, real edges.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import cluster  # noqa: E402

from kdn import cli  # noqa: E402
from kdn.client import KDNClient  # noqa: E402
from kdn.errors import InvalidInput  # noqa: E402
from kdn.registry import Admission, EmbeddedRegistry, NodeRecord  # noqa: E402
from kdn.registry.signing import Signer, Verifier, unadmitted  # noqa: E402


def admitted(signer: Signer, node: NodeRecord, *, expires: float | None = None) -> NodeRecord:
    adm = signer.sign(Admission(node.role, node.region, node.node_id, node.url, expires or time.time() + 3600))
    return dataclasses.replace(node, extra={**node.extra, "admission": adm.to_dict()})


def test_only_an_operators_admission_of_that_very_node_admits_it(tmp_path):
    op, other = Signer.generate(tmp_path / "op.key"), Signer.generate(tmp_path / "other.key")
    ops = Verifier([op.public])
    e2 = NodeRecord(role="edge", region="eu", node_id="e2", url="http://127.0.0.1:9002")
    assert unadmitted(admitted(op, e2), ops) is None
    assert unadmitted(e2, ops) == "carries no admission"
    assert "not signed by a trusted operator key" in unadmitted(admitted(other, e2), ops)
    good = admitted(op, e2)
    tampered = dict(good.extra["admission"], expires=good.extra["admission"]["expires"] + 10**6)
    assert "not signed" in unadmitted(dataclasses.replace(good, extra={"admission": tampered}), ops)
    # a real admission, copied onto a record that points elsewhere (the writer's own server)
    rogue = dataclasses.replace(good, url="http://127.0.0.2:9002")
    assert "names edge/eu/e2 at http://127.0.0.1:9002, not this record" in unadmitted(rogue, ops)
    assert unadmitted(admitted(op, e2, expires=time.time() - 1), ops) == "its admission has expired"
    assert unadmitted(dataclasses.replace(e2, extra={"admission": {"role": "edge"}}), ops) == "carries no admission"


def test_kdn_node_admit_and_a_node_that_checks_its_own_at_start(tmp_path, capsys):
    from kdn.edge.app import EdgeConfig

    Signer.generate(tmp_path / "op.key")
    url = "http://127.0.0.1:9301"
    argv = ["node", "admit", "--operator-key", str(tmp_path / "op.key"), "--role", "edge", "--region", "eu",
            "--node-id", "e1", "--url", url, "--valid", "30d", "--out", str(tmp_path / "e1.adm")]
    assert cli.main(argv) == 0
    adm = Admission.from_dict(json.loads((tmp_path / "e1.adm").read_text()))
    assert adm.sig and 29 * 86400 < adm.expires - time.time() <= 30 * 86400 + 1
    cfg = EdgeConfig(region="eu", node_id="e1", url=url, admission=str(tmp_path / "e1.adm"))
    assert cfg.record_extra("edge", "eu")["admission"] == adm.to_dict()
    with pytest.raises(InvalidInput, match="not this node"):  # the admission of another node
        EdgeConfig(region="eu", node_id="e9", url=url, admission=str(tmp_path / "e1.adm")).record_extra("edge", "eu")
    (tmp_path / "bad.adm").write_text("{}")
    with pytest.raises(InvalidInput, match="is not an admission"):
        EdgeConfig(region="eu", node_id="e1", url=url, admission=str(tmp_path / "bad.adm")).record_extra("edge", "eu")
    assert cli.main(["node", "admit", "--operator-key", str(tmp_path / "op.key"), "--role", "edge", "--region", "eu",
                     "--node-id", "e1", "--url", url, "--valid", "0s"]) != 0


async def test_client_from_registry_leaves_out_unadmitted_nodes(tmp_path):
    op = Signer.generate(tmp_path / "op.key")
    nodes = {
        "e1": admitted(op, NodeRecord(role="edge", region="eu", node_id="e1", url="http://127.0.0.1:9101")),
        "rogue": NodeRecord(role="edge", region="eu", node_id="rogue", url="http://127.0.0.2:9102"),
        "o1": admitted(op, NodeRecord(role="origin", region="origin", node_id="o1", url="http://127.0.0.1:9100")),
        "o-rogue": NodeRecord(role="origin", region="origin", node_id="o-rogue", url="http://127.0.0.2:9100"),
    }
    async with EmbeddedRegistry(tmp_path / "reg.sqlite3") as reg:
        leases = [await reg.register_node(n, ttl=30) for n in nodes.values()]
        try:
            async with await KDNClient.from_registry(reg, "eu") as everyone:
                assert {s.url for s in everyone.routing.all} >= {"http://127.0.0.2:9102"}
            async with await KDNClient.from_registry(reg, "eu", admitted_by=[op.public]) as client:
                urls = {s.url for s in client.routing.all}
            assert urls == {"http://127.0.0.1:9101", "http://127.0.0.1:9100"}, urls
        finally:
            for lease in leases:
                await lease.close()


async def test_an_edge_that_requires_admission_leaves_a_rogue_peer_out_of_its_ring(tmp_path, etcd_url):
    """e1 and e2 are admitted, e3 is not (a node anyone with registry write access could add): e1
    (--require-admission) owns the ring with e2 only; e3 itself, and an edge that requires nothing, see all."""
    op = Signer.generate(tmp_path / "op.key")

    def prepare_admissions(c) -> None:
        for nid in ("e1", "e2"):
            cfg = c.configs[nid]
            (tmp_path / f"{nid}.adm").write_text(json.dumps(op.sign(Admission(
                "edge", "eu", nid, cfg.advertised_url, time.time() + 3600)).to_dict()))

    async with cluster(tmp_path, etcd_url, edges=()) as c:
        for nid in ("e1", "e2", "e3"):
            await c.start_edge(nid)  # first start: learn the ports
        prepare_admissions(c)
        for nid in ("e1", "e2", "e3"):
            await c.stop_edge(nid)
        for nid in ("e1", "e2"):
            c.configs[nid] = dataclasses.replace(c.configs[nid], admission=str(tmp_path / f"{nid}.adm"))
        c.configs["e1"] = dataclasses.replace(c.configs["e1"], require_admission=True,
                                              operator_keys=str(tmp_path / "op.key.pub"))
        for nid in ("e1", "e2", "e3"):
            await c.start_edge(nid)
        await c.edge("e3").membership.wait_for(lambda m: sorted(m.ring.nodes) == ["e1", "e2", "e3"], timeout=10)
        m1 = c.edge("e1").membership
        # e3's record reached e1 (counted as unadmitted) and stays out of its ring.
        await m1.wait_for(lambda m: sorted(m.ring.nodes) == ["e1", "e2"] and m.unadmitted >= 1, timeout=10)
        assert sorted(m1.ring.nodes) == ["e1", "e2"] and m1.unadmitted >= 1
        from edge_helpers import metric

        assert metric(c.edges["e1"], "kdn_edge_unadmitted_nodes") >= 1


async def test_an_expiring_admission_and_a_record_borrowing_my_id_are_left_out(tmp_path):
    """A node whose admission runs out while it stays up is dropped at the next check (a lease's keepalive
    rewrites nothing); a record of another region under this edge's own id is not this edge."""
    from kdn.edge.membership import Membership

    op = Signer.generate(tmp_path / "op.key")
    me = NodeRecord(role="edge", region="eu", node_id="e1", url="http://127.0.0.1:9401")
    soon = admitted(op, NodeRecord(role="edge", region="eu", node_id="e2", url="http://127.0.0.1:9402"),
                    expires=time.time() + 1.5)
    borrowed = NodeRecord(role="edge", region="us", node_id="e1", url="http://127.0.0.2:9401")  # not admitted
    async with EmbeddedRegistry(tmp_path / "reg.sqlite3") as reg:
        leases = [await reg.register_node(r, ttl=30) for r in (soon, borrowed)]
        m = Membership(reg, me, ttl=5, admitters=Verifier([op.public]), recheck_s=0.2)
        await m.start()
        try:
            await m.wait_for(lambda m: sorted(m.ring.nodes) == ["e1", "e2"], timeout=5)
            assert all(r.region == "eu" for r in m.nodes.values()) and "us" not in m.regions()
            await m.wait_for(lambda m: sorted(m.ring.nodes) == ["e1"], timeout=5)  # e2's admission ran out
            assert m.unadmitted >= 2
        finally:
            await m.close()
            for lease in leases:
                await lease.close()


@pytest.mark.parametrize("expires", [float("inf"), float("nan"), 0, -1.0, True, "tomorrow"])
def test_an_admission_expires_at_a_real_time(expires):
    with pytest.raises(InvalidInput, match="expires"):
        Admission("edge", "eu", "e1", "http://127.0.0.1:9001", expires)


def test_kdn_node_revoke_lists_an_admission_that_readers_then_refuse(tmp_path, capsys):
    """#28 item 11 (admission revocation): an admission was revoked only by its expiry or by dropping the operator
    key. ``kdn node revoke`` adds its id to the operator's list (a file, as the keys are: a registry writer
    cannot delete it); a reader given the list refuses that admission, and a new admission of the same node
    (another expiry, another id) is accepted again. The list is read again when the file changes."""
    from kdn.registry.signing import Admitters, admission_id

    op = Signer.generate(tmp_path / "op.key")
    e2 = NodeRecord(role="edge", region="eu", node_id="e2", url="http://127.0.0.1:9002")
    old, new = admitted(op, e2), admitted(op, e2, expires=time.time() + 7200)
    (tmp_path / "e2.adm").write_text(json.dumps(old.extra["admission"]))
    revoked = tmp_path / "revoked.txt"
    ops = Admitters([op.public], revoked=[])
    assert unadmitted(old, ops) is None
    assert cli.main(["node", "revoke", str(tmp_path / "e2.adm"), "--list", str(revoked)]) == 0
    assert cli.main(["node", "revoke", str(tmp_path / "e2.adm"), "--list", str(revoked)]) == 0  # idempotent
    lines = [ln for ln in revoked.read_text().splitlines() if ln.strip()]
    aid = admission_id(Admission.from_dict(old.extra["admission"]))
    assert len(lines) == 1 and lines[0].startswith(aid) and "edge eu/e2" in lines[0]
    ops = Admitters.from_files(tmp_path / "op.key.pub", revoked)
    assert unadmitted(old, ops) == f"its admission {aid[:16]} is revoked"
    assert unadmitted(new, ops) is None  # admitted again: a new admission
    # The list changes while the reader runs: read again; a list that turns unreadable keeps the last one.
    assert cli.main(["node", "revoke", "--id", admission_id(Admission.from_dict(new.extra["admission"])),
                     "--list", str(revoked)]) == 0
    assert ops.refresh() and unadmitted(new, ops) is not None
    revoked.write_text("not an id\n")
    assert not ops.refresh() and unadmitted(old, ops) is not None and unadmitted(new, ops) is not None
    with pytest.raises(InvalidInput, match="not an admission id"):
        Admitters([op.public], revoked=["abc"])
    assert cli.main(["node", "revoke", "--id", "xyz", "--list", str(tmp_path / "r2.txt")]) != 0
    assert not (tmp_path / "r2.txt").exists()


async def test_a_revoked_admission_drops_the_node_at_the_next_check(tmp_path):
    """A node whose admission the operator revokes while it stays up leaves the ring at the next recheck, as an
    expired one does."""
    from kdn.edge.membership import Membership
    from kdn.registry.signing import Admitters, admission_id

    op = Signer.generate(tmp_path / "op.key")
    me = NodeRecord(role="edge", region="eu", node_id="e1", url="http://127.0.0.1:9501")
    e2 = admitted(op, NodeRecord(role="edge", region="eu", node_id="e2", url="http://127.0.0.1:9502"))
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# nothing revoked yet\n")
    async with EmbeddedRegistry(tmp_path / "reg.sqlite3") as reg:
        lease = await reg.register_node(e2, ttl=30)
        m = Membership(reg, me, ttl=5, admitters=Admitters.from_files(tmp_path / "op.key.pub", revoked),
                       recheck_s=0.2)
        await m.start()
        try:
            await m.wait_for(lambda m: sorted(m.ring.nodes) == ["e1", "e2"], timeout=5)
            revoked.write_text(admission_id(Admission.from_dict(e2.extra["admission"])) + "\n")
            await m.wait_for(lambda m: sorted(m.ring.nodes) == ["e1"], timeout=5)
        finally:
            await m.close()
            await lease.close()


async def test_client_from_registry_leaves_out_a_revoked_node(tmp_path):
    from kdn.registry.signing import admission_id

    op = Signer.generate(tmp_path / "op.key")
    e1 = admitted(op, NodeRecord(role="edge", region="eu", node_id="e1", url="http://127.0.0.1:9601"))
    e2 = admitted(op, NodeRecord(role="edge", region="eu", node_id="e2", url="http://127.0.0.1:9602"))
    async with EmbeddedRegistry(tmp_path / "reg.sqlite3") as reg:
        leases = [await reg.register_node(n, ttl=30) for n in (e1, e2)]
        try:
            gone = [admission_id(Admission.from_dict(e2.extra["admission"]))]
            async with await KDNClient.from_registry(reg, "eu", admitted_by=[op.public],
                                                     revoked_admissions=gone) as client:
                assert {s.url for s in client.routing.all} == {"http://127.0.0.1:9601"}
            with pytest.raises(InvalidInput, match="admitted_by"):
                await KDNClient.from_registry(reg, "eu", revoked_admissions=gone)
        finally:
            for lease in leases:
                await lease.close()
