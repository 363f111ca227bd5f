"""A fetched, verified object checked against the lookup that asked for it, then decoded.

Its digest proves the bytes are the ones its record names; these checks prove the
record was the right one to ask: the object's own header names the address,
model, namespace and token span the lookup wanted, and a lossless request gets
lossless tensors. Used by ``KDNClient.fetch_prefix`` for every object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kdn.format.address import Address
from kdn.errors import DigestMismatch
from kdn.wire.estimate import DecodeSpeeds
from kdn.client.lookup import Fetched, Lookup

if TYPE_CHECKING:  # pragma: no cover
    from kdn.format.objects import DecodedObject, ObjectHeader, ObjectView


def check_identity(h: ObjectHeader, hit: Lookup, address: Address) -> None:
    """A verified object is the one the lookup asked for: its address, model and namespace."""
    if h.model_id != hit.model_id or h.namespace != hit.namespace or h.address != address:
        raise DigestMismatch(f"object {address} claims model {h.model_id[:12]}/{h.namespace}, "
                             f"expected {hit.model_id[:12]}/{hit.namespace}")


def decode_checked(f: Fetched, hit: Lookup, budget: float | None, max_decoded: int | None = None,
                    index: int = 0, into: Callable[[int, ObjectView], None] | None = None,
                    speeds: DecodeSpeeds | None = None) -> DecodedObject:
    """Check a verified object is the one the lookup asked for, then decode it (or hand it to ``into``)."""
    from kdn.format.codecs import codec_names, get_codec
    from kdn.format.objects import DecodedObject, ObjectView

    view = ObjectView(f.blob, max_decoded=max_decoded)
    h = view.header
    check_identity(h, hit, f.address)
    start, end = hit.span(index)
    if (h.start, h.end) != (start, end):
        raise DigestMismatch(f"object {f.address} claims tokens [{h.start}, {h.end}), the lookup asked for "
                             f"[{start}, {end})")
    if not h.codecs <= set(codec_names()):
        import kdn.kernels  # noqa: F401  (lossy codecs need torch: registered only when used)
    if budget is None and not all(get_codec(c).lossless for c in h.codecs):
        # Belt and braces: the digest already pins the bytes to a lossless encoding.
        raise DigestMismatch(f"object {f.address} holds lossy tensors but lossless was asked for")
    t0 = time.perf_counter()
    if into is not None:
        into(index, view)
        out = DecodedObject(h, {})
    else:
        out = DecodedObject(h, view.decode())
    if speeds is not None:  # what the decode (into the engine's cache, with ``into``) cost on this machine
        speeds.observe(h.encoding, h.decoded_nbytes, time.perf_counter() - t0)
    return out
