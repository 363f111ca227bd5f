"""``KDNConnector``: vLLM's KV connector interface, answered by KDN.

vLLM builds one instance per role (``KVConnectorRole.SCHEDULER`` in the
engine core, ``WORKER`` next to the model) and calls the methods of that role
only; this class is the thin switchboard from vLLM's names to
``scheduler.SchedulerSide``, ``worker.WorkerSide`` and ``save.Saver``, which
hold the logic. ``SupportsHMA`` is what lets a hybrid model (attention and
gated-delta-net layers, several KV cache groups) start with a connector.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kdn.errors import InvalidInput

from kdn.adapters.vllm import compat
from kdn.adapters.vllm.bridge import LoopThread
from kdn.adapters.vllm.config import ConnectorConfig, check_cache_dtype
from kdn.adapters.vllm.identity import model_id_for
from kdn.adapters.vllm.meta import KDNMetadata
from kdn.adapters.vllm.stats import KDNPromMetrics, KDNStats

if TYPE_CHECKING:  # (each role imports only its own side, at start)
    from kdn.adapters.vllm.save import Saver
    from kdn.adapters.vllm.scheduler import SchedulerSide
    from kdn.adapters.vllm.worker import WorkerSide

log = logging.getLogger("kdn.adapters.vllm")


class KDNConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        compat.check_version()
        tc = self._kv_transfer_config
        self.consume = tc.kv_role in ("kv_consumer", "kv_both")
        self.produce = tc.kv_role in ("kv_producer", "kv_both")
        self.cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config, consumer=self.consume,
                                              producer=self.produce)
        self.groups = compat.groups(kv_cache_config)
        self.hybrid = any(g.kind == "mamba" for g in self.groups)
        self._check_loads(vllm_config, tc)
        path, dtype = compat.model_source(vllm_config)
        self.model_id = model_id_for(path, dtype)
        hf = vllm_config.model_config.hf_config
        n_layers = int(hf.num_hidden_layers)
        self._check_steer(vllm_config)
        self._check_blend(vllm_config)
        self.bridge = LoopThread(f"kdn-{role.name.lower()}") if self.consume or (self.produce and self.cfg.registry) else None
        self.client = self.bridge.run(_make_client(self.cfg), timeout=30) if self.consume and self.bridge else None
        self.registry: Any = None
        self.sched: SchedulerSide | None = None  # the scheduler role's side; the worker role's two:
        self.worker: WorkerSide | None = None
        self.saver: Saver | None = None
        attn = next((g for g in self.groups if g.kind == "attention"), None)
        if attn is None:
            raise InvalidInput("the KDN connector needs a model with attention layers")
        if role == compat.KVConnectorRole.SCHEDULER:
            self.sched = self._scheduler_side(vllm_config, hf, n_layers, attn.block_size)
        else:
            self._worker_sides(vllm_config, n_layers)
        log.info("KDN connector (%s, %s) for model %s: %s", role.name.lower(), tc.kv_role, self.model_id[:16],
                 "hybrid, loads between steps" if self.hybrid else "attention only")

    def _check_loads(self, vllm_config: Any, tc: Any) -> None:
        """Refuse a load mode this model cannot run; stop consuming where vLLM cannot take states; warn where a
        failed load would fail its request."""
        if self.hybrid and self.cfg.load == "sync":
            raise InvalidInput("hybrid models load between steps ('load': 'async' or 'auto'): vLLM takes no "
                               "block-level load errors with several KV cache groups")
        if self.hybrid and self.consume and compat.mamba_mode(vllm_config) != "align":
            log.warning("KDN: a hybrid model loads states only with prefix caching on (mamba_cache_mode 'align'); "
                        "this engine will not load from the KDN")
            self.consume = False
        if self.consume:
            check_cache_dtype(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
        if self.consume and tc.kv_load_failure_policy != "recompute":
            log.warning("KDN: kv_load_failure_policy is %r: a failed load fails its request; set it to "
                        "'recompute' to have vLLM compute what could not be loaded", tc.kv_load_failure_policy)

    def _check_blend(self, vllm_config: Any) -> None:
        if not self.cfg.blend:
            return
        if self.hybrid:
            raise InvalidInput("blending ('blend': true) composes attention K/V only: this model is hybrid")
        if int(vllm_config.parallel_config.tensor_parallel_size) > 1 or \
                int(vllm_config.parallel_config.pipeline_parallel_size) > 1:
            raise InvalidInput("blending ('blend': true) runs with tensor and pipeline parallel size 1 only")

    def _check_steer(self, vllm_config: Any) -> None:
        if self.cfg.steer and int(vllm_config.parallel_config.tensor_parallel_size) > 1:
            raise InvalidInput("attention steering ('steer': true) runs with tensor_parallel_size 1 only")
        if self.cfg.steer and getattr(vllm_config, "speculative_config", None) is not None:
            # Drafts make the scheduler's token counts optimistic, and a drafter's layers would read the plan too.
            raise InvalidInput("attention steering ('steer': true) does not run with speculative decoding")

    def _scheduler_side(self, vllm_config: Any, hf: Any, n_layers: int, block_size: int) -> SchedulerSide:
        from kdn.adapters.vllm.planning import Planner, prefill_model
        from kdn.adapters.vllm.scheduler import SchedulerSide
        from kdn.planner import Speeds

        planner = None
        if self.client is not None:  # it times every step, so that plans are made on measured speeds
            planner = Planner(Speeds(prefill_model(hf)), link=self.client.expected_seconds,
                              max_deadline_s=self.cfg.load_timeout)
        blender = None
        if self.consume:
            from kdn.adapters.vllm.blend import BlendScheduler

            blender = BlendScheduler(client=self.client, bridge=self.bridge, model_id=self.model_id,
                                     namespace=self.cfg.namespace, chunk_tokens=self.cfg.chunk_tokens,
                                     block_size=block_size, n_layers=n_layers, lookup_timeout=self.cfg.lookup_timeout,
                                     enabled=self.cfg.blend)
        return SchedulerSide(cfg=self.cfg, model_id=self.model_id, block_size=block_size, blender=blender,
                             hybrid=self.hybrid, consume=self.consume, produce=self.produce,
                             background=self.hybrid or self.cfg.load == "async", bridge=self.bridge,
                             client=self.client, mamba_groups=tuple(g.id for g in self.groups if g.kind == "mamba"),
                             mamba_mode=compat.mamba_mode(vllm_config),
                             steer=self.cfg.steer, n_layers=n_layers,
                             n_heads=int(hf.num_attention_heads), planner=planner)

    def _worker_sides(self, vllm_config: Any, n_layers: int) -> None:
        """The worker role's loader (``self.worker``), its steerer, and with a producer's role its saver."""
        from kdn.adapters.vllm.worker import WorkerSide

        self.worker = WorkerSide(cfg=self.cfg, model_id=self.model_id, groups=self.groups, bridge=self.bridge,
                                 client=self.client, device=torch.device(vllm_config.device_config.device))
        self.worker.register(compat.forward_layers(vllm_config))
        if self.cfg.blend and self.consume:
            from kdn.adapters.vllm.blend_run import BlendRunner

            self.worker.blender = BlendRunner(client=self.client, bridge=self.bridge, model_id=self.model_id,
                                              namespace=self.cfg.namespace, attn=self.worker.attn,
                                              block_size=self.worker.block_size, vllm_config=vllm_config,
                                              fetch_timeout=self.cfg.load_timeout)
        self.steerer = None
        if self.cfg.steer:
            from kdn.adapters.vllm.steer import Steerer

            # vLLM binds each step's metadata before the forward, so the wrapped layers read it then.
            where = {n: (g.id, g.block_size) for g in self.groups for n in g.layers}
            # A sure question map has vLLM compute the question again (reported as a failed load: recomputed).
            self.steerer = Steerer(self.worker.attn, where, lambda: getattr(self._connector_metadata, "steers", None),
                                   rerun=vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute")
        if self.produce:
            from kdn.adapters.vllm.save import Saver

            if self.cfg.registry:
                from kdn.registry import open_registry

                self.registry = open_registry(self.cfg.registry)
                if self.cfg.signing_key:
                    from kdn.registry.signing import Signer

                    self.registry.signer = Signer.load(self.cfg.signing_key)
            self.saver = Saver(cfg=self.cfg, model_id=self.model_id, worker=self.worker, n_layers=n_layers,
                               kind="hybrid" if self.hybrid else "kv", bridge=self.bridge, registry=self.registry)

    def _worker(self) -> WorkerSide:
        """The worker role's side: vLLM calls worker methods on the worker's connector only."""
        if self.worker is None:
            raise RuntimeError("KDN connector: a worker-role call on the scheduler's connector")
        return self.worker

    def _sched(self) -> SchedulerSide:
        """The scheduler role's side (likewise)."""
        if self.sched is None:
            raise RuntimeError("KDN connector: a scheduler-role call on a worker's connector")
        return self.sched

    # --- worker ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.saver is not None:
            self.saver.check_layouts()  # the caches exist now; refuse to start if K/V cannot be read back

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KDNMetadata)
        if meta.loads or meta.blends:
            self._worker().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.saver is not None:
            meta = self._get_connector_metadata()
            self.saver.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker().end_step()
        if self.saver is not None:
            meta = self._get_connector_metadata()
            self._worker().saved(self.saver.finish_step(meta))

    def get_block_ids_with_load_errors(self) -> set[int]:
        rerun = self.steerer.take_rerun() if self.steerer is not None else set()
        return self._worker().bad_blocks() | rerun

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        done, failed = self._worker().transfer_results()
        return compat.KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_kv_connector_stats(self) -> KDNStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        return self.sched.take_stats() if self.sched is not None else None  # the load planner's choices

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KDNStats | None:
        return KDNStats(data=dict(data)) if data else KDNStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KDNPromMetrics:
        return KDNPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler ---------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.sched is not None:
            self.sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        return self._sched().hit_sources(request, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().step_done(connector_output)
        if connector_output.failed_recving:
            self._sched().load_failed(set(connector_output.failed_recving))

    def build_connector_meta(self, scheduler_output: Any) -> KDNMetadata:
        return self._sched().build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched().finished(request)
        return False, None  # saves finish inside the step, loads are reported through get_finished

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(request, [])

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads inside the forward wait in each attention layer (wait_for_layer_load): a captured
        # CUDA graph would skip those waits on replay. Background loads never wait there. Steering
        # recomputes rows in Python after each attention kernel: a captured full graph would skip that too.
        # A producer saves inside the forward (save_kv_layer), which a captured full graph would skip too.
        extra = extra_config or {}
        return extra.get("load", "auto") != "async" or bool(extra.get("steer")) or bool(extra.get("store"))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # --- both --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.bridge is not None:
            async def _close() -> None:
                if self.client is not None:
                    await self.client.close()
                    if self.client.host is not None:
                        await self.client.host.close()
                if self.registry is not None:
                    await self.registry.close()

            self.bridge.close(_close)
            self.bridge = None


async def _make_client(cfg: ConnectorConfig):
    from kdn.auth import read_token
    from kdn.client import KDNClient

    # The client's own per-request timeout is a backstop behind the load deadline, not a second one
    # racing it: a stalled edge is the worker's "timeout" (it cancels the fetch), never a "missing".
    from kdn.kernels.pinned import host_arena

    # Bodies land in reused (on a CUDA host, page-locked) buffers, handed back once written into the cache.
    kw: dict[str, Any] = dict(token=read_token(cfg.token_file), quality=cfg.quality, ca=cfg.ca,
                              timeout=cfg.load_timeout * 1.5 + 1, trusted_keys=cfg.trusted_keys,
                              arena=host_arena(cfg.arena))
    kw["host"] = await _connect_host(cfg, kw["token"])
    if cfg.edges or cfg.origin:
        return KDNClient(edges=list(cfg.edges), origin=cfg.origin, **kw)
    from kdn.registry import open_registry

    assert cfg.registry and cfg.region  # (ConnectorConfig: edges, an origin, or a registry with its region)
    async with open_registry(cfg.registry) as reg:
        return await KDNClient.from_registry(reg, cfg.region, token_hosts=cfg.token_hosts,
                                             admitted_by=cfg.admitted_by,
                                             revoked_admissions=cfg.revoked_admissions, **kw)


async def _connect_host(cfg: ConnectorConfig, token: str | None):
    """The machine's host tier (``host``), or None: none configured. One that is not up now is tried again by
    the loads (every few seconds, ``kdn.client.hosted.RECONNECT_S``), as is one that restarts later: meanwhile
    their chunks come from the edges, as without one."""
    if cfg.host is None:
        return None
    from kdn.client.host import HostClient
    from kdn.kernels.pinned import pin_mapping
    from kdn.wire.host import HostError

    # On a CUDA machine the mapping is page-locked (read-only) each time it is mapped: copies out of it are DMAs.
    kw: dict[str, Any] = dict(token=token, timeout=cfg.load_timeout, on_map=pin_mapping)
    try:
        return await HostClient(cfg.host, **kw).connect()
    except HostError as e:
        log.warning("KDN connector: no host tier at %s yet (%s): loading from the edges until it is up", cfg.host, e)
        return HostClient.unconnected(cfg.host, **kw)
