"""A host tier's settings (``kdn host serve``): where its socket and segment are, how large, whom it serves,
where it fills from, whose signatures it believes, and whose policies it follows."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from kdn.edge.eviction import DEFAULT_POLICY, POLICIES
from kdn.errors import InvalidInput
from kdn.format.address import validate_name


def default_path(suffix: str) -> str:
    """``/dev/shm/kdn-host-UID.SUFFIX``: one host per user and machine unless told otherwise."""
    return f"/dev/shm/kdn-host-{os.getuid()}.{suffix}"


@dataclass(frozen=True)
class HostConfig:
    """One host tier. ``edges`` (and/or ``origin``) are where fills come from, the region's entry edge
    first; ``trusted_keys`` are the publisher keys a record must be signed by, required: the segment holds
    only what a publisher signed and BLAKE3 confirmed."""

    trusted_keys: str
    edges: tuple[str, ...] = ()
    origin: str | None = None
    socket: str = default_path("sock")
    segment: str = default_path("seg")
    segment_bytes: int = 1 << 30
    budget: int | None = None  # bytes held at most (default: the whole segment)
    group: str | None = None  # engines' group: socket 0660 and segment 0640 theirs (default: 0600, this user)
    token_file: str | None = None  # grants file (kdn.auth): which namespaces each engine's token reads
    upstream_token_file: str | None = None  # the token this host shows its edges
    ca: str | None = None  # CA bundle to verify the edges over HTTPS
    eviction: str = DEFAULT_POLICY
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # /metrics over HTTP here (None: only the stats op)
    timeout: float = 30.0  # a fill's request to one source
    region: str | None = None  # follow this region's policies (kdn.host.policies); None: none
    registry: str | None = None  # ... read from this registry (None: $KDN_REGISTRY, else the embedded file)
    operator_keys: str | None = None  # ... and only those one of these keys signed (the edges' --operator-keys)
    # The least time an "absent" takes (or the last minute's p99 of them, if longer): another tenant's object
    # held here, and one never published, are refused alike (the edges' --deny-floor-ms).
    deny_floor_ms: float = 2.0

    def __post_init__(self) -> None:
        if not self.edges and self.origin is None:
            raise InvalidInput("a host tier fills from its region's edges: give at least one --edge (or --origin)")
        if not 0 < self.segment_bytes:
            raise InvalidInput(f"--segment-bytes must be positive, got {self.segment_bytes}")
        if self.budget is not None and not 0 < self.budget <= self.segment_bytes:
            raise InvalidInput(f"--budget must be 1..{self.segment_bytes} bytes (the segment), got {self.budget}")
        if self.eviction not in POLICIES:
            raise InvalidInput(f"eviction must be one of {', '.join(POLICIES)}, not {self.eviction!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidInput(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        try:
            loopback = ipaddress.ip_address(self.metrics_host).is_loopback
        except ValueError:
            loopback = self.metrics_host == "localhost"
        if not loopback:
            # Its numbers describe this machine's engines' reads: for this machine's collector, not the network.
            raise InvalidInput(f"--metrics-host must be a loopback address, not {self.metrics_host[:40]!r}")
        if not self.timeout > 0:
            raise InvalidInput(f"timeout must be positive, got {self.timeout}")
        if not 0 <= self.deny_floor_ms <= 1000:
            raise InvalidInput(f"--deny-floor-ms must be 0..1000, got {self.deny_floor_ms}")
        if self.region is None and (self.registry is not None or self.operator_keys is not None):
            raise InvalidInput("--registry and --operator-keys say where policies come from: give --region too, "
                               "the region whose policies this host follows")
        if self.region is not None:
            validate_name(self.region)

    @property
    def held_budget(self) -> int:
        return self.budget if self.budget is not None else self.segment_bytes
