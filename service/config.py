"""What an origin and an edge are both configured with (``NodeConfig``), and the deadlines they hold
their peers to (``Deadlines``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdn.errors import InvalidInput


@dataclass(frozen=True)
class Deadlines:
    """How long a peer may take. A request's head must arrive within ``headers`` seconds of the
    connection opening or of the previous response (else the connection is closed: it is also how
    long an idle keep-alive connection stays open); a request body within ``body`` seconds (408
    after); a response of N bytes must be taken within ``send_grace + N / min_send_rate`` seconds,
    or its connection is aborted. Without them a trickled head or body holds a connection, and a
    stalled reader its response and the tier entry it pins, forever."""

    headers: float = 30.0
    body: float = 30.0
    send_grace: float = 10.0
    min_send_rate: float = float(1 << 20)  # bytes per second

    def __post_init__(self) -> None:
        if not (self.headers > 0 and self.body > 0 and self.send_grace > 0 and self.min_send_rate > 0):
            raise InvalidInput(f"deadlines must be positive, got {self}")

    def send(self, size: int) -> float:
        return self.send_grace + size / self.min_send_rate


@dataclass
class NodeConfig:
    """What an origin and an edge are both configured with: where they listen and advertise, who may
    call them, the registry, their lease, TLS, durability and deadlines. ``OriginConfig`` and
    ``EdgeConfig`` add their own fields (and their own ``node_id`` and ``port`` defaults)."""

    registry: str | None = None  # etcd URL(s) or file: path; None = the embedded default
    host: str = "127.0.0.1"
    port: int = 8000
    node_id: str = "node"
    url: str | None = None  # advertised URL; default http(s)://host:port
    token_file: str | None = None  # who may do what here (kdn.auth)
    lease_ttl: float = 10.0  # the registry lease that lists this node while it lives
    fsync: bool = True  # blobs and indexes reach the disk before they are acknowledged
    tls_cert: str | None = None
    tls_key: str | None = None
    deadlines: Deadlines = field(default_factory=Deadlines)  # request heads and bodies, responses
    max_connections: int | None = None  # None: from the descriptor limit (service/connections.py)
    max_connections_per_peer: int | None = None  # None: half of max_connections
    admission: str | None = None  # an operator's signed admission of this node (kdn node admit): in its record
    # Operator keys file: an edge skips policies none of them signed; with require_admission, nodes in the
    # registry count only if one of them admitted it (kdn node admit), less the revoked_admissions list.
    operator_keys: str | None = None
    # A "no" (absent, or not yours) takes at least this long, or a recent "no"'s p99 if longer (edge/records.py,
    # service/records.py): its timing then does not tell another tenant's object from an absent one.
    deny_floor_ms: float = 2.0
    require_admission: bool = False  # leave out nodes no --operator-keys key admitted
    revoked_admissions: str | None = None  # the operator's revocation list (kdn node revoke), read again on change

    def connection_caps(self) -> Any:
        """The ``ConnectionCaps`` this node serves under, fitted to this process's descriptor limit."""
        from .connections import ConnectionCaps, descriptor_limit

        return ConnectionCaps.for_limit(descriptor_limit(), total=self.max_connections,
                                        per_peer=self.max_connections_per_peer)

    def admitters(self) -> Any:
        """With ``require_admission``: the operator keys and revocation list that admit the nodes this one
        talks to (kdn.registry.signing.Admitters), so a registry writer cannot point it at a server of its choice;
        else None."""
        if self.revoked_admissions and not self.require_admission:
            raise InvalidInput("--revoked-admissions is for --require-admission: give both")
        if not self.require_admission:
            return None
        if not self.operator_keys:
            raise InvalidInput("--require-admission checks admissions with --operator-keys: give both")
        from kdn.registry.signing import Admitters

        return Admitters.from_files(self.operator_keys, self.revoked_admissions)

    @property
    def advertised_url(self) -> str:
        return self.url or f"{'https' if self.tls_cert else 'http'}://{self.host}:{self.port}"

    def record_extra(self, role: str, region: str) -> dict[str, Any]:
        """What this node's registry record carries besides its name: its admission (``--admission``), read
        and checked here so that a node that would be left out says so at start, not by going unused."""
        if not self.admission:
            return {}
        import time

        from kdn.registry import Admission, NodeRecord

        try:
            adm = Admission.from_dict(json.loads(Path(self.admission).read_text()))
        except OSError as e:
            raise InvalidInput(f"cannot read --admission {self.admission!r}: {e.strerror}") from None
        except ValueError as e:
            raise InvalidInput(f"--admission {self.admission!r} is not an admission (kdn node admit): {e}") from None
        me = NodeRecord(role=role, region=region, node_id=self.node_id, url=self.advertised_url)
        if not adm.names(me):
            raise InvalidInput(f"--admission names {adm.role} {adm.region}/{adm.node_id} at {adm.url}, not this "
                               f"node ({role} {region}/{self.node_id} at {self.advertised_url})")
        if adm.expires <= time.time():
            raise InvalidInput(f"--admission {self.admission!r} has expired: admit this node again (kdn node admit)")
        if not adm.sig:
            raise InvalidInput(f"--admission {self.admission!r} is not signed")
        return {"admission": adm.to_dict()}
