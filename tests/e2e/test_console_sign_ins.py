"""Console sign-ins (#51 item 7): one token's sign-ins cannot end another token's session, and one address's
sign-ins are rate limited.

The attack: the console kept one LRU of 1,024 sessions, so 1,050 sign-ins with any token (a ``read`` one) ended
the operator's session in about a second. Now each token holds at most ``MAX_SESSIONS_PER_TOKEN`` sessions (its
own oldest goes), at the memory bound the token holding the most gives one up, and each peer address may try
``SIGN_IN_BURST`` sign-ins at once, then one each ``SIGN_IN_EVERY`` seconds (429 past it). A real etcd and origin,
signed in to over HTTP with the form, from several loopback addresses (127.0.0.2 and up) as several hosts would.
"""

from __future__ import annotations

import asyncio

import aiohttp
from edge_helpers import EDGE_TOKEN, PUBLISH, cluster

from kdn.auth import Grant
from kdn.origin.console.sessions import (MAX_SESSIONS_PER_TOKEN, SESSIONS, SIGN_IN_BURST, SIGN_IN_EVERY, Sessions,
                                         SignIns)

FLOOD = 1050  # sign-ins with one read token: past the 1,024 sessions the console once kept in all


async def sign_in(url: str, token: str, peer: str = "127.0.0.1") -> tuple[int, str | None, aiohttp.ClientResponse]:
    """One sign-in from ``peer``: (status, the session cookie or None, the response, read)."""
    conn = aiohttp.TCPConnector(local_addr=(peer, 0))
    async with aiohttp.ClientSession(url, connector=conn, cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.post("/console/login", data={"token": token}, allow_redirects=False) as r:
            await r.read()
            cookie = r.cookies.get("kdn_console")
            return r.status, (cookie.value if cookie is not None else None), r


async def listing(url: str, sid: str) -> int:
    async with aiohttp.ClientSession(url, cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.get("/console", headers={"Cookie": f"kdn_console={sid}"}) as r:
            return r.status


async def flood(url: str, token: str, n: int, per_peer: int) -> list[str]:
    """``n`` sign-ins with ``token``, ``per_peer`` from each of 127.0.0.2, .3, ... (within each one's burst), in
    order per address and 8 addresses at a time; the session ids, in sign-in order per address."""
    peers = [f"127.0.0.{2 + i}" for i in range(-(-n // per_peer))]
    gate = asyncio.Semaphore(8)
    out: dict[str, list[str]] = {}

    async def one_peer(i: int, peer: str) -> None:
        async with gate:
            conn = aiohttp.TCPConnector(local_addr=(peer, 0))
            async with aiohttp.ClientSession(url, connector=conn, cookie_jar=aiohttp.DummyCookieJar()) as s:
                for _ in range(min(per_peer, n - i * per_peer)):
                    async with s.post("/console/login", data={"token": token}, allow_redirects=False) as r:
                        assert r.status == 303, (peer, r.status, await r.text())
                        out.setdefault(peer, []).append(r.cookies["kdn_console"].value)

    await asyncio.gather(*(one_peer(i, p) for i, p in enumerate(peers)))
    return [sid for p in peers for sid in out.get(p, [])]


async def test_a_flood_of_sign_ins_with_one_token_does_not_sign_out_another(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        url = c.origin_url()
        status, admin, _ = await sign_in(url, PUBLISH)  # the operator, admin *
        assert status == 303 and admin is not None
        first_status, first, _ = await sign_in(url, EDGE_TOKEN, "127.0.0.250")  # the flooder's first session
        assert first_status == 303 and first is not None
        sids = await flood(url, EDGE_TOKEN, FLOOD, per_peer=SIGN_IN_BURST - 5)
        assert len(sids) == FLOOD
        assert await listing(url, admin) == 200  # the operator is still signed in
        sessions = c.origin.app[SESSIONS]
        assert sessions.of_token(EDGE_TOKEN) == MAX_SESSIONS_PER_TOKEN and sessions.of_token(PUBLISH) == 1
        assert len(sessions) == MAX_SESSIONS_PER_TOKEN + 1
        assert await listing(url, first) == 401  # the flooder's own oldest went
        assert await listing(url, sids[-1]) == 200


async def test_sign_ins_from_one_address_are_rate_limited(tmp_path, etcd_url):
    async with cluster(tmp_path, etcd_url, edges=()) as c:
        url = c.origin_url()
        statuses = []
        for i in range(SIGN_IN_BURST):  # wrong tokens count as right ones do
            status, _, _ = await sign_in(url, "z" * 32 if i % 6 == 0 else EDGE_TOKEN, "127.0.0.3")
            statuses.append(status)
        assert set(statuses) == {303, 401}, statuses
        status, sid, r = await sign_in(url, PUBLISH, "127.0.0.3")  # even the right admin token: not now
        assert status == 429 and sid is None
        assert 1 <= int(r.headers["Retry-After"]) <= SIGN_IN_EVERY
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))) as s:
            async with s.post("/console/login", data={"token": PUBLISH}, allow_redirects=False) as r:
                assert r.status == 429 and "too many sign-ins from this address" in await r.text()
        # Another address is not held by this one's sign-ins.
        status, sid, _ = await sign_in(url, PUBLISH, "127.0.0.4")
        assert status == 303 and sid is not None and await listing(url, sid) == 200


def test_an_addresses_sign_ins_refill_and_the_table_stays_bounded():
    now = [0.0]
    limit = SignIns(burst=3, every=2.0, limit=4, clock=lambda: now[0])
    assert [limit.take("127.0.0.9") for _ in range(4)] == [0, 0, 0, 2.0]
    now[0] += 2.0
    assert limit.take("127.0.0.9") == 0 and limit.take("127.0.0.9") > 0
    # One IPv6 host holds a /64: its addresses share a bucket.
    assert [limit.take(f"2001:db8::{i}") for i in range(4)][-1] > 0
    for i in range(100):
        limit.take(f"127.1.0.{i}")  # (keys of the table only: nothing is sent anywhere)
    assert len(limit) == 4


def test_at_the_memory_bound_the_token_holding_the_most_sessions_gives_one_up():
    grant = Grant(frozenset({"read"}), frozenset({"*"}))
    s = Sessions(limit=10, per_token=6)
    mine = [s.open(grant, "honest-token-0001")[0] for _ in range(2)]
    for t in range(3):  # three flooders, 6 sessions each, against a bound of 10 in all
        for _ in range(6):
            s.open(grant, f"flood-token-{t:04d}")
    assert len(s) == 10
    assert all(s.get(sid) is not None for sid in mine)
    assert s.of_token("honest-token-0001") == 2
