"""The producer's worker side: chunks of a prompt, read out of vLLM's cache, as KDN objects in a store.

``save_kv_layer`` runs right after each attention layer of a step: the K/V
of the chunks that this step completes are read out of the paged cache (the
layout checked at start by ``paged.find_reader``) and kept on the host.
``wait_for_save`` runs after the whole forward: for a hybrid model it adds
each gated-delta-net layer's state from the block the scheduler named, then
encodes one object per chunk and encoding (the same header, address and
digest contract as the transformers producer) and writes it atomically into
the origin's store folder. With a ``registry`` setting it also records each
object (and a partial last chunk as its parent's tail), blob first.
"""

from __future__ import annotations

import logging

import torch

from kdn.format.address import Address, ModelId
from kdn.errors import KDNError
from kdn.format.store import BlobDir

from kdn.adapters.vllm import compat, paged
from kdn.adapters.vllm.meta import KDNMetadata, SaveChunk, SaveJob

log = logging.getLogger("kdn.adapters.vllm")


class Saver:
    def __init__(self, *, cfg, model_id: ModelId, worker, n_layers: int, kind: str, bridge=None, registry=None) -> None:
        self.cfg = cfg
        self.model_id = model_id
        self.worker = worker  # the WorkerSide: its layer index and attention group
        self.n_layers = n_layers
        self.kind = kind
        self.store = BlobDir(cfg.store, fsync=True)
        self.bridge = bridge
        self.registry = registry
        self.readers: dict[str, paged.Reader] = {}
        self._held: dict[tuple[str, Address], dict[str, torch.Tensor]] = {}  # (req, address) -> tensors so far

    def check_layouts(self) -> None:
        """Find, for every attention layer, how to read K/V back; refuse to start if we cannot."""
        found: dict[tuple, tuple[str, paged.Reader]] = {}
        for name, layer in self.worker.attn.items():
            cache = layer.module.kv_cache
            key = (tuple(cache.shape), cache.dtype, type(layer.module.impl), getattr(layer.module, "isa", None))
            if key not in found:
                found[key] = paged.find_reader(layer.module, cache, layer.kv_heads, layer.head_dim)
                log.info("KDN producer reads %s K/V as %s", name, found[key][0])
            self.readers[name] = found[key][1]

    def save_layer(self, meta: KDNMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self.worker.attn.get(layer_name)
        if layer is None or not meta.saves:
            return
        read = self.readers[layer_name]
        bs = self.worker.block_size
        for job in meta.saves:
            table = job.block_ids[self.worker.attn_group]
            for c in job.chunks:
                slot = paged.slots(table, c.start, c.end, bs, kv_layer.device)
                k, v = read(kv_layer, slot)  # [n, H, D]
                held = self._held.setdefault((job.req_id, c.address), {})
                held[f"L{layer.index}.k"] = k.transpose(0, 1).to("cpu", copy=True).contiguous()  # [H, n, D]
                held[f"L{layer.index}.v"] = v.transpose(0, 1).to("cpu", copy=True).contiguous()

    def finish_step(self, meta: KDNMetadata) -> int:
        """Write this step's chunks; the number written."""
        written = 0
        for job in meta.saves:
            for i, c in enumerate(job.chunks):
                tensors = self._held.pop((job.req_id, c.address), None)
                if tensors is None or len(tensors) != 2 * len(self.worker.attn):
                    log.error("request %s: chunk [%d, %d) was not read from every layer: not saved",
                              job.req_id, c.start, c.end)
                    continue
                if i == len(job.chunks) - 1 and job.state_blocks:
                    for s in self.worker.states:
                        conv, ssm = compat.read_gdn_state(s.module, job.state_blocks[s.group])
                        tensors[f"L{s.index}.conv"], tensors[f"L{s.index}.ssm"] = conv, ssm
                try:
                    self._write(job, c, tensors)
                    written += 1
                except Exception:  # noqa: BLE001 -- a failed save is a future miss, never the engine's failure
                    log.exception("request %s: saving chunk [%d, %d) failed", job.req_id, c.start, c.end)
        return written

    def _write(self, job: SaveJob, c: SaveChunk, tensors: dict[str, torch.Tensor]) -> None:
        from kdn.kernels import encode_as
        from kdn.format.objects import from_torch

        raw = from_torch(tensors)
        for enc in job.encodings:
            if self.store.size(c.address, enc) is None:  # never rewrite a stored blob: edges may hold its digest
                blob = encode_as(enc, n_layers=self.n_layers, kind=self.kind, address=c.address, model_id=self.model_id,
                                 namespace=job.namespace, start=c.start, end=c.end, position=c.start, parent=c.parent,
                                 tensors=raw)
                from kdn.format.address import blob_digest

                self.store.put(c.address, enc, blob, digest=blob_digest(blob))
        if self.registry is not None:
            self.bridge.run(self._record(job, c), timeout=30)

    async def _record(self, job: SaveJob, c: SaveChunk) -> None:
        from kdn.format.address import blob_digest
        from kdn.format.pieces import PIECE_BYTES, piece_digests
        from kdn.registry import Encoding, ObjectRecord

        encs = {}
        for enc in job.encodings:
            data = self.store.read(c.address, enc)
            if data is None:  # (written just above; gone only if something removed it meanwhile)
                raise KDNError(f"chunk {c.address[:16]} ({enc}) left the store before its record was written")
            pieces = piece_digests(data)  # from the same bytes as the whole digest (kdn/format/pieces.py)
            encs[enc] = Encoding(enc, len(data), blob_digest(data), PIECE_BYTES if pieces else 0, pieces)
        rec = ObjectRecord(address=c.address, model_id=self.model_id, namespace=job.namespace, kind=self.kind,
                           start=c.start, end=c.end, parent=c.parent, standalone=False, encodings=encs,
                           origin=self.cfg.node_id, engine=compat.ENGINE)
        await self.registry.put_objects([rec])
        if c.parent is not None and c.end - c.start < self.cfg.chunk_tokens:
            await self.registry.add_tail(c.parent, c.end - c.start, c.address)
