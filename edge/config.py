"""An edge's settings (``kdn edge serve``): the shared node settings plus its tiers, upstreams and trust."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field

from kdn.edge.eviction import DEFAULT_POLICY, POLICIES
from kdn.edge.prefetch import CHAIN_BUDGET

from kdn import service
from kdn.format.address import validate_name, validate_namespace
from kdn.errors import InvalidInput

# Where an edge reads object records (edge/records.py): the default first.
RECORDS_MODES = ("auto", "origin", "registry")


@dataclass
class EdgeConfig(service.NodeConfig):
    """An edge (``kdn edge serve``): the shared node settings plus its tiers, upstreams and trust."""

    port: int = 8100
    node_id: str = field(default_factory=lambda: validate_name(f"edge-{socket.gethostname().split('.')[0][:40]}"))
    region: str = "local"
    origin: str | None = None  # default: the origins registered in the registry
    mem_budget: int = 1 << 30
    disk: str | None = None
    disk_budget: int = 10 << 30
    upstream_token_file: str | None = None  # the token this edge shows peers and the origin
    # hosts that token may reach, http or https; None = loopback (kdn.auth.TokenScope)
    token_hosts: str | None = None
    prefetch: int = 2
    chain_index: int = CHAIN_BUDGET  # addresses the prefetch chain index holds at most (edge/prefetch.py)
    records_cache: int = 100_000
    ca: str | None = None  # CA bundle to verify peers and the origin over HTTPS (default: system CAs)
    trusted_keys: str | None = None  # publisher keys file: records not signed by one are misses
    region_probes: str = "worth"  # "worth": ask a region first only when it pays (edge/fill.py); "always"
    eviction: str = DEFAULT_POLICY  # both tiers' policy: "arc" (chosen on the traces) or "s3-fifo"
    # where object records are read: "auto" (the origins while any is known, the registry for what none has),
    # "origin" (the origins' stores only), or "registry" (edge/records.py)
    records: str = "auto"
    # "auto": without an upper policy, the region the edges' measured round trips to the origins choose
    # (edge/upper.py); "policy": only an upper policy names an upper tier
    upper_tier: str = "auto"
    # What this edge holds, as vLLM KV-cache events (edge/kv_events.py): a ZMQ endpoint (vLLM's rule: a wildcard
    # host or ipc:// binds, any other connects); None: off. The replay ROUTER always binds; None: no replays.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_namespaces: tuple[str, ...] = ()  # besides public: their token ids go out in plaintext
    kv_events_buffer: int = 64 << 20  # replay buffer bytes at most
    kv_events_int_hashes: bool = False  # block hashes as the low 64 bits of an address (an integer), not its bytes

    def __post_init__(self) -> None:
        if self.region_probes not in ("worth", "always"):
            raise InvalidInput(f"region_probes must be 'worth' or 'always', not {self.region_probes!r}")
        if self.records not in RECORDS_MODES:
            raise InvalidInput(f"records must be one of {', '.join(RECORDS_MODES)}, not {self.records!r}")
        if not (isinstance(self.chain_index, int) and self.chain_index >= 0):
            raise InvalidInput(f"chain_index must be a whole number of addresses, not {self.chain_index!r}")
        if self.upper_tier not in ("auto", "policy"):
            raise InvalidInput(f"upper_tier must be 'auto' or 'policy', not {self.upper_tier!r}")
        if self.eviction not in POLICIES:
            raise InvalidInput(f"eviction must be one of {', '.join(POLICIES)}, not {self.eviction!r}")
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        for what, endpoint in (("kv_events", self.kv_events), ("kv_events_replay", self.kv_events_replay)):
            if endpoint is not None and not _ZMQ_ENDPOINT.fullmatch(endpoint):
                raise InvalidInput(f"{what} must be a ZMQ endpoint, tcp://HOST:PORT or ipc://PATH, not {endpoint[:80]!r}")
        if self.kv_events is None and (self.kv_events_replay or self.kv_events_namespaces):
            raise InvalidInput("kv_events_replay and kv_events_namespaces need kv_events (the endpoint to publish on)")
        self.kv_events_namespaces = tuple(validate_namespace(ns) for ns in self.kv_events_namespaces)
        if not (isinstance(self.kv_events_buffer, int) and self.kv_events_buffer > 0):
            raise InvalidInput(f"kv_events_buffer must be a positive number of bytes, not {self.kv_events_buffer!r}")


_ZMQ_ENDPOINT = re.compile(r"tcp://(\*|[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}|ipc://[^\x00-\x1f]{1,100}")
