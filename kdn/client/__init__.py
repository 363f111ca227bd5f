"""The client wing: what an engine (or a script) uses to find and fetch published knowledge.

``KDNClient`` (client.py) is the facade; its concerns each have a module: where to fetch from (sources.py,
connections.py), how a lookup finds the longest published prefix (find.py, lookup.py), how a prefix's objects
are fetched and decoded or placed (prefix.py, parts.py, checked.py, bases.py), what it believes (trust.py,
versions.py), where an object is cached now (holding.py), and a blocking wrapper for scripts (sync.py).
The only wing of the core that may import ``kdn.kernels`` (lossy decodes), and only where it decodes.

The names below are the public surface; code inside the wing imports the module that defines a name.
"""

from kdn.client.client import KDNClient
from kdn.client.lookup import FILL_TIERS, Fetched, Lookup, PrefixStates, Probe, Source, Tensors, fills
from kdn.client.sync import SyncKDNClient

__all__ = ["FILL_TIERS", "Fetched", "KDNClient", "Lookup", "PrefixStates", "Probe", "Source", "SyncKDNClient",
           "Tensors", "fills"]
