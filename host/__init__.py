"""kdn.host: the host tier, one per machine beside its engines (``kdn host serve``).

It holds verified objects in a shared-memory segment that every engine on the machine maps read-only, fills
them from the region's edges (one verified fetch, once; ahead of requests where its region's policies push,
warm or pin them), and answers engines over a Unix socket: which objects it holds, and leases that keep an
object's bytes in place while an engine copies them into its cache. The engine's side is
``kdn.client.host.HostClient``; docs/design.md ("The host tier") says why.

Modules: segment.py (the shared file), alloc.py (blocks in it), store.py (what is held, leases, eviction),
fill.py (from the edges), ops.py (each request), leases.py (a connection's leases), session.py (a
connection), server.py (the socket), policies.py (the region's policies, followed: pushes, warms and pins),
metrics.py, config.py, tier.py (all of it started and stopped), cli.py.
The frames and messages both sides speak are ``kdn.wire.host``; the engine's side is in the client wing
(``kdn.client.host``, ``kdn.client.leased``), which an engine imports without this part.
"""
