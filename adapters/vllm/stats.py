"""What the connector reports to vLLM's stats logger and Prometheus endpoint.

Worker-side counts travel to the engine's logger as ``KDNStats`` (vLLM calls
``get_kv_connector_stats`` each step and aggregates); ``KDNPromMetrics``
turns them into ``kdn_vllm_*`` series on vLLM's own ``/metrics``:

- ``kdn_vllm_loaded_tokens_total{tier}``: tokens loaded, by the KDN tier that served them
  (``memory``, ``disk``, ``peer``, ``region``, ``origin``);
- ``kdn_vllm_load_failures_total{reason}``: loads given up (the engine recomputed those tokens):
  ``missing``, ``timeout``, ``digest``, ``decode``, ``mismatch``;
- ``kdn_vllm_written_tokens_total{path}``: how those tokens went into the paged cache: ``in_place`` (read
  from the host tier's mapping by the layers' writes: one pass) or ``staging`` (copied or decoded into the
  load's staging first);
- ``kdn_vllm_loaded_bytes_total{encoding}``: object bytes fetched for those loads, by encoding
  (``zstd``, ``raw``, a lossy one within the ``quality`` budget);
- ``kdn_vllm_load_seconds``: one request's load, fetch to last layer written;
- ``kdn_vllm_load_phase_seconds{phase}``: where a load's time goes: ``lookup`` (the chain's records, before
  the step: scheduler side), ``fetch`` (first request to last chunk staged), ``stall`` (of that, the time
  the forward waited at its first attention layer: the fetch not hidden behind anything), ``write`` (the
  layers' backend writes into the paged cache, inside the forward);
- ``kdn_vllm_saved_chunks_total``: chunks a producer wrote to its store;
- ``kdn_vllm_plans_total{outcome}``: the load planner's choices (scheduler side): ``load`` (all the
  hit), ``load_part``, ``compute`` (faster than loading), ``probe`` (computed, while one chunk is fetched
  off the request path to re-measure a stale link);
- ``kdn_vllm_planned_tokens_total{how}``: the tokens of those hits the planner chose to load or compute;
- ``kdn_vllm_blended_tokens_total{kind}``: RAG prompts composed from standalone chunks (``blend.py``):
  ``written`` (into the cache instead of computed by vLLM), ``reused`` (of those, from the KDN's chunks),
  ``recomputed`` (reused tokens recomputed past the check layer); a blend's time is the ``blend`` phase.

The worker also reports each load's wire bytes and seconds (``samples``), which
the scheduler side reads back for the planner's load speed; they are not a series.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdn.adapters.vllm.compat import KVConnectorPromMetrics, KVConnectorStats

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _empty() -> dict[str, Any]:
    return {"loads": 0, "tokens": {}, "paths": {}, "bytes": {}, "failures": {}, "seconds": [], "saved": 0, "samples": [],
            "plans": {}, "plan_tokens": {}, "phases": {},
            "blend": {}}


PHASES = ("lookup", "fetch", "stall", "write", "blend")


@dataclass
class KDNStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)  # (vLLM's own field, as vLLM declares it: typed here)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        d = self.data
        return not (d["loads"] or d["failures"] or d["saved"] or d.get("samples") or d.get("plans")
                    or any(d.get("phases", {}).values()) or d.get("blend"))

    def loaded(self, tier: str, tokens: int, path: str = "staging") -> None:
        self.data["tokens"][tier] = self.data["tokens"].get(tier, 0) + tokens
        paths = self.data.setdefault("paths", {})
        paths[path] = paths.get(path, 0) + tokens

    def fetched(self, encoding: str, nbytes: int) -> None:
        self.data["bytes"][encoding] = self.data["bytes"].get(encoding, 0) + nbytes

    def failed(self, reason: str) -> None:
        self.data["failures"][reason] = self.data["failures"].get(reason, 0) + 1

    def sampled(self, nbytes: int, seconds: float, abandoned: bool = False, host: bool = False) -> None:
        """One load: the wire bytes it moved (all it was to move; given up at its deadline, what landed by
        then), its seconds from start to the last chunk staged (or to its deadline), whether it was
        given up there, and whether every byte came from the machine's host tier."""
        samples = self.data.setdefault("samples", [])
        samples.append([int(nbytes), float(seconds), int(abandoned), int(host)])
        del samples[:-256]

    def phase(self, name: str, seconds: float) -> None:
        """One load's time in ``name`` (one of ``PHASES``), kept bounded between log intervals."""
        secs = self.data.setdefault("phases", {}).setdefault(name, [])
        secs.append(float(seconds))
        del secs[:-1024]

    def blended(self, written: int, reused: int, recomputed: int, seconds: float) -> None:
        """One blend: tokens written into the cache, of those reused from chunks, of those recomputed."""
        b = self.data.setdefault("blend", {})
        for k, v in (("requests", 1), ("written", written), ("reused", reused), ("recomputed", recomputed)):
            b[k] = b.get(k, 0) + v
        self.phase("blend", seconds)

    def planned(self, outcome: str, loaded: int, computed: int) -> None:
        plans, toks = self.data.setdefault("plans", {}), self.data.setdefault("plan_tokens", {})
        plans[outcome] = plans.get(outcome, 0) + 1
        toks["loaded"] = toks.get("loaded", 0) + loaded
        toks["computed"] = toks.get("computed", 0) + computed

    def aggregate(self, other: KVConnectorStats) -> KDNStats:
        o = other.data
        d = self.data
        d["loads"] += o.get("loads", 0)
        d["saved"] += o.get("saved", 0)
        d["seconds"] = (d["seconds"] + list(o.get("seconds", [])))[-4096:]  # bounded between log intervals
        d["samples"] = (d.setdefault("samples", []) + list(o.get("samples", [])))[-256:]
        for name, secs in o.get("phases", {}).items():
            mine_s = d.setdefault("phases", {}).setdefault(name, [])
            mine_s.extend(secs)
            del mine_s[:-1024]
        for key in ("tokens", "paths", "bytes", "failures", "plans", "plan_tokens", "blend"):
            mine = d.setdefault(key, {})
            for k, v in o.get(key, {}).items():
                mine[k] = mine.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        secs = sorted(d["seconds"])
        out: dict[str, int | float] = {"kdn_loads": d["loads"], "kdn_tokens": sum(d["tokens"].values()),
                                       "kdn_failures": sum(d["failures"].values()), "kdn_saved_chunks": d["saved"]}
        if d.get("plans"):
            out["kdn_planned_compute"] = d["plans"].get("compute", 0)
            out["kdn_planned_tokens_computed"] = d.get("plan_tokens", {}).get("computed", 0)
        if secs:
            out["kdn_load_ms_p50"] = round(secs[len(secs) // 2] * 1e3, 2)
            out["kdn_load_ms_max"] = round(secs[-1] * 1e3, 2)
        return out


class KDNPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._tokens = self._counter_cls(name="kdn_vllm_loaded_tokens", labelnames=labelnames + ["tier"],
                                         documentation="Prompt tokens loaded from the KDN instead of computed, by tier")
        self._paths = self._counter_cls(name="kdn_vllm_written_tokens", labelnames=labelnames + ["path"],
                                        documentation="KDN-loaded tokens by how they reached the paged cache: "
                                                      "in_place (from the host tier's mapping) or staging")
        self._bytes = self._counter_cls(name="kdn_vllm_loaded_bytes", labelnames=labelnames + ["encoding"],
                                        documentation="Object bytes fetched from the KDN for loads, by encoding")
        self._failures = self._counter_cls(name="kdn_vllm_load_failures", labelnames=labelnames + ["reason"],
                                           documentation="KDN loads given up (the engine recomputed), by reason")
        self._seconds = self._histogram_cls(name="kdn_vllm_load_seconds", labelnames=labelnames, buckets=_BUCKETS,
                                            documentation="Time to load one request's prefix from the KDN")
        self._phases = self._histogram_cls(name="kdn_vllm_load_phase_seconds", labelnames=labelnames + ["phase"],
                                           buckets=_BUCKETS,
                                           documentation="Where KDN loads' time goes: lookup, fetch, stall, write")
        self._saved = self._counter_cls(name="kdn_vllm_saved_chunks", labelnames=labelnames,
                                        documentation="Chunks a KDN producer wrote to its store")
        self._plans = self._counter_cls(name="kdn_vllm_plans", labelnames=labelnames + ["outcome"],
                                        documentation="The KDN load planner's choices: load, load part, compute, probe")
        self._blended = self._counter_cls(name="kdn_vllm_blended_tokens", labelnames=labelnames + ["kind"],
                                          documentation="RAG prompt tokens composed from standalone KDN chunks: "
                                                        "written, reused, recomputed")
        self._planned = self._counter_cls(name="kdn_vllm_planned_tokens", labelnames=labelnames + ["how"],
                                          documentation="Tokens of KDN hits the planner chose to load or to compute")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        d = transfer_stats_data
        for tier, n in d.get("tokens", {}).items():
            self._tokens.labels(*labels, tier).inc(n)
        for path, n in d.get("paths", {}).items():
            self._paths.labels(*labels, path).inc(n)
        for enc, n in d.get("bytes", {}).items():
            self._bytes.labels(*labels, enc).inc(n)
        for reason, n in d.get("failures", {}).items():
            self._failures.labels(*labels, reason).inc(n)
        for s in d.get("seconds", []):
            self._seconds.labels(*labels).observe(s)
        for phase, secs in d.get("phases", {}).items():
            for s in secs:
                self._phases.labels(*labels, phase).observe(s)
        if d.get("saved"):
            self._saved.labels(*labels).inc(d["saved"])
        for outcome, n in d.get("plans", {}).items():
            self._plans.labels(*labels, outcome).inc(n)
        for kind, n in d.get("blend", {}).items():
            if kind != "requests" and n:
                self._blended.labels(*labels, kind).inc(n)
        for how, n in d.get("plan_tokens", {}).items():
            if n:
                self._planned.labels(*labels, how).inc(n)
