"""The consistent-hash ring that gives every object address an owner edge within a region.

Built on ``uhashring`` (ketama-style continuum, ``add_node``/``remove_node``,
distinct-node walks for fallback order). The better-known ``consistent-hash``
package is Python 2 only (implicit relative imports, ``xrange``), so it is not
an option.

Each node gets ``vnodes`` points on a 64-bit circle at
``xxh3_64("{node_id}-{i}")``; an address belongs to the first point after
``xxh3_64(address)`` (wrapping round). xxh3 is seeded and stable, so every
process (every edge, every client) computes the same owner for the same
members: never Python's ``hash()``, which is salted per process. xxh3 is not
cryptographic and needs not be: addresses are already BLAKE3 digests, and node
ids are chosen by the operator.

Removing a node takes away only its own points, so only the addresses it owned
move, each to the next node along the circle; no address moves between the
nodes that stay. Adding one moves only the addresses it takes over.

Collisions between two nodes' points (probability ~ points² / 2⁶⁵, about 1e-13
for 16 nodes) would make ownership of that one point depend on insertion
order; ignored.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash
from uhashring import HashRing

from kdn.format.address import Address, validate_address, validate_name
from kdn.errors import InvalidInput

__all__ = ["Ring"]

_SPACE = 1 << 64  # xxh3_64 outputs


def _hash(key: str) -> int:
    # uhashring hashes both node points ("edge-1-17") and lookup keys with this.
    return xxhash.xxh3_64_intdigest(key.encode())


class Ring:
    """A consistent-hash ring over node ids: ``owner(address)``, ``preference(address)``, ``shares()``.

    Not thread-safe; an edge rebuilds or mutates it from its event loop only.
    """

    def __init__(self, nodes: Iterable[str] = (), *, vnodes: int = 320) -> None:
        if not (isinstance(vnodes, int) and not isinstance(vnodes, bool) and vnodes > 0):
            raise InvalidInput(f"vnodes must be a positive int, got {vnodes!r}")
        self.vnodes = vnodes
        members = list(dict.fromkeys(validate_name(n) for n in nodes))
        # Built in one go: uhashring re-sorts its whole continuum on every add_node, so adding the members one
        # by one cost O(n^2 log n) -- 58 s for 1,000 edges here, 0.4 s for 100 -- where one build of 1,000 takes
        # ~0.4 s and of 10,000 ~5 s (bench/scale.py).
        self._ring = HashRing(members, hash_fn=_hash, vnodes=vnodes)

    # membership -------------------------------------------------------------

    def add(self, node_id: str) -> None:
        """Add a node; adding one already present changes nothing."""
        validate_name(node_id)
        if node_id not in self._ring.get_nodes():
            self._ring.add_node(node_id)

    def remove(self, node_id: str) -> None:
        """Remove a node; removing one that is absent changes nothing."""
        if node_id in self._ring.get_nodes():
            self._ring.remove_node(node_id)

    @property
    def nodes(self) -> list[str]:
        return sorted(self._ring.get_nodes())

    def __len__(self) -> int:
        return len(self._ring.get_nodes())

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._ring.get_nodes()

    def __repr__(self) -> str:
        return f"Ring({self.nodes!r}, vnodes={self.vnodes})"

    # lookups ----------------------------------------------------------------

    def owner(self, address: Address) -> str | None:
        """The node that owns ``address``; None when the ring is empty."""
        node: str | None = self._ring.get_node(validate_address(address))  # uhashring is untyped
        return node

    def preference(self, address: Address, n: int | None = None) -> list[str]:
        """Distinct nodes in the order a request walks them: the owner first, then its fallbacks.

        The order is the clockwise walk from the address, so when the owner is
        down the second node is the one that would own the address without it:
        fallbacks agree with the ring that the survivors will build.
        """
        address = validate_address(address)
        if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise InvalidInput(f"n must be a non-negative int or None, got {n!r}")
        if n == 0 or not len(self):
            return []
        return [conf["nodename"] for conf in self._ring.range(address, size=n)]

    def shares(self) -> dict[str, float]:
        """Each node's share of the hash space, computed exactly from the arcs of the ring.

        A point at position ``p`` owns the arc ``[previous point, p)``; a node's
        share is the sum of its arcs over 2⁶⁴. The shares sum to 1 (empty dict
        for an empty ring). This is what a uniform stream of addresses (BLAKE3
        digests) sees in expectation; no sampling involved.
        """
        points = self._ring.get_points()  # [(position, node_id)], sorted by position
        if not points:
            return {}
        out = dict.fromkeys(self._ring.get_nodes(), 0)
        prev = points[-1][0] - _SPACE  # the first arc wraps round from the last point
        for pos, node in points:
            out[node] += pos - prev
            prev = pos
        return {node: arc / _SPACE for node, arc in sorted(out.items())}
