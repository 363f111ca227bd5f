"""TLS contexts for KDN's servers and clients (stdlib ssl; nothing to install).

Servers serve HTTPS when given a certificate and key. Clients (the fetch
client, an edge's upstream session, ``kdn publish``) always verify: against
the system's CAs by default, or against ``ca`` (a PEM bundle; ``$KDN_CA``)
for a private CA. There is no switch to turn verification off.
"""

from __future__ import annotations

import os
import ssl

from kdn.errors import InvalidInput


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert and not key:
        return None
    if not (cert and key):
        raise InvalidInput("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise InvalidInput(f"cannot load TLS certificate {cert!r} / key {key!r}: {e}") from None
    return ctx


def client_context(ca: str | None = None) -> ssl.SSLContext:
    """A verifying client context: ``ca`` (or ``$KDN_CA``) if given, else the system trust store."""
    ca = ca or os.environ.get("KDN_CA") or None
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise InvalidInput(f"cannot load CA bundle {ca!r}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
