"""The connector's worker side: fetch, verify, decode and write KDN states into vLLM's cache.

Two ways to load, chosen per model by the connector (``load`` setting):

- **inside the forward** (attention-only models, the default): ``start_load_kv``
  starts every fetch of the step; each attention layer's ``wait_for_layer_load``
  waits for them once (bounded by ``load_timeout``), then decodes and writes
  only that layer's K/V, so the cost of decoding is spread over the layers and
  the first layers never wait for the last ones' bytes to be decoded. A piece
  that fails marks its blocks (and every later block of the request) in
  ``get_block_ids_with_load_errors``; vLLM recomputes from there.
- **between steps** (hybrid models, always: vLLM refuses block-level errors
  with several KV cache groups, and a state written during the forward would
  be copied over first): a background thread fetches, writes every layer and
  the state at the load point, then reports the request finished, or failed
  (vLLM then recomputes it whole), in ``get_transfer_results``. A request
  aborted meanwhile is still reported when its load ends, so that vLLM frees
  its blocks then and never earlier.

Everything fetched is verified against the digest of its record before it is
decoded, and every header is checked against what the plan expects (address,
model, namespace, span, tensor shapes) before a byte is written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kdn.errors import DigestMismatch, KDNError, SourceError

from kdn.adapters.vllm import compat, paged
from kdn.adapters.vllm.meta import KDNMetadata, LoadJob
from kdn.adapters.vllm.plan import Piece, blocks_of
from kdn.adapters.vllm.stats import KDNStats

log = logging.getLogger("kdn.adapters.vllm")


class LoadFailed(KDNError):
    def __init__(self, reason: str, piece: Piece | None, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.piece = piece


@dataclass(frozen=True)
class AttnLayer:
    name: str
    index: int  # transformers' layer index: names L{index}.k / .v in objects
    module: Any
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StateLayer:
    name: str
    index: int
    group: int
    module: Any


@dataclass
class _Running:
    """One in-forward load: its fetches, then its decoded objects as the layers ask for them."""

    job: LoadJob
    fetches: list[concurrent.futures.Future]
    fetched: list[Any] | None = None  # kdn.client.Fetched, in plan order, as far as they arrived
    views: list[Any] = field(default_factory=list)  # kdn.objects.ObjectView of each, header checked
    ahead: dict[str, concurrent.futures.Future] = field(default_factory=dict)  # layer name -> its decoded K/V
    error: LoadFailed | None = None
    upto: int = -1  # tokens [plan.first, upto) are still being written; a failure lowers it
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if self.upto < 0:
            self.upto = self.job.plan.end

    def spans(self) -> list[tuple[int, Piece, int, int]]:
        """``(i, piece, lo, hi)`` of the pieces that still write tokens."""
        return [(i, p, lo, min(hi, self.upto)) for i, (p, lo, hi) in enumerate(self.job.plan.spans()) if lo < self.upto]


class WorkerSide:
    def __init__(self, *, cfg, model_id: str, groups: list, bridge, client, device: torch.device) -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.groups = groups
        self.bridge = bridge
        self.client = client
        self.device = device
        self.attn: dict[str, AttnLayer] = {}
        self.states: list[StateLayer] = []
        self.attn_group = next((g.id for g in groups if g.kind == "attention"), None)
        self.block_size = groups[self.attn_group].block_size if self.attn_group is not None else 0
        self.stats = KDNStats()  # since vLLM last took them (its logger and /metrics)
        self.totals = KDNStats()  # since start (tests, health reports)
        self._lock = threading.Lock()
        self._running: list[_Running] = []
        self._bad_blocks: set[int] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-load")
        # Decodes layer i+1 while the engine writes (and computes) layer i: codec work and cache writes
        # both run outside the GIL, so on two cores the load takes about the longer of the two.
        self._decoder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdn-decode")
        import kdn.kernels  # noqa: F401  (registers the lossy codecs a quality budget may pick)

    def register(self, layers: dict[str, Any]) -> None:
        """Index the model's attention and state layers by the names objects use."""
        for g in self.groups:
            for name in g.layers:
                mod = layers[name]
                idx = compat.layer_index(name)
                if g.kind == "attention":
                    self.attn[name] = AttnLayer(name, idx, mod, *compat.attention_dims(mod))
                else:
                    if not compat.is_gdn(mod):
                        raise compat.ModelMismatch(f"layer {name} is a {type(mod).__name__}: the KDN connector "
                                                   "loads gated-delta-net states only")
                    self.states.append(StateLayer(name, idx, g.id, mod))

    def _max_decoded(self, n_tokens: int) -> int:
        """The most an object of ``n_tokens`` for this model can decode to (fp32 at worst, aligned)."""
        per_token = sum(2 * a.kv_heads * a.head_dim * 4 for a in self.attn.values())
        states = sum(4 * t.numel() // max(t.shape[0], 1) for s in self.states for t in s.module.kv_cache)
        return per_token * n_tokens + 2 * states + 64 * (2 * len(self.attn) + 2 * len(self.states))

    # --- load --------------------------------------------------------------------------------

    def start(self, meta: KDNMetadata) -> None:
        for job in meta.loads:
            if job.background:
                self._pool.submit(self._load_in_background, job)
            else:
                self._running.append(_Running(job, [self._fetch(p) for p in job.plan.pieces]))

    def _fetch(self, p: Piece) -> concurrent.futures.Future:
        return self.bridge.submit(self._fetch_one(p))

    async def _fetch_one(self, p: Piece) -> tuple[Any, int | None]:
        """The verified object, and what its decode may allocate when a codec says more than the default
        (a kvtc object: its model's basis is fetched, verified and registered first, once per basis)."""
        f = await self.client.fetch(p.address, encoding=p.encoding, digest=p.digest, size=p.size)
        return f, await self.client.prepare(f, p.end - p.start)

    def wait_layer(self, layer_name: str) -> None:
        layer = self.attn.get(layer_name)
        if layer is None or not self._running:
            return
        for run in self._running:
            if run.fetched is None:
                self._collect(run)
            # Tokens before a failed piece are still loaded: vLLM keeps the blocks before the first
            # bad one, so every layer must hold them. Each failure lowers ``upto``: this ends.
            while run.upto > run.job.plan.first:
                try:
                    self._write_layer(run, layer)
                    break
                except LoadFailed as e:
                    self._fail(run, e)

    def _collect(self, run: _Running) -> None:
        """Wait for a load's fetches (what is left of its deadline), open and check each object."""
        from kdn.objects import ObjectView

        deadline = run.started + self.cfg.load_timeout
        run.fetched = []
        for p, fut in zip(run.job.plan.pieces, run.fetches):
            try:
                f, cap = fut.result(max(deadline - time.perf_counter(), 0))
            except concurrent.futures.TimeoutError:
                self._fail(run, LoadFailed("timeout", p, f"{p.address[:16]} not fetched within {self.cfg.load_timeout:g} s"))
                break
            except DigestMismatch as e:
                self._fail(run, LoadFailed("digest", p, str(e)))
                break
            except (SourceError, OSError, KDNError) as e:
                self._fail(run, LoadFailed("missing", p, str(e)))
                break
            except Exception as e:  # noqa: BLE001 -- a bad header or basis record (bytes from the network):
                # this request recomputes, the engine's step goes on
                self._fail(run, LoadFailed("decode", p, f"{type(e).__name__}: {e}"))
                break
            try:
                # Bounded before a byte is decoded: at most what this model's chunk of that length holds.
                view = ObjectView(f.blob, max_decoded=max(self._max_decoded(p.end - p.start), cap or 0))
            except KDNError as e:
                self._fail(run, LoadFailed("decode", p, str(e)))
                break
            h = view.header
            bad = next((f"L{a.index}.{x}" for a in self.attn.values() for x in ("k", "v")
                        if getattr(h.tensors.get(f"L{a.index}.{x}"), "shape", None) != (a.kv_heads, p.end - p.start,
                                                                                       a.head_dim)), None)
            if bad is not None:
                self._fail(run, LoadFailed("mismatch", p, f"{bad} is missing or not this model's shape"))
                break
            if (h.address, h.model_id, h.namespace, h.start, h.end) != (p.address, self.model_id, self.cfg.namespace,
                                                                        p.start, p.end):
                self._fail(run, LoadFailed("mismatch", p, f"object {h.address[:16]} [{h.start}, {h.end}) of "
                                           f"{h.model_id[:12]}/{h.namespace} is not the one asked for"))
                break
            run.fetched.append(f)
            run.views.append(view)
        for fut in run.fetches[len(run.fetched):]:
            fut.cancel()
        if run.views:
            for layer in sorted(self.attn.values(), key=lambda a: a.index):  # the order the forward asks for them
                run.ahead[layer.name] = self._decoder.submit(self._decode_layer, run, layer)

    def _fail(self, run: _Running, e: LoadFailed) -> None:
        run.error = e
        job = run.job
        first = max(e.piece.start, job.plan.first) if e.piece else job.plan.first
        run.upto = min(run.upto, first)
        log.warning("KDN load of %s stopped at token %d (%s); vLLM recomputes", job.req_id, first, e)
        with self._lock:
            for st in (self.stats, self.totals):
                st.failed(e.reason)
            if not job.background:
                # In-forward loads fail by block: vLLM recomputes from the first bad one. A background
                # load fails as a whole request (vLLM takes no block errors with several cache groups).
                table = job.block_ids[self.attn_group]
                self._bad_blocks.update(table[i] for i in blocks_of(first, job.plan.end, self.block_size))

    def bad_blocks(self) -> set[int]:
        out, self._bad_blocks = self._bad_blocks, set()
        return out

    def end_step(self) -> None:
        """After the forward: account for this step's in-forward loads."""
        for run in self._running:
            if run.upto > run.job.plan.first:
                self._account(run)
        self._running = []

    def _account(self, run: _Running) -> None:
        seconds = time.perf_counter() - run.started
        with self._lock:
            for st in (self.stats, self.totals):
                st.data["loads"] += 1
                st.data["seconds"].append(seconds)
                for i, _, lo, hi in run.spans():
                    f = run.fetched[i]
                    st.loaded(f.source.split("/")[-1].split(":")[0], hi - lo)
                    st.fetched(f.encoding, len(f.blob))
            del self.totals.data["seconds"][:-1024]

    # --- decode and write --------------------------------------------------------------------

    @staticmethod
    def _tensors(run: _Running, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        from kdn.objects import to_torch

        try:
            return to_torch(run.views[i].decode(names))
        except Exception as e:  # noqa: BLE001 -- a codec or shape error in bytes that came over the network
            raise LoadFailed("decode", run.job.plan.pieces[i], f"{type(e).__name__}: {e}") from None

    def _decode_layer(self, run: _Running, layer: AttnLayer) -> list[tuple[torch.Tensor, torch.Tensor] | LoadFailed]:
        """Layer ``layer``'s K/V ``[kv_heads, n, head_dim]`` of each piece, in order, up to the first bad one."""
        names = [f"L{layer.index}.k", f"L{layer.index}.v"]
        out: list = []
        for i, p in enumerate(run.job.plan.pieces[:len(run.views)]):
            try:
                t = self._tensors(run, i, names)
                k, v = t[names[0]], t[names[1]]
                want = (layer.kv_heads, p.end - p.start, layer.head_dim)
                if tuple(k.shape) != want or tuple(v.shape) != want:
                    raise LoadFailed("mismatch", p, f"{names[0]} is {tuple(k.shape)}, the engine wants {want}")
            except LoadFailed as e:
                out.append(e)
                break
            out.append((k, v))
        return out

    def _write_layer(self, run: _Running, layer: AttnLayer) -> None:
        """Write the load's token range of layer ``layer``, piece by piece, as its decode comes in."""
        left = max(run.started + self.cfg.load_timeout - time.perf_counter(), 0)
        try:
            decoded = run.ahead[layer.name].result(left)
        except concurrent.futures.TimeoutError:
            raise LoadFailed("timeout", run.job.plan.pieces[0], f"decoding ran past {self.cfg.load_timeout:g} s") from None
        cache = layer.module.kv_cache
        ks, vs = [], []
        for i, p, lo, hi in run.spans():
            got = decoded[i] if i < len(decoded) else LoadFailed("decode", p, "not decoded")
            if isinstance(got, LoadFailed):
                raise got
            ks.append(got[0][:, lo - p.start:hi - p.start])
            vs.append(got[1][:, lo - p.start:hi - p.start])
        # One write per layer (a backend write has a fixed cost per call, ~0.1 ms here): the pieces joined
        # [H, n, D], then handed over as a [n, H, D] view -- the backend's write reads strides.
        k = torch.cat(ks, dim=1).transpose(0, 1).to(device=cache.device, dtype=cache.dtype)
        v = torch.cat(vs, dim=1).transpose(0, 1).to(device=cache.device, dtype=cache.dtype)
        slot = paged.slots(run.job.block_ids[self.attn_group], run.job.plan.first, run.upto, self.block_size,
                           cache.device)
        paged.write(layer.module, cache, k, v, slot)

    def _write_states(self, run: _Running) -> None:
        """The conv and recurrent state at the load point, into each state layer's block for it."""
        job = run.job
        last = len(job.plan.pieces) - 1
        t = self._tensors(run, last, [n for s in self.states for n in (f"L{s.index}.conv", f"L{s.index}.ssm")])
        for s in self.states:
            block = job.block_ids[s.group][job.plan.end // self.groups[s.group].block_size - 1]
            try:
                compat.write_gdn_state(s.module, block, t[f"L{s.index}.conv"], t[f"L{s.index}.ssm"])
            except compat.ModelMismatch as e:
                raise LoadFailed("mismatch", job.plan.last, str(e)) from None

    # --- background loads (hybrid) -----------------------------------------------------------

    def _load_in_background(self, job: LoadJob) -> None:
        run = _Running(job, [self._fetch(p) for p in job.plan.pieces])
        try:
            self._collect(run)
            if run.error is None:  # a background load is all or nothing
                for layer in self.attn.values():
                    self._write_layer(run, layer)
                if self.states:
                    self._write_states(run)
        except LoadFailed as e:
            self._fail(run, e)
        except Exception as e:  # noqa: BLE001 -- never leave vLLM waiting on a request: report it failed
            log.exception("KDN background load of %s", job.req_id)
            self._fail(run, LoadFailed("decode", None, f"{type(e).__name__}: {e}"))
        if run.error is None:
            self._account(run)
        with self._lock:
            (self._done if run.error is None else self._failed).add(job.req_id)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)`` background loads since the last call (failed ones are in both)."""
        with self._lock:
            done, failed = self._done | self._failed, set(self._failed)
            self._done, self._failed = set(), set()
        return done, failed

    def saved(self, n: int) -> None:
        with self._lock:
            for st in (self.stats, self.totals):
                st.data["saved"] += n

    def take_stats(self) -> KDNStats | None:
        with self._lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, KDNStats()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._decoder.shutdown(wait=True, cancel_futures=True)
