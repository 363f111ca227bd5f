"""The client wing: what an engine (or a script) uses to find and fetch published knowledge.

``KDNClient`` (client.py) is the facade; its concerns each have a module: where to fetch from (sources.py,
connections.py), how a lookup finds the longest published prefix (find.py, lookup.py), how a prefix's objects
are fetched and decoded or placed (prefix.py, parts.py, checked.py, bases.py), what it believes (trust.py,
versions.py), where an object is cached now (holding.py), and a blocking wrapper for scripts (sync.py).
The only wing of the core that may import ``kdn.kernels`` (lossy decodes), and only where it decodes.

The names below are the public surface (loaded lazily); code inside the wing imports the module that
defines a name.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (for readers and type checkers; at run time each name loads when first asked for)
    from kdn.chunk import FILL_TIERS, fills
    from kdn.client.client import KDNClient
    from kdn.client.lookup import Fetched, Lookup, PrefixStates, Probe, Tensors
    from kdn.client.sync import SyncKDNClient

_WHERE = {"KDNClient": "kdn.client.client", "SyncKDNClient": "kdn.client.sync", "FILL_TIERS": "kdn.chunk",
          "fills": "kdn.chunk", **{n: "kdn.client.lookup" for n in ("Fetched", "Lookup", "PrefixStates", "Probe",
                                                                   "Tensors")}}

__all__ = ["FILL_TIERS", "Fetched", "KDNClient", "Lookup", "PrefixStates", "Probe", "SyncKDNClient", "Tensors",
           "fills"]


def __getattr__(name: str) -> Any:
    """The public names, each imported when first used: ``import kdn.client.host`` (an engine's hot path) loads
    no web framework, and the facade's modules never import this package's names (no circle)."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
