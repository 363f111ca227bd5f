"""Operator policies applied live from the registry (both implementations) to real memory and disk tiers.

Every wait is on the engine's own state (``wait_applied``); no sleeps.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from blake3 import blake3

from kdn.edge.disk import DiskTier
from kdn.edge.memory import MemoryTier
from kdn.edge.policies import PolicyEngine
from kdn.edge.tiers import EntryMeta
from kdn.registry import Manifest, Policy


def addr(seed: str) -> str:
    return blake3(seed.encode()).hexdigest()


MID = addr("model")


def manifest(name: str, n: int, ns: str = "public", *, tag: str = "", standalone: int = 0) -> Manifest:
    chain = [addr(f"{ns}/{name}{tag}/{i}") for i in range(n)]
    alone = [addr(f"{ns}/{name}{tag}/alone/{i}") for i in range(standalone)]
    return Manifest(ns, name, MID, chain, n * 4, 4, list(range(n * 4)), None, alone, 1700000000.0)


def every(m: Manifest) -> set[str]:
    return set(m.addresses) | set(m.standalone)


async def put(tier, address: str, size: int = 1_000, ns: str = "public", manifest: str | None = None) -> bool:
    data = (address.encode() * (size // 64 + 1))[:size]
    return await tier.put((address, "raw"), data, EntryMeta(size, blake3(data).hexdigest(), ns, manifest))


def meta_of(tier, address: str) -> EntryMeta:
    return dict(tier.entries())[(address, "raw")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Warms:
    """A warm callback that records its calls; fails for namespaces in ``fail``."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.push_args: list[dict] = []  # (a push's rate= and policy=)
        self.fail: set[str] = set()

    async def __call__(self, addresses: list[str], namespace: str, **push) -> None:
        self.calls.append((addresses, namespace))
        self.push_args.append(push)
        if namespace in self.fail:
            raise ConnectionError("origin unreachable")


@pytest.fixture
async def edge(registry, registry_factory, tmp_path):
    """An engine for region ``eu`` over a memory tier (10 kB) and a disk tier (20 kB); ``edge.writer`` is another registry handle."""

    class Edge:
        clock = Clock()
        mem = MemoryTier(10_000, clock=clock)
        disk = DiskTier(tmp_path / "disk", 20_000, fsync=False, clock=clock)
        warms = Warms()
        writer = registry_factory()
        engine: PolicyEngine

        async def start(self) -> PolicyEngine:
            self.engine = PolicyEngine(registry, "eu", [self.mem, self.disk], warm=self.warms, retry_s=0.05)
            await self.engine.start()
            await self.engine.wait_applied(lambda e: e.ready)
            return self.engine

    e = Edge()
    yield e
    if hasattr(e, "engine"):
        await e.engine.close()


async def test_pin_keeps_a_manifest_through_pressure_and_pins_later_inserts(edge):
    eng = await edge.start()
    docs = manifest("docs", 3, standalone=1)
    await edge.writer.put_manifest(docs)
    a0, a1, a2 = docs.addresses
    assert await put(edge.mem, a0) and await put(edge.disk, a0)  # cached before the pin
    await edge.writer.put_policy(Policy("pin-docs", "pin", region="eu", manifest="public/docs"))
    await eng.wait_applied(lambda e: e.pinned_addresses == every(docs))
    assert meta_of(edge.mem, a0).pinned and meta_of(edge.disk, a0).pinned
    assert await put(edge.mem, a1) and await put(edge.mem, docs.standalone[0])  # inserted after the pin
    assert meta_of(edge.mem, a1).pinned and meta_of(edge.mem, docs.standalone[0]).pinned

    for i in range(40):  # 40 kB through a 10 kB tier
        assert await put(edge.mem, addr(f"filler/{i}"))
    assert {a0, a1, docs.standalone[0]} <= {k[0] for k in edge.mem.keys()}
    assert edge.mem.stats.evictions["capacity"] > 0
    assert eng.stats.active == {"pin": 1}

    assert await edge.writer.delete_policy("pin-docs")
    await eng.wait_applied(lambda e: not e.pinned_addresses and not e.active)
    assert not any(m.pinned for _, m in edge.mem.entries()) and not meta_of(edge.disk, a0).pinned
    for i in range(40, 60):
        assert await put(edge.mem, addr(f"filler/{i}"))
    assert not edge.mem.contains((a0, "raw"))  # unpinned: evicted like anything else


async def test_pin_for_another_region_does_nothing_here(edge):
    eng = await edge.start()
    here, there = manifest("here", 2), manifest("there", 2)
    await edge.writer.put_manifest(here)
    await edge.writer.put_manifest(there)
    for a in [*here.addresses, *there.addresses]:
        await put(edge.mem, a)
    await edge.writer.put_policy(Policy("pin-us", "pin", region="us", manifest="public/there"))
    await edge.writer.put_policy(Policy("pin-everywhere", "pin", manifest="public/here"))  # region None: every edge
    await eng.wait_applied(lambda e: {"pin-us", "pin-everywhere"} <= e.policies.keys() and "pin-everywhere" in e.active)
    assert "pin-us" not in eng.active
    assert eng.pinned_addresses == every(here)
    assert [a for a in there.addresses if meta_of(edge.mem, a).pinned] == []
    # Moving the policy to this region brings it in force.
    await edge.writer.put_policy(Policy("pin-us", "pin", region="eu", manifest="public/there"))
    await eng.wait_applied(lambda e: e.pinned_addresses == every(here) | every(there))
    assert all(meta_of(edge.mem, a).pinned for a in there.addresses)


async def test_ttl_sets_expiry_and_expire_drops_the_entries(edge):
    docs = manifest("docs", 2)
    await edge.writer.put_manifest(docs)
    # Set before the engine starts: they come in its first snapshot.
    await edge.writer.put_policy(Policy("ttl-news", "ttl", namespace="news", ttl_s=60))
    await edge.writer.put_policy(Policy("ttl-all", "ttl", region="eu", ttl_s=3600))
    await edge.writer.put_policy(Policy("ttl-docs", "ttl", manifest="public/docs", ttl_s=10))
    await edge.writer.put_policy(Policy("ttl-us", "ttl", region="us", ttl_s=1))
    news, plain = addr("news/1"), addr("plain/1")
    t0 = edge.clock.now
    await put(edge.mem, news, ns="news")
    await put(edge.disk, news, ns="news")
    await put(edge.mem, plain)
    eng = await edge.start()
    assert eng.stats.active == {"ttl": 3}
    await put(edge.mem, docs.addresses[0])  # matched by address
    await put(edge.mem, addr("other-doc"), manifest="public/docs")  # matched by the manifest it was inserted for
    assert meta_of(edge.mem, news).expires_at == t0 + 60  # the smallest matching TTL wins
    assert meta_of(edge.disk, news).expires_at == t0 + 60
    assert meta_of(edge.mem, plain).expires_at == t0 + 3600
    assert meta_of(edge.mem, docs.addresses[0]).expires_at == t0 + 10
    assert meta_of(edge.mem, addr("other-doc")).expires_at == t0 + 10

    edge.clock.now = t0 + 61
    assert await edge.mem.expire() == 3 and await edge.disk.expire() == 1
    assert edge.mem.keys() == [(plain, "raw")] and edge.disk.keys() == []

    # A pin beats a TTL.
    await edge.writer.put_policy(Policy("pin-docs", "pin", manifest="public/docs"))
    await eng.wait_applied(lambda e: e.pinned_addresses == every(docs))
    await put(edge.mem, docs.addresses[1])
    edge.clock.now += 100
    await edge.mem.expire()
    assert edge.mem.contains((docs.addresses[1], "raw"))


async def test_quota_keeps_one_tenant_from_evicting_another(edge):
    eng = await edge.start()
    for tier in (edge.mem, edge.disk):
        for i in range(5):
            assert await put(tier, addr(f"b/{i}"), ns="tenant-b")
    await edge.writer.put_policy(Policy("quota-a", "quota", namespace="tenant-a", quota_bytes=4_000))
    await edge.writer.put_policy(Policy("quota-a-eu", "quota", region="eu", namespace="tenant-a", quota_bytes=3_000))
    await eng.wait_applied(lambda e: e.stats.active == {"quota": 2})
    b_keys = {(addr(f"b/{i}"), "raw") for i in range(5)}
    for tier in (edge.mem, edge.disk):
        for i in range(30):
            assert await put(tier, addr(f"a/{i}"), ns="tenant-a")
            a_used = sum(m.size for _, m in tier.entries() if m.namespace == "tenant-a")
            assert a_used <= 3_000  # the smaller of the two quotas
        assert b_keys <= set(tier.keys()), tier.name
    # Lifting the quota: tenant-a may now grow, and tenant-b's data becomes evictable again.
    await edge.writer.delete_policy("quota-a")
    await edge.writer.delete_policy("quota-a-eu")
    await eng.wait_applied(lambda e: not e.active)
    for i in range(30, 45):
        assert await put(edge.mem, addr(f"a/{i}"), ns="tenant-a")
    assert sum(m.size for _, m in edge.mem.entries() if m.namespace == "tenant-a") > 3_000


async def test_warm_runs_once_per_policy_and_manifest_content(edge):
    eng = await edge.start()
    m1, m2 = manifest("guide", 3, standalone=1), manifest("faq", 2, ns="tenant-a")
    await edge.writer.put_manifest(m1)
    await edge.writer.put_manifest(m2)
    warm = Policy("warm-guide", "warm", region="eu", manifest="public/guide")
    await edge.writer.put_policy(warm)
    await eng.wait_applied(lambda e: e.stats.warm_done == 1)
    assert edge.warms.calls == [([*m1.addresses, *m1.standalone], "public")]

    # The same record again, then a marker: the marker being applied proves the re-put was seen.
    await edge.writer.put_policy(warm)
    await edge.writer.put_policy(Policy("marker", "ttl", ttl_s=1e9))
    await eng.wait_applied(lambda e: "marker" in e.active)
    assert len(edge.warms.calls) == 1 and eng.stats.warm_runs == 1

    # The policy now names another manifest: warm again.
    await edge.writer.put_policy(Policy("warm-guide", "warm", region="eu", manifest="tenant-a/faq"))
    await eng.wait_applied(lambda e: e.stats.warm_done == 2)
    assert edge.warms.calls[1] == (m2.addresses, "tenant-a")

    # The manifest is re-published with other content: warm again.
    m2b = manifest("faq", 4, ns="tenant-a", tag="-v2")
    await edge.writer.put_manifest(m2b)
    await eng.wait_applied(lambda e: e.stats.warm_done == 3)
    assert edge.warms.calls[2] == (m2b.addresses, "tenant-a")

    # The same record stamped again (what `kdn policy set` does): warm again.
    await edge.writer.put_policy(Policy("warm-guide", "warm", region="eu", manifest="tenant-a/faq", extra={"set_at": 2.0}))
    await eng.wait_applied(lambda e: e.stats.warm_done == 4)

    # A warm for another region never runs here.
    await edge.writer.put_policy(Policy("warm-us", "warm", region="us", manifest="public/guide"))
    await edge.writer.put_policy(Policy("marker", "ttl", ttl_s=2e9))
    await eng.wait_applied(lambda e: e.active.get("marker") is not None and e.active["marker"].ttl_s == 2e9)
    assert eng.stats.warm_runs == 4


async def test_warm_failure_is_counted_and_the_engine_goes_on(edge):
    eng = await edge.start()
    edge.warms.fail.add("tenant-x")
    await edge.writer.put_manifest(manifest("data", 2, ns="tenant-x"))
    await edge.writer.put_policy(Policy("warm-x", "warm", manifest="tenant-x/data"))
    await eng.wait_applied(lambda e: e.stats.warm_failures == 1)
    docs = manifest("docs", 2)
    await edge.writer.put_manifest(docs)
    await edge.writer.put_policy(Policy("pin-docs", "pin", manifest="public/docs"))
    await eng.wait_applied(lambda e: e.pinned_addresses == every(docs))
    assert eng.stats.warm_runs == 1 and eng.stats.warm_done == 0


async def test_policy_for_a_manifest_published_later_applies_when_it_appears(edge):
    eng = await edge.start()
    await edge.writer.put_policy(Policy("pin-later", "pin", manifest="public/later"))
    await edge.writer.put_policy(Policy("warm-later", "warm", manifest="public/later"))
    await eng.wait_applied(lambda e: len(e.active) == 2)
    assert eng.unresolved == {"public/later"} and not eng.pinned_addresses and edge.warms.calls == []
    later = manifest("later", 3)
    await put(edge.mem, later.addresses[0])
    assert not meta_of(edge.mem, later.addresses[0]).pinned

    await edge.writer.put_manifest(later)
    await eng.wait_applied(lambda e: e.pinned_addresses == every(later) and e.stats.warm_done == 1)
    assert meta_of(edge.mem, later.addresses[0]).pinned
    assert edge.warms.calls == [(later.addresses, "public")]
    assert not eng.unresolved

    # Unpublished: its addresses are no longer known, so its pins go.
    assert await edge.writer.delete_manifest("public", "later")
    await eng.wait_applied(lambda e: not e.pinned_addresses)
    assert eng.unresolved == {"public/later"} and not meta_of(edge.mem, later.addresses[0]).pinned


async def test_invalid_policy_records_are_skipped(edge):
    eng = await edge.start()
    w = edge.writer
    # Raw writes (past put_policy's own checks), as a buggy or foreign writer would leave them.
    await w._put(w._key("policies/junk"), b"\xc1 not msgpack")
    await w._put(w._key("policies/explode"), msgpack.packb({"name": "explode", "kind": "explode"}))
    await w._put(w._key("policies/renamed"), Policy("other-name", "ttl", ttl_s=5).pack())
    await w.put_policy(Policy("pin-nothing", "pin"))  # a valid record, but a pin needs a manifest
    await w.put_policy(Policy("quota-nobody", "quota", quota_bytes=5))  # ... and a quota a namespace
    await w.put_policy(Policy("good", "ttl", ttl_s=30))
    await eng.wait_applied(lambda e: "good" in e.active and len(e.invalid) == 5)
    assert set(eng.invalid) == {f"policies/{n}" for n in ("junk", "explode", "renamed", "pin-nothing", "quota-nobody")}
    assert set(eng.policies) == {"good"} and eng.stats.invalid >= 5
    await put(edge.mem, addr("x"))
    assert meta_of(edge.mem, addr("x")).expires_at == edge.clock.now + 30

    # Fixing a record brings it in; deleting a broken one forgets it.
    await w.put_policy(Policy("pin-nothing", "pin", manifest="public/none"))
    assert await w.delete_policy("junk")
    await eng.wait_applied(lambda e: "pin-nothing" in e.active and len(e.invalid) == 3)


async def test_close_cancels_a_warm_in_flight(edge):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(addresses, namespace):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    edge.warms = slow
    eng = await edge.start()
    await edge.writer.put_manifest(manifest("big", 2))
    await edge.writer.put_policy(Policy("warm-big", "warm", manifest="public/big"))
    await asyncio.wait_for(started.wait(), 10)
    await eng.close()
    assert cancelled.is_set() and eng.stats.warm_failures == 0


async def test_wait_applied_times_out_with_the_state_it_saw(edge):
    eng = await edge.start()
    with pytest.raises(TimeoutError, match="did not satisfy"):
        await eng.wait_applied(lambda e: "never" in e.active, timeout=0.05)


async def test_with_operator_keys_only_policies_an_operator_signed_apply(edge, tmp_path):
    """#28 item 11, policies: a registry writer without an operator key can neither pin nor expire what it
    likes. Unsigned, signed by another key, or changed after signing: skipped, counted, and named in
    ``invalid``; the operator's own policy applies."""
    import dataclasses

    from kdn.registry.signing import Signer, Verifier

    operator = Signer.generate(tmp_path / "operator.key")
    other = Signer.generate(tmp_path / "other.key")
    edge.engine = PolicyEngine(edge.writer, "eu", [edge.mem, edge.disk], warm=edge.warms, retry_s=0.05,
                               verifier=Verifier([operator.public]))
    await edge.engine.start()
    eng = edge.engine
    await eng.wait_applied(lambda e: e.ready)
    w = edge.writer
    await w.put_policy(Policy("unsigned", "ttl", ttl_s=1))
    await w.put_policy(other.sign(Policy("foreign", "ttl", ttl_s=2)))
    signed = operator.sign(Policy("tampered", "ttl", ttl_s=3600))
    await w.put_policy(dataclasses.replace(signed, ttl_s=1))  # the signature no longer covers the fields
    await w.put_policy(operator.sign(Policy("good", "ttl", ttl_s=30)))
    await eng.wait_applied(lambda e: "good" in e.active and len(e.invalid) == 3)
    assert set(eng.invalid) == {"policies/unsigned", "policies/foreign", "policies/tampered"}
    assert set(eng.policies) == {"good"}
    await put(edge.mem, addr("y"))
    assert meta_of(edge.mem, addr("y")).expires_at == edge.clock.now + 30


async def test_a_signed_policy_is_undone_only_by_a_signed_tombstone_and_not_by_a_replay(edge, tmp_path):
    """#28 item 11, signed policy deletion: with --operator-keys, a registry writer deleting a signed quota (one
    tenant may then push the others out), overwriting it with an unsigned record, or replaying an older signed
    version under its name once undid it. Now each leaves the newest signed policy in force; only the
    operator's signed tombstone (``kdn policy rm --operator-key``) removes it."""
    from kdn.registry.policy_records import tombstone
    from kdn.registry.signing import Signer, Verifier

    operator = Signer.generate(tmp_path / "operator.key")
    edge.engine = PolicyEngine(edge.writer, "eu", [edge.mem, edge.disk], warm=edge.warms, retry_s=0.05,
                               verifier=Verifier([operator.public]))
    await edge.engine.start()
    eng, w = edge.engine, edge.writer
    await eng.wait_applied(lambda e: e.ready)
    old = operator.sign(Policy("q", "quota", namespace="acme", quota_bytes=1 << 20, extra={"set_at": 100.0}))
    new = operator.sign(Policy("q", "quota", namespace="acme", quota_bytes=4 << 20, extra={"set_at": 200.0}))
    await w.put_policy(new)
    await eng.wait_applied(lambda e: e.active.get("q") == new)
    await w.delete_policy("q")  # a bare delete: the writer's, or an operator who forgot --operator-key
    await w.put_policy(Policy("marker", "ttl", ttl_s=1))  # (unsigned: skipped; its event comes after the delete)
    await eng.wait_applied(lambda e: "policies/marker" in e.invalid)
    assert eng.active.get("q") == new
    await w.put_policy(Policy("q", "quota", namespace="acme", quota_bytes=1))  # unsigned, over the signed one
    await eng.wait_applied(lambda e: "policies/q" in e.invalid)
    assert eng.active.get("q") == new
    await w.put_policy(old)  # signed, but older than the one in force: a replay
    await eng.wait_applied(lambda e: "replay" in e.invalid.get("policies/q", ""))
    assert eng.active.get("q") == new
    await w.put_policy(operator.sign(tombstone("q", 300.0)))
    await eng.wait_applied(lambda e: "q" not in e.active)
    await w.put_policy(new)  # the removed policy replayed: older than its tombstone
    await eng.wait_applied(lambda e: "replay" in e.invalid.get("policies/q", ""))
    assert "q" not in eng.active and "q" not in eng.policies
    # A signed policy set at the very instant of its tombstone (clocks tie): the removal wins.
    await w.put_policy(operator.sign(Policy("q", "quota", namespace="acme", quota_bytes=2, extra={"set_at": 300.0})))
    await eng.wait_applied(lambda e: "replay" in e.invalid.get("policies/q", "") and "300" in e.invalid["policies/q"])
    assert "q" not in eng.active


async def test_a_push_runs_in_the_regions_it_names_with_its_rate(edge):
    """#29 item 4: a push is a warm for named regions, paced, its progress counted per policy (by the edge)."""
    from kdn.registry.policy_records import validate_policy
    from kdn.errors import InvalidInput

    eng = await edge.start()
    m = manifest("guide", 2)
    await edge.writer.put_manifest(m)
    await edge.writer.put_policy(Policy("push-us", "push", manifest="public/guide", extra={"regions": ["us"]}))
    await edge.writer.put_policy(Policy("push-eu", "push", manifest="public/guide",
                                        extra={"regions": ["eu", "us"], "rate_bytes": 1 << 20}))
    await eng.wait_applied(lambda e: e.stats.warm_done == 1)
    assert set(eng.active) == {"push-eu"}  # this engine is eu's: push-us is not for it
    assert edge.warms.calls == [(m.addresses, "public")]
    assert edge.warms.push_args == [{"rate": 1 << 20, "policy": "push-eu"}]
    await edge.writer.put_policy(Policy("push-all", "push", manifest="public/guide"))  # no regions: every one
    await eng.wait_applied(lambda e: e.stats.warm_done == 2)
    assert edge.warms.push_args[1] == {"rate": None, "policy": "push-all"}
    for bad in ({"regions": "eu"}, {"regions": ["not a name!"]}, {"rate_bytes": 0}, {"rate_bytes": 1.5}):
        with pytest.raises(InvalidInput):
            validate_policy(Policy("x", "push", manifest="public/guide", extra=bad))
    with pytest.raises(InvalidInput, match="extra.regions"):
        validate_policy(Policy("x", "push", region="eu", manifest="public/guide"))
