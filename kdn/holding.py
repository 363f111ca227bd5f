"""Where an object is cached now: each region's owner edge of it, asked whether it holds it.

The check ``kdn registry show ADDRESS`` makes (kdn/cli.py) and the operator console's "where it is cached"
(origin/console/edges.py): one HEAD per region to the edge that owns the address on that region's ring, which
never fills. Imports nothing heavy until it runs (aiohttp, the ring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - the registry loads lazily
    from kdn.address import Address
    from kdn.registry import NodeRecord, Registry


async def regions_holding(reg: Registry, address: Address, token: str | None,
                          token_hosts: str | None) -> dict[str, dict[str, str]]:
    """Per region: the edge that owns ``address`` on that region's ring, and whether it holds it now.

    Asked with a HEAD, which never fills: with a token that reads every namespace (an edge's, an admin's) it
    names the tier (``memory``, ``disk``) or says ``no``; without one an edge does not tell (what others read
    lately is cache state). The URLs come from the registry, which a writer can fill with any host: the token
    goes only to ``token_hosts`` (loopback by default, kdn.auth.TokenScope), the others are asked without it.
    """
    import aiohttp

    from kdn.auth import TokenScope
    from kdn.ring import Ring

    scope = TokenScope(token_hosts)
    by_region: dict[str, list[NodeRecord]] = {}
    for n in await reg.list_nodes(role="edge"):
        by_region.setdefault(n.region, []).append(n)
    out: dict[str, dict[str, str]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for region, nodes in sorted(by_region.items()):
            owner = Ring(sorted(n.node_id for n in nodes)).owner(address)  # as the region's edges place it
            node = next(n for n in nodes if n.node_id == owner)
            auth = {"Authorization": f"Bearer {token}"} if token and scope.allows(node.url) else {}
            try:
                async with session.head(f"{node.url}/v1/objects/{address}", headers=auth,
                                        allow_redirects=False) as r:
                    tier = r.headers.get("X-KDN-Source", "").split(":")[0]
                    holds = (tier if r.status == 200 and tier in ("memory", "disk") else
                             "no" if r.status == 200 and tier == "miss" else
                             "no record there" if r.status == 404 else
                             f"unknown (HTTP {r.status})" if r.status != 200 else
                             "unknown (it tells a token that reads every namespace: --token-file)")
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                holds = f"unknown ({type(e).__name__})"
            out[region] = {"owner": str(owner), "url": node.url, "holds": holds}
    return out
