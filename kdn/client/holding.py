"""Where an object is cached now: each region's owner edge of it, asked whether it holds it.

The check ``kdn registry show ADDRESS`` makes (kdn/cli.py) and the operator console's "where it is cached"
(origin/console/edges.py): one HEAD per region to the edge that owns the address on that region's ring, which
never fills. Imports nothing heavy until it runs (aiohttp, the ring).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - the registry loads lazily
    from kdn.format.address import Address
    from kdn.registry import NodeRecord


READS_HEADER = "X-KDN-Reads"
"""An edge's HEAD of an object it holds, to a caller it tells the tier: the whole reads each tier answered from
its copy since it arrived there, ``memory=3, disk=1`` (edge/app.py)."""
READS_TIERS = ("memory", "disk")
MAX_READS_DIGITS = 12  # a count of more digits is junk, not a count: ignored (so a sum stays bounded)


def parse_reads(value: object) -> dict[str, int]:
    """``READS_HEADER``'s value, as the network gave it: each ``tier=count`` of a known tier with a count of
    at most ``MAX_READS_DIGITS`` ASCII digits, the first per tier. Anything else (a sign, junk, a huge
    number, an unknown tier, an over-long value) is left out: an empty answer, never an error."""
    out: dict[str, int] = {}
    if not isinstance(value, str) or len(value) > 128:
        return out
    for item in value.split(","):
        tier, eq, n = item.partition("=")
        tier, n = tier.strip(), n.strip()
        if eq and tier in READS_TIERS and tier not in out and n.isascii() and n.isdigit() \
                and len(n) <= MAX_READS_DIGITS:
            out[tier] = int(n)
    return out


def by_region(nodes: Iterable[NodeRecord]) -> dict[str, list[NodeRecord]]:
    """Edge records by region, each region's in node-id order."""
    out: dict[str, list[NodeRecord]] = {}
    for n in sorted(nodes, key=lambda n: (n.region, n.node_id)):
        out.setdefault(n.region, []).append(n)
    return out


async def regions_holding(edges: Iterable[NodeRecord], address: Address, token: str | None,
                          token_hosts: str | None, encodings: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per region: the edge that owns ``address`` on that region's ring (of ``edges``), and whether it holds it now.

    Asked with a HEAD, which never fills: with a token that reads every namespace (an edge's, an admin's, the
    console's probe token) it names the tier (``memory``, ``disk``) or says ``no``; without one an edge does not
    tell (what others read lately is cache state), and with the tier the reads each tier answered from its copy
    (``reads``: ``{tier: n}``, ``parse_reads``; empty where it does not tell). ``encodings``: the object's, asked in
    turn until one is held (an edge holds what its readers took: ``raw`` on a fast link, where a plain HEAD names
    the lossless preference); none: one plain HEAD. The URLs come from the registry, which a writer can fill with
    any host: the caller passes only the records it trusts (admitted ones, where admission is configured), and
    the token goes only to ``token_hosts`` (loopback by default, kdn.auth.TokenScope), the others are asked
    without it.
    """
    import aiohttp

    from kdn.auth import TokenScope
    from kdn.ring import Ring

    scope = TokenScope(token_hosts)
    out: dict[str, dict[str, Any]] = {}
    asks = [f"?encoding={e}" for e in encodings] or [""]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for region, nodes in by_region(edges).items():
            owner = Ring([n.node_id for n in nodes]).owner(address)  # as the region's edges place it
            node = next(n for n in nodes if n.node_id == owner)
            auth = {"Authorization": f"Bearer {token}"} if token and scope.allows(node.url) else {}
            holds, reads = "no", dict[str, int]()
            for ask in asks:
                holds, reads = await _head(session, f"{node.url}/v1/objects/{address}{ask}", auth)
                if holds != "no":
                    break
            out[region] = {"owner": str(owner), "url": node.url, "holds": holds, "reads": reads}
    return out


async def _head(session: Any, url: str, auth: dict[str, str]) -> tuple[str, dict[str, int]]:
    """One owner's answer for one encoding: (``memory``/``disk``/``no``/``no record there``/``unknown (...)``,
    its reads by tier)."""
    import aiohttp

    try:
        async with session.head(url, headers=auth, allow_redirects=False) as r:
            tier = r.headers.get("X-KDN-Source", "").split(":")[0]
            reads = parse_reads(r.headers.get(READS_HEADER)) if r.status == 200 else {}
            holds = (tier if r.status == 200 and tier in ("memory", "disk") else
                     "no" if r.status == 200 and tier == "miss" else
                     "no record there" if r.status == 404 and auth else
                     f"unknown (HTTP {r.status})" if r.status not in (200, 404) else
                     "unknown (it tells a token that reads every namespace: --token-file)")
            return holds, reads
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return f"unknown ({type(e).__name__})", {}
