"""One load's K/V on its way into vLLM's paged cache: each chunk decoded into per-layer staging as it lands.

A request's load used to wait for every object, then per layer decode each
chunk (930 decode calls for SmolLM2 at 8k tokens, ~90 us of bookkeeping each),
join the chunks (a fresh tensor per layer: page faults) and write. Now each
object is decoded into its place the moment it has arrived and been verified,
while the others are still on the wire, into one staging buffer of the whole
load (``[tokens, ...]`` per attention layer, K and V, the cache's dtype) taken
from the client's arena (reused across requests; page-locked on a CUDA host);
its receive buffer is handed back right after. What is left for each layer's
``wait_for_layer_load`` is one cache write of ``[n, kv_heads, head_dim]``
through the backend's own ``do_kv_cache_update``. On a GPU the layers cross
first, on the device's copy stream (``Upload``): every layer's copy issued
once the staging is whole, a few large copies (a layer's K and V in one, never
one per block), an event per layer, and layer ``j``'s wait waits for event
``j`` only, so the forward computes layer ``j`` while later layers cross.

Layout of the staging lease: for attention layer ``j`` (in ``layers`` order),
K then V, each ``[kv_heads, tokens, head_dim]`` contiguous: a chunk's tensor
``[kv_heads, n, head_dim]`` lands as one strided slice, and the ``[n, H, D]``
view the backend takes is a transpose, no copy. Layer ``j``'s K and V are one
run of bytes, and layer ``j + 1``'s follows it, unless ``order`` lays the layers
out in another order (on the CPU, the objects' own tensor order): then a raw
chunk's whole K/V region ``[2 x layers, H, n, D]`` lands by one strided copy
into ``stack`` (``fetching.ChunkLoader._copy_region``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kdn.format.objects import torch_dtype
from kdn.wire.arena import Arena, ArenaFull, Lease
from kdn.errors import KDNError
from kdn.kernels.pinned import MIN_COPY, Copies, Event, Inline, copy_stream

# Device memory one load's copies may run ahead of the forward into: as many layers as fit are copied at once
# (all of them, mostly: Llama-3-8B's 8k-token K/V is 32 MiB a layer), the rest each as soon as the forward has
# taken the layer whose slot it reuses. At least two slots: one crossing while the forward reads the other.
# (Each layer's copy lands in a transient device buffer before its write into the paged cache: vLLM leaves
# only its memory headroom for those, so the whole load on the device at once is not an option at 32k.)
AHEAD_BYTES = 256 << 20


class StagingClosed(KDNError):
    """The load this staging belonged to has ended: nothing more may be written into it."""



class Staging:
    """Per-layer host buffers for tokens ``[first, end)`` of one load."""

    def __init__(self, arena: Arena, dims: Sequence[tuple[int, int]], first: int, end: int,
                 dtype: torch.dtype, *, lazy: bool = False, order: Sequence[int] | None = None) -> None:
        """``dims``: ``(kv_heads, head_dim)`` of each attention layer, in the order ``put`` and ``kv`` name them.
        ``lazy``: the memory is taken from the arena only when a first chunk is written (``writing``): a load
        whose chunks are all read in place (the host tier's mapping, on the CPU) never takes any, and a full
        arena then fails that chunk (``ArenaFull``), not the load before it started. ``order``: the layers'
        places in memory, first to last (default: ``dims``' order; a device's ``Upload`` needs that one)."""
        assert end > first, (first, end)
        self.first, self.end, self.dtype = first, end, dtype
        n = end - first
        item = torch.empty(0, dtype=dtype).element_size()
        self._arena, self._dims, self._sizes = arena, list(dims), [h * n * d * item for h, d in dims]
        self.per_token = 2 * sum(h * d * item for h, d in dims)  # K and V bytes of one token, every layer
        self.order = tuple(order) if order is not None else tuple(range(len(self._dims)))
        assert sorted(self.order) == list(range(len(self._dims))), self.order
        at: dict[int, tuple[int, int]] = {}
        off = 0
        for j in self.order:
            at[j] = (off, 2 * self._sizes[j])
            off += 2 * self._sizes[j]
        self.spans = [at[j] for j in range(len(self._dims))]  # per layer, (offset, bytes) of its K then V in ``raw``
        self._stack: np.ndarray | None = None  # every layer's K and V, one lanes view (``stack``)
        self.lease: Lease | None = None
        self.raw = torch.empty(0, dtype=torch.uint8)  # the whole lease as bytes, once taken
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._lanes: list[tuple[np.ndarray, np.ndarray]] = []
        self._taken = False
        if not lazy:
            self._take()
        self._lock = threading.Lock()
        self._writers = 0
        self._closed = False
        self._reads: list[Event] = []  # device copies still reading this memory: waited for on release
        self._upload: Upload | None = None

    def _take(self) -> None:
        """The memory from the arena, and every layer's views of it. ``ArenaFull`` once released stagings whose
        device copies were still reading theirs have been waited for (``reap``) and it still does not fit."""
        try:
            lease = self._arena.take(2 * sum(self._sizes))
        except ArenaFull:
            if not reap(wait=True):
                raise
            lease = self._arena.take(2 * sum(self._sizes))
        self.lease, self._taken = lease, True
        raw = torch.frombuffer(lease.view, dtype=torch.uint8) if self._sizes else torch.empty(0, dtype=torch.uint8)
        self.raw = raw
        n = self.end - self.first
        for (off, _), (h, d), size in zip(self.spans, self._dims, self._sizes):
            self.k.append(raw[off:off + size].view(self.dtype).view(h, n, d))  # [H, n, D]
            self.v.append(raw[off + size:off + 2 * size].view(self.dtype).view(h, n, d))
        self._lanes = [(lanes(k), lanes(v)) for k, v in zip(self.k, self.v)]
        if self._dims and len(set(self._dims)) == 1:  # one shape: [2 x layers, H, tokens, D] in memory order
            (h, d), size = self._dims[0], 2 * sum(self._sizes)
            self._stack = lanes(raw[:size].view(self.dtype)).reshape(2 * len(self._dims), h, n, d)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the staging open while a chunk is decoded into it (a worker thread).

        Why: a load that times out or fails releases its staging while a chunk may still be decoding
        into it (the thread cannot be stopped). Released memory is the next load's; a late write into
        it would put one request's K/V into another's cache. So ``release`` only marks the staging
        closed while a writer is inside, and the last writer out hands the memory back.
        """
        with self._lock:
            if self._closed:
                raise StagingClosed("the load ended before this chunk was decoded")
            if not self._taken:  # a lazy staging's first writer takes its memory (ArenaFull: this chunk fails)
                self._take()
            self._writers += 1
        try:
            yield
        finally:
            with self._lock:
                self._writers -= 1
                free = self._closed and self._writers == 0
            if free:
                self._free()

    def put(self, j: int, view: Any, names: tuple[str, str], lo: int, hi: int, start: int) -> None:
        """Decode layer ``j``'s K and V of one object (``view``: ``kdn.format.objects.ObjectView``; tensors ``names``,
        ``[H, end - start, D]``, tokens from ``start``) for tokens ``[lo, hi)`` into their place."""
        from kdn.format.objects import to_torch

        a, b = lo - self.first, hi - self.first
        whole = (lo, hi) == (start, start + view.header.tensors[names[0]].shape[1])
        for name, full, lanes in zip(names, (self.k[j], self.v[j]), self._lanes[j]):
            info = view.header.tensors[name]
            if whole and torch_dtype(info.dtype) == self.dtype:
                view.decode_into(name, lanes[:, a:b, :])  # straight into place, strided
            else:  # a chunk that straddles the load's range, or another dtype: decode, then copy the slice
                t = to_torch(view.decode([name]))[name]  # [H, n, D]
                # The staging may have been made inside the engine's forward (inference mode): an in-place
                # update of such a tensor is allowed only in inference mode, and this runs on a worker thread.
                with torch.inference_mode():
                    full[:, a:b, :].copy_(t[:, lo - start:hi - start, :])

    def stack(self, lo: int, hi: int) -> np.ndarray | None:
        """Every layer's K and V for tokens ``[lo, hi)`` as one view ``[2 x layers, H, hi - lo, D]`` (unsigned lanes
        of the dtype's size), in memory order (``order``; per layer K then V): where a raw chunk whose K/V lie
        in that order lands by one strided copy. None where the layers differ in shape. Inside ``writing``."""
        assert self._taken, "the staging's memory is taken by its first writer"
        a, b = lo - self.first, hi - self.first
        assert 0 <= a <= b <= self.end - self.first, (lo, hi, self.first, self.end)
        return None if self._stack is None else self._stack[:, :, a:b, :]

    def runs(self, j: int, lo: int, hi: int) -> tuple[list[memoryview], list[memoryview]]:
        """Layer ``j``'s K and V memory for tokens ``[lo, hi)``, one contiguous run per head (``[hi - lo, D]``
        of ``[H, tokens, D]``): where a raw object's ``[H, n, D]`` tensors are received in place
        (``kdn.wire.scatter``), in the order its bytes come."""
        a, b = lo - self.first, hi - self.first
        assert 0 <= a <= b <= self.end - self.first, (lo, hi, self.first, self.end)
        k, v = ([memoryview(lanes[h, a:b, :].data).cast("B") for h in range(lanes.shape[0])] for lanes in self._lanes[j])
        return k, v

    def nbytes_of(self, lo: int, hi: int) -> int:
        """The K/V bytes tokens ``[lo, hi)`` fill here."""
        return max(hi - lo, 0) * self.per_token

    def kv(self, j: int, upto: int | None = None, lo: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j``'s K and V for tokens ``[lo, upto)`` (from ``first``, to ``end`` by default) as ``[n, H, D]``
        views (the backend reads strides)."""
        a, b = (self.first if lo is None else lo) - self.first, (self.end if upto is None else upto) - self.first
        return self.k[j][:, a:b].transpose(0, 1), self.v[j][:, a:b].transpose(0, 1)

    def kv_on(self, j: int, device: torch.device, dtype: torch.dtype, upto: int | None = None, lo: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j``'s K and V for tokens ``[lo, upto)`` (from ``first`` by default) as a backend's cache write
        takes them, ``[n, H, D]``.

        On the CPU: views of the staging (vLLM's CPU kernels read strides; no copy at all). On another device
        (always from ``first``: the chunks read in place are the CPU's):
        out of the load's ``Upload`` (started here if :meth:`upload` was not called), the compute stream waiting
        for this layer's copy only, reordered there into a contiguous ``[n, H, D]``: a GPU's
        ``reshape_and_cache`` reads each token's ``H x D`` values as one row, and would misread a strided view.
        """
        if device.type == "cpu":
            k, v = self.kv(j, upto, lo)
            return k.to(dtype=dtype), v.to(dtype=dtype)  # (no copy when the staging is the cache's dtype)
        assert lo is None or lo == self.first, (lo, self.first)
        if self._upload is None:
            self.upload(device)
        assert self._upload is not None
        return self._upload.layer(j, dtype, upto)

    def upload(self, device: torch.device, copies: Copies | None = None, ahead: int = AHEAD_BYTES) -> Upload:
        """Start every layer's copy onto ``device`` (on its copy stream, ``kdn.kernels.pinned.copy_stream``, unless
        ``copies`` says where): call once the staging is whole. Each copy's event is kept: :meth:`release` hands
        the memory back only once the copies reading it are done."""
        assert self._upload is None, "this load's layers are already on their way"
        assert self.order == tuple(range(len(self._dims))), "a device's copies go in layer order"
        self._upload = Upload(self, device, copies if copies is not None else copy_stream(device), ahead)
        return self._upload

    def release(self) -> None:
        """Close the staging; its memory goes back to the arena once no writer is inside (``writing``).
        Nothing may read ``k`` / ``v`` after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free = self._writers == 0
        self._upload = None  # (its device slots go back to the allocator; their copies' events are in _reads)
        if free:
            self._free()

    def _free(self) -> None:
        if any(not done.query() for done in self._reads):  # copies onto a device still read this memory:
            with _LATER_LOCK:  # handed back by ``reap`` once they have (waiting here would stall the
                _LATER.append(self)  # thread that released it: the forward's, at the end of a step)
            return
        self._reads.clear()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


class Upload:
    """A load's staged layers crossing to the device on the copy stream, ahead of the forward.

    Layers go in groups of at least ``MIN_COPY`` bytes (one layer's K and V, or several small layers after
    one another: one run of the staging's bytes, never a copy per block), each group one copy into a device
    slot and one event. As many groups as ``ahead`` bytes of slots hold are issued at once; ``layer(j)`` makes
    the compute stream wait for the event of layer ``j``'s group only, reorders the layer out of its slot into
    fresh ``[n, H, D]`` tensors, and once every layer of a group has been taken, issues the group that reuses
    its slot. The order that keeps a slot from being overwritten while it is read:

    1. group ``g`` is copied into slot ``s`` on the copy stream, event ``e_g`` marked after it;
    2. the compute stream waits for ``e_g``, then reorders ``g``'s layers out of ``s`` (queued, not run);
    3. ``follow``: the copy stream waits for all the compute stream has been given so far, those reorders
       included; only then is group ``g + slots`` copied into ``s``.

    Layers are asked for in the forward's order, each once. One asked for otherwise (its group not, or no
    longer, in its slot) is copied on the compute stream there and then: slower, never wrong.
    """

    def __init__(self, staging: Staging, device: torch.device, copies: Copies, ahead: int) -> None:
        self.staging, self.device, self.copies = staging, device, copies
        self.groups = _groups(staging.spans)  # (first layer, end layer, offset, bytes), in layer order
        self.group_of = [g for g, (a, b, _, _) in enumerate(self.groups) for _ in range(a, b)]
        size = max((n for *_, n in self.groups), default=0)
        count = min(len(self.groups), max(2, ahead // max(size, 1)))
        # Allocated on the compute stream: ``follow`` before the first copy into them (the allocator may hand
        # out memory the compute stream's queued work still uses).
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
        self.holds: list[int] = [-1] * count  # the group each slot holds (or is being copied)
        self.events: list[Event | None] = [None] * len(self.groups)
        self.taken = [0] * len(self.groups)  # layers of each group reordered out of its slot
        self.sent = 0  # groups issued, in order
        copies.follow()
        self._send()

    def _send(self) -> None:
        """Issue the next groups whose slots are free (their previous group wholly taken)."""
        while self.sent < len(self.groups):
            g = self.sent
            s = g % len(self.slots)
            before = self.holds[s]
            if before >= 0 and self.taken[before] < self.groups[before][1] - self.groups[before][0]:
                return
            _, _, off, n = self.groups[g]
            self.copies.copy(self.slots[s][:n], self.staging.raw[off:off + n])
            ev = self.copies.mark()
            self.events[g] = ev
            self.staging._reads.append(ev)
            self.holds[s] = g
            self.sent += 1

    def layer(self, j: int, dtype: torch.dtype, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j``'s K and V for tokens ``[first, upto)`` on the device, ``[n, H, D]`` contiguous in ``dtype``."""
        st = self.staging
        n = (st.end if upto is None else upto) - st.first
        g = self.group_of[j]
        s = g % len(self.slots)
        if self.holds[s] != g or self.taken[g] >= self.groups[g][1] - self.groups[g][0]:
            return self._direct(j, dtype, n)
        ev = self.events[g]
        assert ev is not None
        self.copies.wait(ev)  # this layer's group only: later layers may still be crossing
        off, size = st.spans[j]
        lo = off - self.groups[g][2]
        h, t, d = st.k[j].shape
        kv = self.slots[s][lo:lo + size].view(st.dtype).view(2, h, t, d)  # K, V: [H, tokens, D] each
        k, v = (_reordered(x[:, :n], dtype) for x in kv)
        self.taken[g] += 1
        if self.taken[g] == self.groups[g][1] - self.groups[g][0] and self.sent < len(self.groups):
            self.copies.follow()  # the reorders above are queued: the slot may be written after them
            self._send()
        return k, v

    def _direct(self, j: int, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j`` copied on the compute stream now (asked for out of order, or twice)."""
        st = self.staging
        here = Inline(self.device)
        off, size = st.spans[j]
        h, t, d = st.k[j].shape
        dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        here.copy(dev, st.raw[off:off + size])
        st._reads.append(here.mark())
        kv = dev.view(st.dtype).view(2, h, t, d)
        return _reordered(kv[0][:, :n], dtype), _reordered(kv[1][:, :n], dtype)


def _reordered(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[H, n, D]`` as a fresh contiguous ``[n, H, D]`` in ``dtype``: always a copy (a view could still read
    the slot after it is reused; with one head the transpose alone would already be contiguous)."""
    h, n, d = x.shape
    out = torch.empty((n, h, d), dtype=dtype, device=x.device)
    out.copy_(x.transpose(0, 1))
    return out


def _groups(spans: Sequence[tuple[int, int]], least: int = MIN_COPY) -> list[tuple[int, int, int, int]]:
    """Consecutive layers (``spans``: each one's adjacent ``(offset, bytes)``) grouped into copies of at least
    ``least`` bytes: ``(first layer, end layer, offset, bytes)``. A layer that is big enough is a group of its
    own; small ones join the layers after them, and a small remainder joins the group before it."""
    out: list[tuple[int, int, int, int]] = []
    for j, (off, n) in enumerate(spans):
        if out and out[-1][3] < least:
            a, _, o, _ = out[-1]
            out[-1] = (a, j + 1, o, off + n - o)
        else:
            out.append((j, j + 1, off, n))
    if len(out) > 1 and out[-1][3] < least:
        (a, _, o, _), (_, b, o2, n2) = out[-2], out[-1]
        out[-2:] = [(a, b, o, o2 + n2 - o)]
    return out


_LATER: list[Staging] = []  # released stagings whose device copies had not finished reading them
_LATER_LOCK = threading.Lock()


def reap(wait: bool = False) -> int:
    """Hand back the memory of released stagings whose device copies have finished (with ``wait``, after
    waiting for them: an arena out of room); how many went back."""
    with _LATER_LOCK:
        waiting = list(_LATER)
        _LATER.clear()
    for st in waiting:
        if wait:
            for done in st._reads:
                done.synchronize()
        st._free()  # (one still being read goes back on the list)
    with _LATER_LOCK:
        return len(waiting) - len(_LATER)


def lanes(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory as unsigned lanes of its item size (numpy has no bf16)."""
    lane = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[t.element_size()]
    return t.view(lane).numpy()


