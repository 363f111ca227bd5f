"""Where a ``CacheBuilder``'s K/V live, and how they cross to a device.

Split from ``cache.py`` (the builder): how the memory is laid out and owned (host tensors from the arena, or
one stack per device), how a chunk's bytes are copied onto the device (``copy_chunk``: one copy of its K/V
region and one placing every layer; ``copy_layers``: held chunks layer after layer, an event per layer), and
how the forward waits for them (``LayerWaits``: a pre-hook per decoder layer), not how chunks land.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from kdn.adapters.hf.extract import LayerSpec
from kdn.kernels.pinned import MIN_COPY, Copies, Event

if TYPE_CHECKING:  # pragma: no cover
    from kdn.wire.arena import Arena, Lease


def device_tensors(layout: list[LayerSpec], order: Sequence[str], tokens: int, device: torch.device
                    ) -> tuple[torch.Tensor | None, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Each attention layer's ``[1, kv_heads, tokens, head_dim]`` K and V on the device. When every layer
    has one shape and dtype they are slices of one ``[2 x layers, kv_heads, tokens, head_dim]`` stack, in
    ``order`` (the order an object stores them in): a chunk's K/V region is then placed by one copy."""
    specs = [s for s in layout if s.kv and s.kv_dtype is not None]
    if len({(s.kv, s.kv_dtype) for s in specs}) != 1:
        return None, {s.index: (torch.empty((1, s.kv[0], tokens, s.kv[1]), dtype=s.kv_dtype, device=device),
                                torch.empty((1, s.kv[0], tokens, s.kv[1]), dtype=s.kv_dtype, device=device))
                      for s in specs if s.kv is not None}
    heads, dim = cast(tuple[int, int], specs[0].kv)
    stack = torch.empty((len(order), heads, tokens, dim), dtype=specs[0].kv_dtype, device=device)
    slot = {nm: p for p, nm in enumerate(order)}
    return stack, {s.index: (stack[slot[f"L{s.index}.k"]][None], stack[slot[f"L{s.index}.v"]][None]) for s in specs}


def kv_tensors(layout: list[LayerSpec], order: Sequence[str], tokens: int, arena: Arena | None
               ) -> tuple[torch.Tensor | None, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Each attention layer's ``[1, kv_heads, tokens, head_dim]`` K and V on the host, fresh or in one arena
    lease; when every layer has one shape and dtype, slices of one ``[2 x layers, kv_heads, tokens, head_dim]``
    stack in ``order`` (the order an object stores them in, as ``device_tensors``'): a raw chunk then lands by
    one copy of its K/V region (``CacheBuilder``), not one per tensor.

    Fresh memory pays for every page on first touch: for SmolLM2 at 8k tokens (189 MB) writing into fresh
    tensors took 70-84 ms against 17-26 ms reused, here. From an arena, the tensors are views of one
    buffer; the lease goes back when the last of them is garbage (the engine's cache dropped them: at the
    end of the generation, or at its first new token past the builder's room, where the layer concatenates
    into fresh memory), never while a view lives.
    """
    specs = [(s.index, s.kv, s.kv_dtype) for s in layout if s.kv and s.kv_dtype is not None]
    sizes = [kv[0] * tokens * kv[1] * torch.empty(0, dtype=dt).element_size() for _, kv, dt in specs]
    if arena is None:
        base = torch.empty(2 * sum(sizes), dtype=torch.uint8)
    else:
        lease = arena.take(2 * sum(sizes))
        # torch keeps the numpy array its storage was made from alive until the storage dies (every view of it,
        # however derived); the array's finalizer hands the lease back then. (A finalizer on the base tensor
        # would fire at once: views hold the storage, not the tensor object.)
        owner = np.frombuffer(lease.view, dtype=np.uint8)
        weakref.finalize(owner, lease.release)
        base = torch.from_numpy(owner)
        del owner
    if len({(kv, dt) for _, kv, dt in specs}) == 1:
        _, (heads, dim), dt = specs[0]
        stack = base.view(dt).view(len(order), heads, tokens, dim)
        slot = {nm: p for p, nm in enumerate(order)}
        return stack, {i: (stack[slot[f"L{i}.k"]][None], stack[slot[f"L{i}.v"]][None]) for i, _, _ in specs}
    out, off = {}, 0
    for (i, kv, dt), size in zip(specs, sizes):
        pair = []
        for _ in range(2):
            pair.append(base[off:off + size].view(dt).view(1, kv[0], tokens, kv[1]))
            off += size
        out[i] = (pair[0], pair[1])
    return None, out


def lanes(t: torch.Tensor) -> Any:
    """A numpy view of ``t``'s memory as unsigned integers of its item size (any strides; numpy has no bf16)."""
    lane = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[t.element_size()]
    return t.view(lane).numpy()


# --- onto the device ------------------------------------------------------------------------------------------


@dataclass
class Region:
    """One chunk's K/V bytes in host memory, in the objects' tensor order: ``where`` each tensor lies in
    ``host`` (uint8), its dtype, and the chunk's tokens ``[off, off + n)``. ``lease``: the arena buffer it was
    decoded into (a compressed chunk), handed back once the copies reading it are done."""

    host: torch.Tensor  # [bytes] uint8, page-locked where the memory is
    where: dict[str, tuple[int, int]]
    dtypes: dict[str, torch.dtype]
    n: int
    off: int
    lease: Lease | None = None


@dataclass
class Placement:
    """Where a builder's K/V are on the device: ``full`` per attention layer (``[1, H, S + room, D]``), and when
    every layer has one shape and dtype, the ``[2 x layers, H, S + room, D]`` ``stack`` they are slices of, in
    ``order`` (the objects' tensor order)."""

    layout: list[LayerSpec]
    order: Sequence[str]
    stack: torch.Tensor | None
    full: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def slot(self, name: str) -> int:
        return self.order.index(name)


def copy_chunk(copies: Copies, c: Region, into: Placement) -> int:
    """One chunk onto the device, whole: where its K/V region is the stack's tensors back to back (one dtype),
    one copy of the region into its slice of the stack (torch lands it in a contiguous buffer on the device,
    then places every layer's slice there: two device copies, whatever the layer count); else one copy per
    tensor. The device copies issued (``_ops``). (Nothing is allocated on the calling thread's stream, so the copy stream
    need not wait for it: another request's forward there does not hold this load's copies back.)"""
    first = into.order[0]
    size = c.where[first][1] - c.where[first][0]
    if (into.stack is not None and len(set(c.dtypes.values())) == 1
            and all(c.where[nm] == (p * size, (p + 1) * size) for p, nm in enumerate(into.order))):
        _, heads, _, dim = into.stack.shape
        src = c.host[:len(into.order) * size].view(c.dtypes[first]).view(len(into.order), heads, c.n, dim)
        dst = into.stack[:, :, c.off:c.off + c.n, :]
        copies.copy(dst, src)  # every layer's K and V: one copy over
        return _ops(dst)
    issued = 0
    for s in into.layout:
        if not s.kv:
            continue
        heads, dim = s.kv
        for x, full in zip(("k", "v"), into.full[s.index]):
            nm = f"L{s.index}.{x}"
            a, b = c.where[nm]
            dst = full[0, :, c.off:c.off + c.n, :]
            copies.copy(dst, c.host[a:b].view(c.dtypes[nm]).view(heads, c.n, dim))
            issued += _ops(dst)
    return issued


def _ops(dst: torch.Tensor) -> int:
    """The device copies one copy into ``dst`` makes: torch lands a host tensor bound for a strided destination
    in a contiguous device buffer first, then places it there."""
    return 1 if dst.is_contiguous() else 2


def layer_bytes(c: Region, into: Placement) -> int:
    """The smallest one layer's K and V of chunk ``c`` come to: what a layer-after-layer copy of it moves."""
    return min((sum(b - a for a, b in (c.where[f"L{s.index}.k"], c.where[f"L{s.index}.v"]))
                for s in into.layout if s.kv), default=0)


def copy_layers(copies: Copies, chunks: Sequence[Region], into: Placement) -> tuple[dict[int, Event], int]:
    """Held chunks onto the device layer after layer, in the forward's order: for each attention layer every
    chunk's K and V of it (one copy each where they lie side by side in the host and in the stack, at least
    ``MIN_COPY`` bytes: ``layer_bytes``), then an event. The forward can start on layer 0 while the later
    layers cross. ``(attention layer index -> its event, device copies issued)``."""
    events: dict[int, Event] = {}
    issued = 0
    for s in into.layout:
        if not s.kv:
            continue
        heads, dim = s.kv
        nk, nv = f"L{s.index}.k", f"L{s.index}.v"
        for c in chunks:
            (ka, kb), (va, vb) = c.where[nk], c.where[nv]
            if (into.stack is not None and kb == va and into.slot(nv) == into.slot(nk) + 1
                    and c.dtypes[nk] == c.dtypes[nv] == into.stack.dtype):
                p = into.slot(nk)
                src = c.host[ka:vb].view(c.dtypes[nk]).view(2, heads, c.n, dim)  # [K/V, H, n, D]
                dst = into.stack[p:p + 2, :, c.off:c.off + c.n, :]
                copies.copy(dst, src)
                issued += _ops(dst)
                continue
            for nm, full in zip((nk, nv), into.full[s.index]):
                a, b = c.where[nm]
                dst = full[0, :, c.off:c.off + c.n, :]
                copies.copy(dst, c.host[a:b].view(c.dtypes[nm]).view(heads, c.n, dim))
                issued += _ops(dst)
        events[s.index] = copies.mark()
    return events, issued


def upload(copies: Copies, chunks: Sequence[Region], into: Placement) -> tuple[dict[int, Event], int]:
    """Held chunks onto the device: layer after layer (``copy_layers``) where every chunk's layer is at least
    ``MIN_COPY`` bytes, else chunk after chunk (``copy_chunk``: fewer, larger copies), every layer's event then
    the last one. ``(attention layer index -> its event, copies issued)``."""
    if all(layer_bytes(c, into) >= MIN_COPY for c in chunks):
        return copy_layers(copies, chunks, into)
    issued = sum(copy_chunk(copies, c, into) for c in chunks)
    ev = copies.mark()
    return {s.index: ev for s in into.layout if s.kv}, issued


def decoder_layers(model: Any, count: int) -> torch.nn.ModuleList | None:
    """The model's decoder layers (``model.model.layers``), where they are one per cache layer; else None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) == count else None


class LayerWaits:
    """The forward waits for each decoder layer's copies just before that layer runs, and for nothing else.

    A forward pre-hook on decoder layer ``i`` makes the compute stream wait for layer ``i``'s event (the host
    does not wait) and removes itself: once the forward has passed every layer, nothing is left on the model.
    A forward with another cache (another request on the same model) is not this load's: its hooks do not
    fire for it, and stay for this load's own forward. One whose cache cannot be told (no ``past_key_values``
    argument) waits too, harmlessly, and leaves the hooks in place. If the cache is dropped unused, its hooks
    go with it. A model whose decoder layers cannot be found waits for every event at once, here.
    """

    def __init__(self, model: Any, cache: Any, count: int, events: Mapping[int, Event], copies: Copies) -> None:
        self.copies = copies
        self.handles: dict[int, Any] = {}
        self._cache = weakref.ref(cache)
        layers = decoder_layers(model, count)
        if layers is None:
            for ev in {id(e): e for e in events.values()}.values():
                copies.wait(ev)
            return
        for i, ev in events.items():
            self.handles[i] = layers[i].register_forward_pre_hook(functools.partial(self._before, i, ev),
                                                                  with_kwargs=True)
        weakref.finalize(cache, LayerWaits._drop, self.handles)

    def _before(self, i: int, ev: Event, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and cache is not self._cache():
            return  # another request's forward
        self.copies.wait(ev)
        if cache is not None:
            handle = self.handles.pop(i, None)
            if handle is not None:
                handle.remove()

    @property
    def pending(self) -> int:
        """Decoder layers whose wait has not run yet."""
        return len(self.handles)

    @staticmethod
    def _drop(handles: dict[int, Any]) -> None:
        for h in handles.values():
            h.remove()
        handles.clear()

    def remove(self) -> None:
        LayerWaits._drop(self.handles)


def decode_region(view: Any, order: Sequence[str], arena: Arena | None) -> tuple[torch.Tensor, dict[str, tuple[int, int]], Any]:
    """A compressed chunk's K/V decoded on the host into one buffer (from the arena when there is one), in
    ``order``: the buffer as bytes, each tensor's span in it, and the lease to hand back."""
    from kdn.format.codecs import itemsize

    h = view.header
    sizes = {nm: math.prod(h.tensors[nm].shape) * itemsize(h.tensors[nm].dtype) for nm in order}
    total = sum(sizes.values())
    lease = arena.take(total) if arena is not None else None
    buf = lease.view if lease is not None else memoryview(bytearray(total))
    where, pos = {}, 0
    for nm in order:
        info = h.tensors[nm]
        lane = np.dtype(f"<u{itemsize(info.dtype)}")
        view.decode_into(nm, np.frombuffer(buf[pos:pos + sizes[nm]], dtype=lane).reshape(info.shape))
        where[nm] = (pos, pos + sizes[nm])
        pos += sizes[nm]
    host = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    return host, where, lease
