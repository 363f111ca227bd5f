"""``Edge.open`` (edge/node.py): an edge is whole once made. Every part the read path, the handlers and the
registry views use exists from then on; the app's cleanup contexts only start and stop them (#31: before,
membership, the filler, the manifest-body reader and the policy engine were None until their context ran)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kdn.edge.config import EdgeConfig
from kdn.edge.metrics import EdgeMetrics
from kdn.edge.node import Edge
from kdn.registry import EmbeddedRegistry

OPTIONAL = {"admitters"}  # None unless --require-admission: the one part a configuration may leave out


async def test_an_opened_edge_has_every_part_and_its_disk_tier_reports_to_it(tmp_path):
    cfg = EdgeConfig(region="eu", node_id="e1", url="http://127.0.0.1:9301", disk=str(tmp_path / "disk"),
                     disk_budget=1 << 20, origin="http://127.0.0.1:9300", records="origin")
    async with EmbeddedRegistry(tmp_path / "reg.sqlite3") as reg:
        edge = await Edge.open(cfg, reg, EdgeMetrics(CollectorRegistry(), lambda: None))
        try:
            missing = sorted(k for k, v in vars(edge).items() if v is None and k not in OPTIONAL)
            assert not missing, f"parts still None after Edge.open: {missing}"
            assert edge.disk is not None and edge.tiers == [edge.memory, edge.disk]
            assert edge.disk.on_evict == edge._on_evict  # evictions of the disk tier reach the edge's accounting
            assert edge.filler.membership is edge.membership and edge.policies.upper_regions == frozenset()
            assert edge.records.source.origins is edge.bodies  # --records origin: read beside the blobs
            assert edge.origin_urls() == ["http://127.0.0.1:9300"]
        finally:
            edge.getter.close()
            await edge.session.close()
    plain = EdgeConfig(region="eu", node_id="e2", url="http://127.0.0.1:9302")
    async with EmbeddedRegistry(tmp_path / "reg2.sqlite3") as reg:
        edge = await Edge.open(plain, reg, EdgeMetrics(CollectorRegistry(), lambda: None))
        try:  # no disk configured: the memory tier alone, and no other part left out
            assert edge.disk is None and edge.tiers == [edge.memory]
            assert not sorted(k for k, v in vars(edge).items() if v is None and k not in OPTIONAL | {"disk"})
        finally:
            edge.getter.close()
            await edge.session.close()
