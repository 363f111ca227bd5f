"""Where a client fetches from, and which source it asks first (``KDNClient``'s routing).

Sources of an object, in the order of preference when nothing is measured
yet: the owner edge of the client's region (by the same consistent-hash ring
the edges use), the other edges of the region, other regions' edges, the
origin. Each source keeps two moving estimates (``kdn.wire.estimate``): one of
object transfers, which ranks fetches, and one of control requests (lookups,
registry reads), which ranks those. A lookup's time is mostly the edge's own
work (registry reads, queueing behind fills); fed into the transfer estimate
it made a near edge look 50 ms away and sent the geo bench's clients to
another region (docs/benchmarks.md, Geo).

``from_nodes`` picks a client's sources out of the registry's live nodes,
leaving out those its token may not reach and those no operator admitted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kdn.errors import InvalidInput
from kdn.wire.estimate import Estimates
from kdn.wire.fetch import Route

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.address import Address
    from kdn.registry import Membership, NodeRecord
    from kdn.ring import Ring
    from kdn.registry.signing import Verifier
    from kdn.client.trust import TrustedKeys  # (operator keys take the same forms as publisher keys)

log = logging.getLogger("kdn.client")

PRIOR_RTT = {"edge": 0.001, "region": 0.05, "origin": 0.1}  # seconds, by kind, until a source is measured


class Sources:
    """A client's sources, their estimates, and the order to ask them in.

    Each source is a ``kdn.wire.fetch.Route`` (label, base URL, kind: ``edge`` of the client's region,
    ``region`` for another region's edge, ``origin``), handed as it is to the verified fetch; the client's
    token rides on every request (``kdn.client.connections``), so a route carries no headers of its own.
    ``edges`` may be URLs or (node_id, URL) pairs; with ids, each address goes
    to its owner edge first, by the same ring the edges use. (Benchmarks that
    compare other rankings put theirs in place of ``ranked``: bench/geo.py.)
    """

    def __init__(self, edges: Sequence[str | tuple[str, str]] = (), remote_edges: Sequence[str] = (),
                 origin: str | None = None) -> None:
        if not edges and not origin and not remote_edges:
            raise InvalidInput("KDNClient needs at least one edge or an origin")
        pairs = [(e, e) if isinstance(e, str) else (e[0], e[1]) for e in edges]
        mine = [(Route(f"edge:{nid if nid != u else i}", u.rstrip("/"), "edge"), nid if nid != u else None)
                for i, (nid, u) in enumerate(pairs)]
        others = ([Route(f"region:{i}", u.rstrip("/"), "region") for i, u in enumerate(remote_edges)]
                  + ([Route("origin", origin.rstrip("/"), "origin")] if origin else []))
        self.all: list[Route] = [r for r, _ in mine] + others
        # Each route beside its id on the region's ring (edges given with one; None for the rest).
        self._on_ring: list[tuple[Route, str | None]] = mine + [(r, None) for r in others]
        ids = [nid for _, nid in self._on_ring if nid]
        self.ring: Ring | None = None
        if ids:
            from kdn.ring import Ring

            self.ring = Ring(ids)
        self.estimates = Estimates()  # object transfers
        self.control = Estimates()  # lookups and registry reads
        for s in self.all:
            self.estimates[s.url].set_prior(PRIOR_RTT[s.kind])
            self.control[s.url].set_prior(PRIOR_RTT[s.kind])

    def ranked(self, size: int, address: Address | None = None, *, control: bool = False) -> list[Route]:
        """Least expected time first. A non-owner edge of the region fills through the owner, so it
        costs its own transfer plus the owner's: the owner ranks first while it answers. ``control``:
        for a lookup or registry read, ranked by those requests' own times."""
        est = self.control if control else self.estimates
        owner = self.ring.owner(address) if (self.ring is not None and address) else None
        owner_url = next((s.url for s, nid in self._on_ring if nid == owner), None) if owner else None

        def cost(pair: tuple[Route, str | None]) -> float:
            s, nid = pair
            own = est[s.url].expected(size)
            if owner_url is not None and nid is not None and s.url != owner_url:
                own += est[owner_url].expected(size)
            return own

        return [s for s, _ in sorted(self._on_ring, key=cost)]

    def least_expected(self, size: int) -> float:
        """The least expected time to move ``size`` bytes from any source, as measured so far."""
        return min(self.estimates[s.url].expected(size) for s in self.all)


def admitters(keys: TrustedKeys | None, revoked: str | os.PathLike[str] | Iterable[str] | None) -> Verifier | None:
    """The operator keys a reader checks admissions with, and their revocation list (kdn.registry.signing.Admitters)."""
    if keys is None:
        if revoked is not None:
            raise InvalidInput("revoked_admissions is for admitted_by: give both")
        return None
    from kdn.registry.signing import KEY_PREFIX, Admitters, Verifier

    if isinstance(keys, Admitters) and revoked is None:
        return keys
    if isinstance(keys, Admitters) and (keys.revoked_path is not None or keys.revoked):
        raise InvalidInput("admitted_by already carries a revocation list: give revoked_admissions there, or "
                           "plain keys here (one list, not two that could disagree)")
    if isinstance(keys, Verifier):
        return Admitters([f"{KEY_PREFIX}{k.public_bytes_raw().hex()}" for k in keys.keys.values()], revoked)
    if isinstance(keys, str) and keys.startswith(KEY_PREFIX):
        return Admitters([keys], revoked)
    if isinstance(keys, (str, os.PathLike)):
        return Admitters.from_files(keys, revoked)
    return Admitters(keys, revoked)


async def from_nodes(registry: Membership, region: str, *, token: str | None = None,
                     token_hosts: str | list[str] | None = None, admitted_by: TrustedKeys | None = None,
                     revoked_admissions: str | os.PathLike[str] | Iterable[str] | None = None) -> dict[str, Any]:
    """``edges``, ``remote_edges`` and ``origin`` for a client in ``region``, from the registry's live nodes.

    With a ``token``, nodes it may not reach are left out: a registry writer names these URLs,
    and the token goes only to ``token_hosts`` (loopback by default; https too: kdn.auth.TokenScope).
    With ``admitted_by`` (operator keys), so is every node without an admission one of them signed
    (``kdn node admit``): the writer cannot name a server of its choice at all; and every node whose
    admission is in ``revoked_admissions`` (a file or a list of ids: ``kdn node revoke``).
    """
    edges = await registry.list_nodes(role="edge")
    origins = await registry.list_nodes(role="origin")
    operators = admitters(admitted_by, revoked_admissions)
    if operators is not None:
        from kdn.registry.signing import unadmitted

        why = {(n.role, n.region, n.node_id): unadmitted(n, operators) for n in edges + origins}

        def out(n: NodeRecord) -> str | None:
            return why[(n.role, n.region, n.node_id)]

        left = [f"{n.role} {n.node_id} ({out(n)})" for n in edges + origins if out(n)]
        if left:
            log.warning("leaving out %d unadmitted node(s): %s", len(left), "; ".join(left[:5]))
        edges = [n for n in edges if not out(n)]
        origins = [n for n in origins if not out(n)]
    if token:
        from kdn.auth import TokenScope

        scope = TokenScope(token_hosts)
        dropped = [n.url for n in edges + origins if not scope.allows(n.url)]
        if dropped:
            log.warning("leaving out %d node(s) the token may not reach (token_hosts %s): %s",
                        len(dropped), ",".join(scope.patterns), ", ".join(dropped[:5]))
        edges = [n for n in edges if scope.allows(n.url)]
        origins = [n for n in origins if scope.allows(n.url)]
    return {"edges": [(n.node_id, n.url) for n in edges if n.region == region],
            "remote_edges": [n.url for n in edges if n.region != region],
            "origin": origins[0].url if origins else None}
