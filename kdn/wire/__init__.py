"""The wire wing: how bytes move.

One verified fetch for edges and clients (fetch.py), the body reader that lands bytes in a caller's buffer
(bodyget.py), moving estimates of each source's link (estimate.py), the reused host arena (arena.py), and the
scatter of a raw body straight into an engine's cache layout (scatter.py). Imports the format wing below it.
"""
