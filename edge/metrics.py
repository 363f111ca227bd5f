"""The edge's Prometheus metrics, in one place so the dashboard and the code agree on names."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FILL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Owner edges are node records, which a registry writer can add by the thousand: the first this many seen are
# labels of their own in kdn_edge_owner_record_fallbacks, the rest "other" (a region has a few dozen edges).
MAX_OWNER_LABELS = 32


class EdgeMetrics:
    """What the edge's code counts as it goes; the gauges read off the edge when scraped are
    ``scrape_gauges``'s."""

    def __init__(self, reg: CollectorRegistry, edge: Callable[[], object]) -> None:
        self.hits = Counter("kdn_edge_hits", "Object reads served from a tier", ["tier"], registry=reg)
        self.misses = Counter("kdn_edge_misses", "Object reads a tier could not serve", ["tier"], registry=reg)
        self.bytes_served = Counter("kdn_edge_bytes_served", "Object bytes served, by where they came from",
                                    ["source"], registry=reg)
        self.fill_seconds = Histogram("kdn_edge_fill_seconds", "Fill latency by source", ["source"], registry=reg,
                                      buckets=FILL_BUCKETS)
        self.fill_bytes = Counter("kdn_edge_fill_bytes", "Bytes filled from upstream, by source", ["source"], registry=reg)
        self.evictions = Counter("kdn_edge_evictions", "Entries evicted, by reason", ["reason"], registry=reg)
        self.prefetch_started = Counter("kdn_edge_prefetch_started", "Prefetch fills started", registry=reg)
        self.prefetch_used = Counter("kdn_edge_prefetch_used", "Prefetched entries later read", registry=reg)
        self.prefetch_wasted = Counter("kdn_edge_prefetch_wasted", "Prefetched entries evicted unread", registry=reg)
        self.record_reads = Counter("kdn_edge_record_reads", "Object records read on a miss of the record cache "
                                    "(--records origin or auto), by where: the region's owner edge, the origins, "
                                    "or (auto) the registry for what no origin had",
                                    ["source"], registry=reg)
        self.owner_fallbacks = Counter("kdn_edge_owner_record_fallbacks", "Object records the region's owner "
                                       "edge did not give, asked of the origins instead, by owner (node id; "
                                       f"the first {MAX_OWNER_LABELS} seen, then other) and outcome: failed (no "
                                       "answer), absent (null), refused (a record this edge does not believe)",
                                       ["owner", "outcome"], registry=reg)
        self._owners: set[str] = set()
        self.warmed = Counter("kdn_edge_warmed", "Entries filled by a warm policy", registry=reg)
        self.pushed = Counter("kdn_edge_pushed_objects", "Objects of a push policy this edge owns, by outcome: "
                              "filled, held (already cached) or failed", ["policy", "outcome"], registry=reg)
        self.pushed_bytes = Counter("kdn_edge_pushed_bytes", "Bytes a push policy filled", ["policy"], registry=reg)
        self.push_pending = Gauge("kdn_edge_push_pending", "Objects of a push still to go here (0: done)",
                                  ["policy"], registry=reg)
        self.token_withheld = Counter("kdn_edge_token_withheld", "Upstream requests sent without this edge's "
                                      "token: a host not in --token-hosts", registry=reg)
        self.digest_failures = Counter("kdn_edge_digest_failures", "Bodies that failed digest verification, by source",
                                       ["source"], registry=reg)
        self.refused_records = Counter("kdn_edge_refused_records",
                                       "Object records not trusted (unsigned, or not by a trusted publisher key)",
                                       registry=reg)
        self.unadmitted_nodes = Counter("kdn_edge_unadmitted_nodes",
                                        "Node records left out: no admission an operator key signed (--require-admission)",
                                        registry=reg)
        self.disk_write_errors = Counter("kdn_edge_disk_write_errors", "Disk tier writes that failed (full, "
                                         "read-only, gone); the object stays in memory", registry=reg)
        self.bad_records = Counter("kdn_edge_bad_registry_records", "Registry records skipped as unreadable, by kind",
                                   ["kind"], registry=reg)
        self.source_errors = Counter("kdn_edge_source_errors", "Failed fetches from a source", ["source"], registry=reg)
        self.region_skipped = Counter("kdn_edge_region_probes_skipped", "Cross-region probes left out of a fill "
                                      "plan while that region's edge rests after failed probes", registry=reg)
        self.region_not_worth = Counter("kdn_edge_region_probes_not_worth", "Cross-region probes left out of a "
                                        "fill plan: the region's recent hit rate does not pay for a miss's round "
                                        "trip against going to the origin", registry=reg)
        self.region_capped = Counter("kdn_edge_region_probes_capped", "Cross-region probes left out of a fill "
                                     "plan: PROBE_MAX_REGIONS more promising regions are asked already",
                                     registry=reg)
        self.aborted = Counter("kdn_edge_aborted_responses", "Responses cut short by the client hanging up",
                               registry=reg)
        self.in_flight = Gauge("kdn_edge_fills_in_flight", "Fills in progress", registry=reg)
        self._kv_event_metrics(reg)
        scrape_gauges(reg, edge)

    def _kv_event_metrics(self, reg: CollectorRegistry) -> None:
        """--kv-events (edge/kv_events.py): what this edge holds, as vLLM KV-cache events for routers."""
        self.kv_events = Counter("kdn_edge_kv_events", "KV-cache events sent (--kv-events), by type: BlockStored, "
                                 "BlockRemoved, AllBlocksCleared", ["type"], registry=reg)
        self.kv_event_batches = Counter("kdn_edge_kv_event_batches", "KV-cache event batches sent, one sequence "
                                        "number each", registry=reg)
        self.kv_events_dropped = Counter("kdn_edge_kv_events_dropped", "KV-cache events not sent, by reason: queue "
                                         "(the publisher thread was behind: a resync follows), no_record, no_tokens "
                                         "(a chunk no indexed manifest names yet: asked again), not_a_block "
                                         "(standalone chunks, partial tails)", ["reason"], registry=reg)
        self.kv_event_replays = Counter("kdn_edge_kv_event_replays", "Replay requests, by outcome: served, cut (the "
                                        "requester's pipe was full or it left), bad (malformed)", ["outcome"],
                                        registry=reg)
        self.kv_event_replay_bytes = Gauge("kdn_edge_kv_event_replay_bytes", "Bytes of batches the replay buffer "
                                           "holds (--kv-events-buffer caps it)", registry=reg)
        self.kv_event_blocks = Gauge("kdn_edge_kv_event_blocks", "Blocks announced and still held (what a router "
                                     "that followed every event knows of this edge)", registry=reg)

    def owner_fallback(self, owner: str, outcome: str, n: int) -> None:
        """``n`` records the owner edge ``owner`` (a node id) did not give (``outcome``), asked of the origins."""
        owner = owner[:64]
        if owner not in self._owners:
            if len(self._owners) >= MAX_OWNER_LABELS:
                owner = "other"
            else:
                self._owners.add(owner)
        self.owner_fallbacks.labels(owner, outcome).inc(n)


def scrape_gauges(reg: CollectorRegistry, edge: Callable[[], object]) -> None:
    """Gauges read off the edge (``edge()``; None before it is up) each time ``/metrics`` is scraped."""

    def tier_value(tier: str, attr: str) -> Callable[[], float]:
        def read() -> float:
            e = edge()
            t = getattr(e, tier, None) if e is not None else None
            return float(getattr(t, attr, 0)) if t is not None else 0.0
        return read

    used = Gauge("kdn_edge_tier_bytes", "Bytes held per tier", ["tier"], registry=reg)
    budget = Gauge("kdn_edge_tier_budget_bytes", "Byte budget per tier", ["tier"], registry=reg)
    for tier in ("memory", "disk"):
        used.labels(tier).set_function(tier_value(tier, "used"))
        budget.labels(tier).set_function(tier_value(tier, "budget"))

    def ring_members() -> float:
        e = edge()
        m = getattr(e, "membership", None) if e is not None else None
        return float(len(m.ring)) if m is not None else 0.0

    Gauge("kdn_edge_ring_members", "Live edges in this edge's region", registry=reg).set_function(ring_members)

    def upper_tiers() -> float:
        e = edge()
        regions = getattr(e, "upper_regions", None) if hasattr(e, "policies") else None
        return float(len(regions())) if regions is not None else 0.0

    Gauge("kdn_edge_upper_tiers", "Upper-tier regions, named by a policy or chosen by latency (none: other "
          "regions' fills go to the origin)", registry=reg).set_function(upper_tiers)

    def origin_rtt() -> float:
        e = edge()
        a = getattr(e, "auto_upper", None) if e is not None else None
        return a.rtt_ms / 1e3 if a is not None and a.rtt_ms is not None else float("nan")

    Gauge("kdn_edge_origin_rtt_seconds", "This edge's least measured round trip to an origin (--upper-tier "
          "auto; NaN: not measured)", registry=reg).set_function(origin_rtt)

    def chain_value(attr: str) -> Callable[[], float]:
        def read() -> float:
            c = getattr(edge(), "chains", None)
            return float(getattr(c, attr, 0)) if c is not None else 0.0
        return read

    Gauge("kdn_edge_chain_index_addresses", "Chunk addresses the prefetch chain index holds (--chain-index "
          "bounds it)", registry=reg).set_function(chain_value("addresses"))
    Gauge("kdn_edge_chain_index_evicted", "Chains the prefetch chain index dropped for room since its last "
          "snapshot (their reads are not prefetched)", registry=reg).set_function(chain_value("evicted"))

    def corrupt() -> float:
        e = edge()
        d = getattr(e, "disk", None) if e is not None else None
        return float(d.stats.corrupt) if d is not None else 0.0

    Gauge("kdn_edge_disk_corrupt", "Disk entries dropped because their digest did not match",
          registry=reg).set_function(corrupt)
