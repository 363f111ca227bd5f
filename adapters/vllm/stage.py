"""One load's K/V on its way into vLLM's paged cache: each piece decoded into per-layer staging as it lands.

A request's load used to wait for every object, then per layer decode each
piece (930 decode calls for SmolLM2 at 8k tokens, ~90 us of bookkeeping each),
join the pieces (a fresh tensor per layer: page faults) and write. Now each
object is decoded into its place the moment it has arrived and been verified,
while the others are still on the wire, into one staging buffer of the whole
load (``[tokens, ...]`` per attention layer, K and V, the cache's dtype) taken
from the client's arena (reused across requests; page-locked on a CUDA host);
its receive buffer is handed back right after. What is left for each layer's
``wait_for_layer_load`` is one cache write of ``[n, kv_heads, head_dim]``
through the backend's own ``do_kv_cache_update`` (on a GPU, after one
host-to-device copy of the layer: a few large copies, never one per block).

Layout of the staging lease: for attention layer ``j`` (in ``layers`` order),
K then V, each ``[kv_heads, tokens, head_dim]`` contiguous: a piece's tensor
``[kv_heads, n, head_dim]`` lands as one strided slice, and the ``[n, H, D]``
view the backend takes is a transpose, no copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kdn.wire.arena import Arena, Lease
from kdn.errors import KDNError


class StagingClosed(KDNError):
    """The load this staging belonged to has ended: nothing more may be written into it."""



class Staging:
    """Per-layer host buffers for tokens ``[first, end)`` of one load."""

    def __init__(self, arena: Arena, dims: Sequence[tuple[int, int]], first: int, end: int,
                 dtype: torch.dtype) -> None:
        """``dims``: ``(kv_heads, head_dim)`` of each attention layer, in the order ``put`` and ``kv`` name them."""
        assert end > first, (first, end)
        self.first, self.end, self.dtype = first, end, dtype
        n = end - first
        item = torch.empty(0, dtype=dtype).element_size()
        sizes = [h * n * d * item for h, d in dims]
        self.per_token = 2 * sum(h * d * item for h, d in dims)  # K and V bytes of one token, every layer
        self.lease: Lease | None = arena.take(2 * sum(sizes))
        raw = torch.frombuffer(self.lease.view, dtype=torch.uint8) if sizes else torch.empty(0, dtype=torch.uint8)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        off = 0
        for (h, d), size in zip(dims, sizes):
            for out in (self.k, self.v):
                out.append(raw[off:off + size].view(dtype).view(h, n, d))  # [H, n, D]
                off += size
        self._lanes = [(_lanes(k), _lanes(v)) for k, v in zip(self.k, self.v)]
        self._lock = threading.Lock()
        self._writers = 0
        self._closed = False
        self._reads: list[Any] = []  # device copies still reading this memory (CUDA events): waited for on release

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the staging open while a piece is decoded into it (a worker thread).

        Why: a load that times out or fails releases its staging while a piece may still be decoding
        into it (the thread cannot be stopped). Released memory is the next load's; a late write into
        it would put one request's K/V into another's cache. So ``release`` only marks the staging
        closed while a writer is inside, and the last writer out hands the memory back.
        """
        with self._lock:
            if self._closed:
                raise StagingClosed("the load ended before this piece was decoded")
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
            if whole and _torch_dtype(info.dtype) == self.dtype:
                view.decode_into(name, lanes[:, a:b, :])  # straight into place, strided
            else:  # a piece that straddles the load's range, or another dtype: decode, then copy the slice
                t = to_torch(view.decode([name]))[name]  # [H, n, D]
                # The staging may have been made inside the engine's forward (inference mode): an in-place
                # update of such a tensor is allowed only in inference mode, and this runs on a worker thread.
                with torch.inference_mode():
                    full[:, a:b, :].copy_(t[:, lo - start:hi - start, :])

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

    def kv(self, j: int, upto: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j``'s K and V for tokens ``[first, upto)`` as ``[n, H, D]`` views (the backend reads strides)."""
        n = (self.end if upto is None else upto) - self.first
        return self.k[j][:, :n].transpose(0, 1), self.v[j][:, :n].transpose(0, 1)

    def kv_on(self, j: int, device: torch.device, dtype: torch.dtype, upto: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``j``'s K and V for tokens ``[first, upto)`` as a backend's cache write takes them, ``[n, H, D]``.

        On the CPU: views of the staging (vLLM's CPU kernels read strides; no copy at all). On another device:
        each of the layer's ``[H, tokens, D]`` blocks copied over whole (one DMA from page-locked memory),
        then reordered there into a contiguous ``[n, H, D]``: a GPU's ``reshape_and_cache`` reads each
        token's ``H x D`` values as one row, and would misread a strided view. Each copy is recorded, and
        :meth:`release` waits for it before the memory goes back to the arena (the next load would
        otherwise overwrite bytes a copy has yet to read).
        """
        if device.type == "cpu":
            k, v = self.kv(j, upto)
            return k.to(dtype=dtype), v.to(dtype=dtype)  # (no copy when the staging is the cache's dtype)
        n = (self.end if upto is None else upto) - self.first
        k, v = (t.to(device=device, non_blocking=True)[:, :n].transpose(0, 1).to(dtype=dtype).contiguous()
                for t in (self.k[j], self.v[j]))
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._reads.append(done)
        return k, v

    def release(self) -> None:
        """Close the staging; its memory goes back to the arena once no writer is inside (``writing``).
        Nothing may read ``k`` / ``v`` after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free = self._writers == 0
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


def _lanes(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory as unsigned lanes of its item size (numpy has no bf16)."""
    lane = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[t.element_size()]
    return t.view(lane).numpy()


def _torch_dtype(st_dtype: str) -> torch.dtype:
    from kdn.format.objects import torch_dtype

    return torch_dtype(st_dtype)
