"""Scheduled policies (``kdn policy set --at --tz --for``) on a stepped clock: a pin holds only inside its windows, a
push fills ahead of its window by the time its bytes need and holds what it filled until the window ends, and a bad
schedule is refused at ``kdn policy set`` and in the console form with one line.

The engine's clock is stepped by the test: no real minutes pass. Each wait is on the engine's own state
(``wait_applied``): the engine wakes by itself when a step crosses a window's edge. The first tests run the policy
engine against both registries; the last runs etcd, an origin, two edges, the CLI and the console for real.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from datetime import datetime
from zoneinfo import ZoneInfo

import aiohttp
import pytest
from blake3 import blake3

sys.path.insert(0, os.path.dirname(__file__))

from edge_helpers import PUBLISH, cluster, get, metric, publish  # noqa: E402

from kdn import cli  # noqa: E402
from kdn.edge.memory import MemoryTier  # noqa: E402
from kdn.edge.policies import PolicyEngine  # noqa: E402
from kdn.edge.policy_warms import LEAD_FLOOR_S, LEAD_MARGIN  # noqa: E402
from kdn.edge.tiers import EntryMeta  # noqa: E402
from kdn.registry import Manifest, ObjectRecord, Policy  # noqa: E402
from kdn.registry.records import Encoding  # noqa: E402
from kdn.registry.schedule import Schedule  # noqa: E402
from kdn.service import REGISTRY  # noqa: E402

BERLIN, UTC = ZoneInfo("Europe/Berlin"), ZoneInfo("UTC")
HOUR = 3600.0


def t(zone: ZoneInfo, *when: int) -> float:
    return datetime(*when, tzinfo=zone).timestamp()


class SteppedClock:
    """Wall time that moves only when the test says so (``to``); a sleeper wakes at every step and looks again."""

    def __init__(self, now: float) -> None:
        self.t = now
        self._moved = asyncio.Event()

    def now(self) -> float:
        return self.t

    def to(self, now: float) -> None:
        self.t = now
        self._moved.set()
        self._moved = asyncio.Event()

    async def sleep_until(self, t: float) -> None:
        if self.t < t:
            await self._moved.wait()


class Warms:
    """A warm callback that records each run."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str, dict]] = []

    async def __call__(self, addresses: list[str], namespace: str, **push) -> None:
        self.calls.append((addresses, namespace, push))


def addr(seed: str) -> str:
    return blake3(seed.encode()).hexdigest()


MID = addr("model")


def manifest(name: str, n: int) -> Manifest:
    chain = [addr(f"public/{name}/{i}") for i in range(n)]
    return Manifest("public", name, MID, chain, n * 4, 4, list(range(n * 4)), None, [], 1700000000.0)


def records(m: Manifest, size: int) -> list[ObjectRecord]:
    """Object records for ``m``'s chain, each object ``size`` bytes raw and half that in zstd."""
    out, parent = [], None
    for i, a in enumerate(m.addresses):
        encs = {"raw": Encoding("raw", size, addr(f"{a}/raw")), "zstd": Encoding("zstd", size // 2, addr(f"{a}/z"))}
        out.append(ObjectRecord(a, MID, "public", "kv", i * 4, i * 4 + 4, parent, False, encs, "o"))
        parent = a
    return out


async def cache(tier, m: Manifest) -> None:
    for a in m.addresses:
        data = a.encode() * 4
        assert await tier.put((a, "raw"), data, EntryMeta(len(data), blake3(data).hexdigest(), "public", m.ref))


def pinned(tier) -> set[str]:
    return {k[0] for k, meta in tier.entries() if meta.pinned}


@pytest.fixture
async def engines(registry):
    """``make(clock, ...)``: a policy engine for region ``eu`` on ``registry``, started and ready; closed after."""
    made: list[PolicyEngine] = []

    async def make(clock: SteppedClock, tiers, **kw) -> PolicyEngine:
        e = PolicyEngine(registry, "eu", tiers, retry_s=0.05, clock=clock, **kw)
        made.append(e)
        await e.start()
        await e.wait_applied(lambda e: e.ready)
        return e

    yield make
    for e in made:
        await e.close()


async def test_a_scheduled_pin_holds_inside_its_windows_only(registry, engines):
    clock = SteppedClock(t(BERLIN, 2025, 3, 28, 7, 0))  # a Friday, two days before the clocks move forward
    mem = MemoryTier(1 << 20)
    eng = await engines(clock, [mem])
    docs = manifest("docs", 3)
    await registry.put_manifest(docs)
    await cache(mem, docs)
    await registry.put_policy(Policy("mornings", "pin", manifest="public/docs",
                                     schedule=Schedule("0 8 * * 1-5", "Europe/Berlin", 2 * HOUR)))
    await eng.wait_applied(lambda e: "mornings" in e.phases)
    ph = eng.phases["mornings"]
    assert not ph.held and ph.window.start == ph.until == t(BERLIN, 2025, 3, 28, 8, 0)
    assert not eng.pinned_addresses and not pinned(mem) and eng.stats.active == {"pin": 1}

    clock.to(t(BERLIN, 2025, 3, 28, 7, 59))  # not yet: nothing to apply
    clock.to(t(BERLIN, 2025, 3, 28, 8, 0))  # the window opens: the engine wakes by itself
    await eng.wait_applied(lambda e: e.pinned_addresses == set(docs.addresses))
    assert pinned(mem) == set(docs.addresses) and eng.phases["mornings"].until == t(BERLIN, 2025, 3, 28, 10, 0)

    clock.to(t(BERLIN, 2025, 3, 28, 10, 0))  # closed: released, the next window is Monday (after the change)
    await eng.wait_applied(lambda e: not e.pinned_addresses)
    assert not pinned(mem)
    monday = t(BERLIN, 2025, 3, 31, 8, 0)
    assert eng.phases["mornings"].window.start == monday == t(UTC, 2025, 3, 31, 6, 0)  # 08:00 CEST

    clock.to(t(BERLIN, 2025, 3, 29, 8, 30))  # Saturday morning: still nothing
    await registry.put_policy(Policy("nudge", "ttl", namespace="other", ttl_s=60))  # an apply at this time
    await eng.wait_applied(lambda e: "nudge" in e.active)
    assert not eng.pinned_addresses

    clock.to(monday + 1)
    await eng.wait_applied(lambda e: e.pinned_addresses == set(docs.addresses))
    assert await registry.delete_policy("mornings")  # removed mid-window: released at once, nothing scheduled
    await eng.wait_applied(lambda e: not e.pinned_addresses and not e.phases)


async def test_a_scheduled_push_runs_ahead_of_its_window_by_the_time_its_bytes_need(registry, engines):
    clock = SteppedClock(t(UTC, 2025, 6, 2, 6, 0))
    warms = Warms()
    mem = MemoryTier(1 << 20)
    # This edge's fills: 1,000 bytes a second. Three objects of 100,000 bytes at their largest encoding: 300 s.
    eng = await engines(clock, [mem], warm=warms, link=lambda n: n / 1000)
    ledger = manifest("ledger", 3)
    await registry.put_objects(records(ledger, 100_000))
    await registry.put_manifest(ledger)
    await registry.put_policy(Policy("ledger-push", "push", manifest="public/ledger",
                                     schedule=Schedule("0 8 * * *", "UTC", HOUR)))
    await eng.wait_applied(lambda e: "ledger-push" in e.phases)
    opens, lead = t(UTC, 2025, 6, 2, 8, 0), LEAD_MARGIN * 300
    ph = eng.phases["ledger-push"]
    assert ph.lead_s == lead and ph.until == opens - lead and not ph.held

    clock.to(opens - lead - 1)  # a second too early: nothing runs, nothing is pinned
    await registry.put_policy(Policy("nudge", "ttl", namespace="other", ttl_s=60))
    await eng.wait_applied(lambda e: "nudge" in e.active)
    assert warms.calls == [] and not eng.pinned_addresses

    clock.to(opens - lead + 1)  # its lead has begun: the push runs, and what it fills stays until the window ends
    await eng.wait_applied(lambda e: e.stats.warm_done == 1)
    assert warms.calls == [(ledger.addresses, "public", {"rate": None, "policy": "ledger-push"})]
    assert eng.pinned_addresses == set(ledger.addresses) and eng.stats.scheduled_runs == 1
    await cache(mem, ledger)  # (what the run would have filled)
    assert pinned(mem) == set(ledger.addresses)

    clock.to(opens + 30 * 60)  # inside the window: held, not run again
    await registry.put_policy(Policy("nudge", "ttl", namespace="other", ttl_s=120))
    await eng.wait_applied(lambda e: e.active["nudge"].ttl_s == 120)
    assert len(warms.calls) == 1 and pinned(mem) == set(ledger.addresses)

    clock.to(opens + HOUR)  # the window is over: released
    await eng.wait_applied(lambda e: not e.pinned_addresses)
    assert not pinned(mem) and eng.phases["ledger-push"].window.start == opens + 24 * HOUR

    clock.to(opens + 24 * HOUR - lead)  # the next day's lead: it runs again, once per window
    await eng.wait_applied(lambda e: e.stats.warm_done == 2)
    assert len(warms.calls) == 2 and eng.pinned_addresses == set(ledger.addresses)


async def test_a_pushs_own_rate_and_an_unmeasured_link_lengthen_its_lead(registry, engines):
    clock = SteppedClock(t(UTC, 2025, 6, 2, 0, 0))
    eng = await engines(clock, [MemoryTier(1 << 20)], warm=Warms())  # no link measured: the assumed speed
    big = manifest("big", 4)
    await registry.put_objects(records(big, 250_000_000))  # 1 GB: 80 s at 100 Mbit/s
    await registry.put_manifest(big)
    await registry.put_policy(Policy("big-push", "push", manifest="public/big",
                                     schedule=Schedule("0 8 * * *", "UTC", HOUR)))
    await registry.put_policy(Policy("big-slow", "push", manifest="public/big", extra={"rate_bytes": 1_000_000},
                                     schedule=Schedule("0 8 * * *", "UTC", HOUR)))
    small = manifest("small", 1)  # no records anywhere: a guess, and at least the floor
    await registry.put_manifest(small)
    await registry.put_policy(Policy("small-push", "push", manifest="public/small",
                                     schedule=Schedule("0 8 * * *", "UTC", HOUR)))
    await eng.wait_applied(lambda e: len(e.phases) == 3)
    assert eng.phases["big-push"].lead_s == pytest.approx(LEAD_MARGIN * 1e9 / 12.5e6)
    assert eng.phases["big-slow"].lead_s == pytest.approx(LEAD_MARGIN * 1e9 / 1e6)  # its rate is the slower
    assert eng.phases["small-push"].lead_s == LEAD_FLOOR_S


async def test_a_schedule_on_a_ttl_in_the_registry_is_skipped_as_invalid(registry, engines):
    eng = await engines(SteppedClock(t(UTC, 2025, 6, 2, 0, 0)), [MemoryTier(1 << 20)])
    await registry.put_policy(Policy("odd", "ttl", ttl_s=60, schedule=Schedule("0 8 * * *", "UTC", HOUR)))
    await eng.wait_applied(lambda e: "policies/odd" in e.invalid)
    assert "a schedule goes with pin, warm or push" in eng.invalid["policies/odd"] and not eng.phases


@pytest.mark.parametrize("args, words", [
    (["--at", "0 8 * *", "--tz", "UTC", "--for", "1h"], "schedule '0 8 * *': 4 fields; a schedule has 5"),
    (["--at", "0 25 * * *", "--tz", "UTC", "--for", "1h"], "schedule '0 25 * * *': hour 25 is out of range 0-23"),
    (["--at", "0 8 * * 1-5", "--tz", "Europe/Berln", "--for", "2h"], "unknown time zone 'Europe/Berln'"),
    (["--at", "0 8 * * 1-5", "--for", "2h"], "--at needs --tz"),
    (["--at", "0 8 * * 1-5", "--tz", "UTC"], "--at needs --for"),
    (["--at", "0 8,9 * * *", "--tz", "UTC", "--for", "2h"], "longer than the shortest gap between its starts (1h)"),
])
def test_kdn_policy_set_refuses_a_bad_schedule_with_one_line(args, words, capsys, tmp_path):
    argv = ["policy", "set", "p", "--pin", "public/doc", *args, "--registry", f"file:{tmp_path / 'r.sqlite3'}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdn: error: ") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.sqlite3").exists()  # refused before the registry was opened


TEXT = ("The clerk files the quarter's ledgers each morning at eight and reads them again before noon. " * 24)[:2000]


class Console:
    """A signed-in browser on the origin's console: its cookie and the CSRF token of the page it lands on."""

    def __init__(self, url: str) -> None:
        self.s = aiohttp.ClientSession(url, cookie_jar=aiohttp.CookieJar(unsafe=True))  # (cookies for an IP)
        self.csrf = ""

    async def sign_in(self, token: str) -> None:
        async with self.s.post("/console/login", data={"token": token}, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        self.csrf = re.search(r'name="csrf" value="([^"]+)"', await self.page("/console")).group(1)

    async def page(self, path: str) -> str:
        async with self.s.get(path) as r:
            assert r.status == 200, await r.text()
            return await r.text()

    async def post(self, **form: str) -> tuple[int, str]:
        async with self.s.post("/console/policies", data={**form, "csrf": self.csrf}, allow_redirects=False) as r:
            return r.status, await r.text()


async def test_edges_follow_scheduled_policies_set_by_the_cli_and_the_console(tmp_path, etcd_url, capsys):
    clock = SteppedClock(t(BERLIN, 2025, 6, 2, 7, 0))  # a Monday
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        await c.start_edge("e1", "eu")
        await c.start_edge("u1", "us")
        eu, us = c.edge("e1"), c.edge("u1")
        eu.policies.clock = us.policies.clock = clock  # (no schedule is set yet: no timer runs on the old clock)
        addrs = (await publish(c, TEXT, name="ledger"))["addresses"]
        for a in addrs:  # read through eu: its one edge holds every object
            status, _, _ = await get(c.edge_url("e1"), a)
            assert status == 200

        # A pin in eu on weekday mornings, and a push to us ahead of the same windows.
        for argv in (["policy", "set", "ledger-mornings", "--pin", "public/ledger", "--region", "eu"],
                     ["policy", "set", "ledger-push", "--push", "public/ledger", "--to", "us"]):
            argv += ["--at", "0 8 * * 1-5", "--tz", "Europe/Berlin", "--for", "2h", "--registry", c.registry]
            assert await asyncio.to_thread(cli.main, argv) == 0
        out = capsys.readouterr().out
        # (the CLI reads this machine's clock, not the test's: the window it names is open now or next)
        assert re.search(r"0 8 \* \* 1-5 Europe/Berlin for 2h \((next window|open now, since) "
                         r"\d{4}-\d\d-\d\d 08:00 Europe/Berlin\)", out), out
        assert await asyncio.to_thread(cli.main, ["policy", "ls", "--registry", c.registry]) == 0
        ls = capsys.readouterr().out.splitlines()
        assert ls[0].split() == ["NAME", "KIND", "REGION", "SCOPE", "SCHEDULE", "SETTING"]
        assert all("0 8 * * 1-5 Europe/Berlin for 2h" in line for line in ls[1:]), ls

        await eu.policies.wait_applied(lambda e: "ledger-mornings" in e.phases)
        await us.policies.wait_applied(lambda e: "ledger-push" in e.phases)
        opens, lead = t(BERLIN, 2025, 6, 2, 8, 0), us.policies.phases["ledger-push"].lead_s
        assert LEAD_FLOOR_S <= lead < HOUR and not eu.policies.pinned_addresses
        assert not any(meta.pinned for _, meta in eu.memory.entries())

        clock.to(opens - lead - 1)  # before the push's lead: us has nothing yet
        await c.origin.app[REGISTRY].put_policy(Policy("nudge", "ttl", namespace="other", ttl_s=60))
        await us.policies.wait_applied(lambda e: "nudge" in e.active)
        assert us.policies.stats.warm_runs == 0 and not any(us.memory.keys())

        clock.to(opens - lead + 1)  # the push runs ahead of the window, and us holds it all before 08:00
        await us.policies.wait_applied(lambda e: e.stats.warm_done == 1)
        filled = metric(c.edges["u1"], "kdn_edge_pushed_objects_total", policy="ledger-push", outcome="filled")
        assert filled == len(addrs)
        assert {k[0] for k, meta in us.memory.entries() if meta.pinned} == set(addrs)
        assert clock.now() < opens and not eu.policies.pinned_addresses  # eu's pin waits for the window itself

        clock.to(opens)
        await eu.policies.wait_applied(lambda e: e.pinned_addresses == set(addrs))
        assert {k[0] for k, meta in eu.memory.entries() if meta.pinned} == set(addrs)

        clock.to(opens + 2 * HOUR)  # the window ends: both release
        await eu.policies.wait_applied(lambda e: not e.pinned_addresses)
        await us.policies.wait_applied(lambda e: not e.pinned_addresses)
        assert not any(meta.pinned for _, meta in eu.memory.entries())
        assert not any(meta.pinned for _, meta in us.memory.entries())

        # The console: a bad schedule is refused with the same line as the CLI's; a good one is set and shown.
        console = Console(c.origin_url())
        try:
            await console.sign_in(PUBLISH)
            form = {"op": "set", "kind": "pin", "manifest": "public/ledger", "name": "console-pin"}
            for bad, words in [({"at": "0 25 * * *", "tz": "UTC", "for": "1h"}, "hour 25 is out of range 0-23"),
                               ({"at": "0 8 * * *", "for": "1h"}, "--at needs --tz"),
                               ({"at": "0 8 * * *", "tz": "Mars/Olympus", "for": "1h"}, "unknown time zone")]:
                status, page = await console.post(**form, **bad)
                assert status == 400 and words in page, (bad, status, page)
            status, _ = await console.post(**form, at="30 7 * * 1-5", tz="UTC", **{"for": "90m"})
            assert status == 303
            mpage = await console.page("/console/manifests/public/ledger")
            row = mpage.split('data-policy="console-pin"', 1)[1].split("</tr>", 1)[0]
            assert '<td class="schedule">30 7 * * 1-5 UTC for 1h30m</td>' in row, row
            assert 'name="at"' in mpage and 'name="tz"' in mpage and 'name="for"' in mpage
        finally:
            await console.s.close()
        await eu.policies.wait_applied(lambda e: "console-pin" in e.phases)
        assert eu.policies.policies["console-pin"].schedule == Schedule("30 7 * * 1-5", "UTC", 5400.0)


def test_the_lead_rule_and_the_examples_operations_md_gives_are_the_codes():
    import shlex
    from pathlib import Path

    from kdn.cli import build_parser
    from kdn.edge.policy_warms import ASSUMED_BPS, ASSUMED_TOKEN_BYTES
    from kdn.registry.policy_records import policy_from_options

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    text = " ".join(doc.split())
    assert "times 1.5, and never less than 60 s" in text and (LEAD_MARGIN, LEAD_FLOOR_S) == (1.5, 60.0)
    assert "an assumed 100 Mbit/s" in text and ASSUMED_BPS * 8 == 100e6
    assert "at 128 KiB a token" in text and ASSUMED_TOKEN_BYTES == 128 << 10
    examples = [line for line in doc.splitlines() if line.startswith("kdn policy set") and "--at" in line]
    assert len(examples) == 2
    for line in examples:
        a = build_parser().parse_args(shlex.split(line)[1:])
        p = policy_from_options(a.name, pin=a.pin, warm=a.warm, push=a.push, to=a.to, at=a.at, tz=a.tz,
                                window=a.window)
        assert p.schedule is not None, line
