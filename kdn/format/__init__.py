"""The format wing: what an object is.

Content addresses and digests (address.py), the safetensors container and its KDN header (objects.py, layout.py),
codecs and encodings (codecs.py, encodings.py), piece digests (pieces.py), and a folder of blobs (store.py).
Imports nothing of the core outside itself but ``kdn.errors``; no web framework, no model library.
"""
