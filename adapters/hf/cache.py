"""The engine's loader: turn fetched chunk states back into a transformers cache.

``build_cache`` gives the cache the model would hold after prefilling chunks
``0..k`` itself: attention K/V concatenated along the sequence, Mamba /
linear-attention conv and recurrent states taken from the last chunk (each
chunk's object carries the state as it stands at its end). With lossless
states, generation continues bit-identically (see tests/adapters).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kdn.format.objects import raw_region, torch_dtype
from kdn.errors import InvalidInput, KDNError, ModelMismatch
from kdn.adapters.hf import kvmem
from kdn.kernels.pinned import Copies, Event, copy_stream
from kdn.adapters.hf.extract import LayerSpec, _forward, layer_layout, new_cache

if TYPE_CHECKING:  # pragma: no cover
    from kdn.wire.arena import Arena
    from kdn.format.objects import Layout, ObjectHeader, ObjectView


MAX_ROOM = 1 << 16  # tokens of room a CacheBuilder may reserve after its prefix (past it, layers concatenate)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ModelMismatch(msg)


def _check_names(chunks: Sequence[Mapping[str, torch.Tensor]], layout: list[LayerSpec]) -> None:
    kv_names = {f"L{s.index}.{x}" for s in layout if s.kv for x in ("k", "v")}
    state_names = {st.name for s in layout for st in s.states}
    for c, chunk in enumerate(chunks):
        names = set(chunk)
        last = c == len(chunks) - 1
        # Earlier chunks may leave their (superseded) states out: only the last one's are used.
        missing = kv_names - names if not last else (kv_names | state_names) - names
        extra = names - kv_names - state_names
        _expect(
            not missing and not extra,
            f"chunk {c} does not fit this model ({len(layout)} layers): "
            f"lacks {sorted(missing)[:4]}, has no place for {sorted(extra)[:4]}",
        )


def _chunk_len(c: int, chunk: Mapping[str, torch.Tensor], layout: list[LayerSpec]) -> int:
    """The token count of a chunk: the sequence dim of its K/V, checked against every attention layer."""
    n = None
    for s in layout:
        if not s.kv:
            continue
        for x in ("k", "v"):
            t = chunk[f"L{s.index}.{x}"]
            _expect(
                t.dim() == 3 and (t.shape[0], t.shape[2]) == s.kv,
                f"chunk {c} L{s.index}.{x} has shape {tuple(t.shape)}; this model wants [{s.kv[0]}, n, {s.kv[1]}]",
            )
            n = t.shape[1] if n is None else n
            _expect(t.shape[1] == n, f"chunk {c} L{s.index}.{x} covers {t.shape[1]} tokens, other layers {n}")
    if n is None:
        raise ModelMismatch("this model has no attention layer: the token count of a chunk is unknown")
    return int(n)


def build_cache(
    model: Any,
    chunks: Sequence[Mapping[str, torch.Tensor]],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Any, int]:
    """A ``DynamicCache`` equal to the model's own after prefilling chunks ``0..k``, and its token count.

    ``chunks`` are the tensor dicts of consecutive chunks from the first one, as
    ``extract_chunks`` made them. Tensors go to ``device`` (default: the model's)
    and to the dtype the model's own cache uses for them (``dtype`` overrides it
    for K/V and conv states; recurrent states keep the model's own, float32).
    Raises ``ModelMismatch`` when a name, shape or layer layout does not fit.
    (Loading from a KDN, :class:`CacheBuilder` does the same without the
    concatenation: each chunk is decoded straight into its place.)
    """
    layout = layer_layout(model)
    if not chunks:
        return _assemble(model, layout, {}, {}, device, dtype), 0
    _check_names(chunks, layout)
    n_tokens = sum(_chunk_len(c, chunk, layout) for c, chunk in enumerate(chunks))
    kv = {
        spec.index: (torch.cat([c[f"L{spec.index}.k"] for c in chunks], dim=1)[None],  # [1, kv_heads, S, head_dim]
                     torch.cat([c[f"L{spec.index}.v"] for c in chunks], dim=1)[None])
        for spec in layout if spec.kv
    }
    return _assemble(model, layout, kv, chunks[-1], device, dtype), n_tokens


def _assemble(model: Any, layout: list[LayerSpec], kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
              last: Mapping[str, torch.Tensor], device: torch.device | str | None, dtype: torch.dtype | None,
              full: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """A fresh cache holding ``kv`` (per attention layer, ``[1, kv_heads, S, head_dim]``) and the
    conv/recurrent states in ``last``, on ``device`` (default: the model's) in the model's dtypes. Where
    ``full`` gives a layer's storage with room after its ``S`` tokens (``kv`` a prefix view of it), a plain
    attention layer writes new tokens there (``room.RoomLayer``) instead of concatenating."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    from kdn.adapters.hf import room

    cache = new_cache(model)
    _expect(len(cache.layers) == len(layout), f"cache has {len(cache.layers)} layers, probe saw {len(layout)}")
    if not kv and not last:
        return cache
    device = torch.device(device) if device is not None else next(model.parameters()).device
    for position, (spec, layer) in enumerate(zip(layout, cache.layers)):
        if spec.kv:
            assert isinstance(layer, DynamicLayer)
            kd = dtype or spec.kv_dtype
            k, v = kv[spec.index]
            k = k.to(device=device, dtype=kd)  # a no-op when the builder already made them so
            v = v.to(device=device, dtype=kd)
            fk, fv = full[spec.index] if full and spec.index in full else (None, None)
            if (fk is not None and fv is not None and type(layer) is DynamicLayer
                    and k.data_ptr() == fk.data_ptr() and v.data_ptr() == fv.data_ptr()):
                room.install(cache, position, fk, fv, k.shape[-2])
            else:
                # Set the documented fields rather than `update`, whose cat onto an
                # empty tensor would copy the whole prefix KV a second time.
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        if spec.states:
            assert isinstance(layer, LinearAttentionCacheLayerMixin)
            for st in spec.states:
                t = last[st.name]
                _expect(tuple(t.shape) == st.shape, f"{st.name} has shape {tuple(t.shape)}; this model wants {list(st.shape)}")
                if st.conv:
                    t = t.to(device=device, dtype=dtype or st.dtype)[None]  # [1, conv_dim, d_conv]
                    # A fresh layer takes this as a prefill: zeros of shape t, then copy.
                    layer.update_conv_state(t, state_idx=st.slot, conv_kernel_size=t.shape[-1])
                else:
                    layer.update_recurrent_state(t.to(device=device, dtype=st.dtype)[None], state_idx=st.slot)
                # Without this flag the next forward treats the layer as empty and ignores the state.
                layer.has_previous_state[st.slot] = True
    return cache


class CacheBuilder:
    """A cache built while a prefix's objects arrive: each chunk's K/V decoded straight into its slice.

    ``build_cache`` takes decoded chunks and concatenates them: every byte is
    written twice (decode, then cat) into fresh memory. Here the per-layer
    ``[1, kv_heads, S, head_dim]`` tensors are allocated once, up front, in the
    model's K/V dtype, and :meth:`add` (the ``into`` of
    ``KDNClient.fetch_prefix``, called in a worker thread per object as it
    arrives) decodes each tensor into its place: zstd's byte planes are
    interleaved straight into the cache (``kdn.format.codecs.decode_into``). Chunks may
    arrive in any order and in parallel (their slices are disjoint). Every name,
    K/V shape, token count and start is checked before a byte is written into
    the cache; the last chunk's conv/recurrent states (decoded within the
    object's decode bound) are checked before they are kept. An object whose
    dtype differs from the model's is decoded and converted into place.
    :meth:`finish` returns what ``build_cache`` would; with ``room``, its plain
    attention layers write the next tokens in place (``room.RoomLayer``).

    On a device, chunks cross on the device's copy stream. One added ``held``
    (its bytes stay the caller's until :meth:`copied`: a host-tier lease, an
    object held in host memory) is copied by :meth:`finish`, layer after layer,
    an event per layer, and the forward waits for each decoder layer's event
    just before that layer runs (``kvmem.LayerWaits``): layer ``j`` is computed
    while later layers are still crossing.
    """

    def __init__(self, model: Any, token_counts: Sequence[int], *, arena: Arena | None = None,
                 device: torch.device | str | None = None, staged: bool | None = None, room: int = 0,
                 copies: Copies | None = None) -> None:
        """``room``: tokens of room after the prefix in each attention layer's K/V (the suffix and the tokens
        to generate), written in place by the finished cache (``room.RoomLayer``), not concatenated.
        ``copies``: where the copies onto the device run (default: the device's copy stream,
        ``kdn.kernels.pinned.copy_stream``; tests and the GPU script's serial baseline pass their own)."""
        if not (isinstance(room, int) and 0 <= room <= MAX_ROOM):
            raise InvalidInput(f"room must be 0..{MAX_ROOM} tokens, got {str(room)[:40]}")
        self.model = model
        self.room = room
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # On a GPU each chunk's K/V cross to the device in one copy and are placed there (``_add_staged``);
        # on the CPU they are decoded straight into place. ``staged=True`` runs the device path on the CPU
        # too (tests and the GPU script's dry run).
        self.staged = self.device.type != "cpu" if staged is None else staged
        self.h2d_bytes = 0  # bytes copied to the device (staged path)
        self.h2d_seconds = 0.0  # the seconds streamed adds' copies took (a held load's overlap the forward)
        self._arena = arena
        self._copies = (copies if copies is not None else copy_stream(self.device)) if self.staged else None
        self._held: list[kvmem.Region] = []  # chunks added held, copied by ``finish``
        self._reads: list[Event] = []  # held chunks' copies, reading host memory until done
        self._finished = False
        self.waits: kvmem.LayerWaits | None = None  # the finished cache's forward waits, per decoder layer
        self._stats = threading.Lock()
        self._cv = threading.Condition()  # adds in flight (worker threads), and whether more may come
        self._busy, self._closed = 0, False
        self.layout = layer_layout(model)
        self.counts = [int(n) for n in token_counts]
        _expect(all(n > 0 for n in self.counts), f"chunk token counts must be positive, got {self.counts[:8]}")
        self.offsets = [sum(self.counts[:i]) for i in range(len(self.counts))]
        self.tokens = sum(self.counts)
        self._kv_names = {f"L{s.index}.{x}" for s in self.layout if s.kv for x in ("k", "v")}
        self._state_names = {st.name for s in self.layout for st in s.states}
        # [1, kv_heads, S + room, head_dim] per attention layer, on the host (from the arena) or on the device;
        # layers of one shape share one tensor in the objects' own tensor order (``_stack``), so a raw chunk
        # lands by one copy; ``kv`` holds their first S tokens.
        self.device_copies = 0  # copies issued onto and on the device (staged path): two per chunk when stacked
        self.region_copies = 0  # chunks landed on the host by one copy of their K/V region (raw, stacked)
        self._order = tuple(sorted(self._kv_names))  # the order an object stores K/V tensors in (kdn.format.objects)
        # What a chunk's header is checked against, beside its span: a layout that fitted it once fits again.
        self._fit_key = (tuple((s.index, s.kv) for s in self.layout if s.kv), frozenset(self._state_names))
        if not self.staged:
            self._stack, self.full = kvmem.kv_tensors(self.layout, self._order, self.tokens + room, arena)
        else:
            self._stack, self.full = kvmem.device_tensors(self.layout, self._order, self.tokens + room, self.device)
        self._into = kvmem.Placement(self.layout, self._order, self._stack, self.full) if self.staged else None
        self.kv = {i: (k[:, :, :self.tokens], v[:, :, :self.tokens]) for i, (k, v) in self.full.items()}
        self._stack_lanes = kvmem.lanes(self._stack) if self._stack is not None and not self.staged else None
        if self._copies is not None:  # the copies write memory allocated on the compute stream just now
            self._copies.follow()
        # The same memory as numpy arrays of unsigned lanes ([kv_heads, S, head_dim]): slicing these per
        # tensor costs far less than slicing the torch tensors.
        self._lanes = {i: (kvmem.lanes(k[0]), kvmem.lanes(v[0])) for i, (k, v) in self.kv.items()} if not self.staged else {}
        # Each head's [S, head_dim] run as flat bytes, for ``place``: slicing a memoryview per head of a chunk
        # costs a fraction of making one from a numpy slice (5,760 of them at 8k tokens for SmolLM2).
        self._heads = {i: tuple([memoryview(h).cast("B") for h in lanes] for lanes in pair)
                       for i, pair in self._lanes.items()}
        self.last: dict[str, torch.Tensor] = {}
        self._added: set[int] = set()

    def _check(self, index: int, layout: Layout) -> int:
        """Chunk ``index``'s header against this prefix and model (names, shapes, span); its token count. Whether
        its tensors fit the model is found once per layout (``Layout.derived``), not per load."""
        h = layout.header
        _expect(0 <= index < len(self.counts), f"chunk {index} is outside this prefix of {len(self.counts)} chunks")
        _expect(index not in self._added, f"chunk {index} was added twice")
        n = self.counts[index]
        _expect(h.end - h.start == n, f"chunk {index} covers {h.end - h.start} tokens, the prefix expects {n}")
        _expect(h.start == self.offsets[index], f"chunk {index} starts at token {h.start}, the prefix expects "
                                                f"{self.offsets[index]}")
        last = index == len(self.counts) - 1
        layout.derived(("hf-fits", self._fit_key, n, last), lambda: self._fits(index, h, n, last))
        return n

    def _fits(self, index: int, h: ObjectHeader, n: int, last: bool) -> bool:
        """``h``'s tensors are this model's K/V of ``n`` tokens (and its states, ``last``); else ModelMismatch."""
        names = set(h.tensors)
        need = self._kv_names | (self._state_names if last else set())
        missing, extra = need - names, names - self._kv_names - self._state_names
        _expect(not missing and not extra, f"chunk {index} does not fit this model ({len(self.layout)} layers): "
                                           f"lacks {sorted(missing)[:4]}, has no place for {sorted(extra)[:4]}")
        for s in self.layout:
            if not s.kv:
                continue
            for x in ("k", "v"):
                info = h.tensors[f"L{s.index}.{x}"]
                if info.shape != (s.kv[0], n, s.kv[1]):
                    _expect(False, f"chunk {index} L{s.index}.{x} has shape {list(info.shape)}; this model wants "
                                   f"[{s.kv[0]}, {n}, {s.kv[1]}]")
        return True

    @contextlib.contextmanager
    def _writing(self) -> Any:
        """An add in flight: refused once the builder is closed; ``close`` waits for those inside."""
        with self._cv:
            if self._closed:
                raise KDNError("the load was given up: no more chunks are added to its cache")
            self._busy += 1
        try:
            yield
        finally:
            with self._cv:
                self._busy -= 1
                self._cv.notify_all()

    def close(self) -> None:
        """No more chunks: later adds are refused, and those in flight are waited for. (A load given up at its
        deadline cannot stop the worker threads still decoding its chunks; one that wrote later would write
        into slots the cache now uses for the tokens computed instead, or read a buffer handed back.)"""
        with self._cv:
            self._closed = True
            self._cv.wait_for(lambda: self._busy == 0)

    def add(self, index: int, view: ObjectView, *, held: bool = False) -> None:
        """Decode chunk ``index``'s object into its place (checked first: names, shapes, token count).

        ``held`` (a device load): the caller keeps ``view``'s bytes, unchanged, until :meth:`copied` says the
        device has read them; the chunk is copied by :meth:`finish`, overlapping the forward. Otherwise the
        bytes are the caller's again when this returns."""
        with self._writing():
            self._add(index, view, held)

    def _add(self, index: int, view: ObjectView, held: bool = False) -> None:
        from kdn.format.objects import to_torch

        h = view.header
        n = self._check(index, view.layout)
        off = self.offsets[index]
        if self.staged and self._order:
            self._add_staged(view, n, off, held)
        elif (self._stack is not None and self._stack_lanes is not None
              and (src := raw_region(view, self._order, self._stack.dtype, n)) is not None):
            # Every layer's K and V of a raw chunk in one copy into its slice of the stack (a host-tier lease
            # read in place, or a receive buffer): at 8k tokens 32 copies, where one per tensor made 1,920.
            # numpy's, on this worker thread alone: torch's would start an OpenMP team per decode thread, and on
            # a busy machine their spinning threads made the same copy 5-10x slower.
            np.copyto(self._stack_lanes[:, :, off:off + n, :], kvmem.lanes(src))
            with self._stats:
                self.region_copies += 1
        else:
            for s in self.layout:
                if not s.kv:
                    continue
                for x, full, lanes in zip(("k", "v"), self.kv[s.index], self._lanes[s.index]):
                    name = f"L{s.index}.{x}"
                    if torch_dtype(h.tensors[name].dtype) == full.dtype:
                        view.decode_into(name, lanes[:, off:off + n, :])  # [kv_heads, n, head_dim], strided
                    else:  # decode, then convert into place
                        full[0, :, off:off + n, :].copy_(to_torch(view.decode([name]))[name])
        if index == len(self.counts) - 1 and self._state_names:
            # Copied out: a raw object's tensors alias its receive buffer, handed back when this returns.
            self.last = {k: t.clone() for k, t in to_torch(view.decode(sorted(self._state_names))).items()}
            for st in (st for spec in self.layout for st in spec.states):
                t = self.last[st.name]
                _expect(tuple(t.shape) == st.shape, f"{st.name} has shape {tuple(t.shape)}; this model wants {list(st.shape)}")
        self._added.add(index)

    def _add_staged(self, view: ObjectView, n: int, off: int, held: bool) -> None:
        """One chunk's K/V for the device. Raw tensors are copied from the bytes as they are (page-locked when
        they came from a pinned arena or a registered host-tier mapping: a DMA at the link's speed); other codecs
        are decoded on the host first, into one buffer in the objects' tensor order. Held: kept for ``finish``.
        Otherwise copied now (``kvmem.copy_chunk``: one copy of the region, one placing every layer) and waited
        for, so that the bytes may be reused when ``add`` returns."""
        h = view.header
        lease = None
        if all(h.tensors[nm].codec == "raw" for nm in self._order):
            spans = {nm: view.layout.span(nm) for nm in self._order}
            lo, hi = min(b for b, _ in spans.values()), max(e for _, e in spans.values())
            host = torch.frombuffer(view.buffer[lo:hi], dtype=torch.uint8)
            where = {nm: (b - lo, e - lo) for nm, (b, e) in spans.items()}
        else:  # decoded on the host, tensor after tensor, into one buffer
            host, where, lease = kvmem.decode_region(view, self._order, self._arena)
        chunk = kvmem.Region(host, where, {nm: torch_dtype(h.tensors[nm].dtype) for nm in self._order}, n, off, lease)
        assert self._copies is not None and self._into is not None
        if held:
            with self._stats:
                self._held.append(chunk)
            return
        t0 = time.perf_counter()
        try:
            copies = kvmem.copy_chunk(self._copies, chunk, self._into)
            self._copies.mark().synchronize()  # the host bytes may be handed back when this returns
        finally:
            if lease is not None:
                lease.release()
        with self._stats:
            self.h2d_bytes += host.numel()
            self.h2d_seconds += time.perf_counter() - t0
            self.device_copies += copies

    def _upload_held(self, k: int) -> dict[int, Event]:
        """The held chunks among the first ``k`` onto the device, issued now on the copy stream, layer after
        layer (``kvmem.upload``): each attention layer's event."""
        end = self.offsets[k] if k < len(self.counts) else self.tokens
        chunks = [c for c in self._held if c.off < end]
        if not chunks:
            return {}
        assert self._copies is not None and self._into is not None
        events, issued = kvmem.upload(self._copies, chunks, self._into)
        self._reads.extend({id(e): e for e in events.values()}.values())
        with self._stats:
            self.h2d_bytes += sum(c.host.numel() for c in chunks)
            self.device_copies += issued
        return events

    def copied(self, wait: bool = False) -> bool:
        """Whether the device has read every held chunk's bytes (with ``wait``, once it has): from then the
        caller may hand them back (a host-tier lease, an arena buffer), and the buffers held compressed chunks
        were decoded into are back in the arena. False before ``finish`` (it makes the copies)."""
        if self._held and not self._finished:
            return False
        if wait:
            for ev in self._reads:
                ev.synchronize()
        if any(not ev.query() for ev in self._reads):
            return False
        self._reads.clear()
        with self._stats:
            held, self._held = self._held, []
        for c in held:
            if c.lease is not None:
                c.lease.release()
        return True

    def needs(self, index: int) -> frozenset[str] | None:
        """The tensors adding chunk ``index`` reads, where not all of the object: a hybrid model's K/V of every
        chunk but the last (whose conv/recurrent states supersede theirs); None: all of it
        (``KDNClient.fetch_prefix(needs=)`` fetches only these, by verified ranges)."""
        return frozenset(self._kv_names) if self._state_names and index != len(self.counts) - 1 else None

    # --- a raw object received straight into its place (kdn.wire.scatter.Placer) ---

    def placeable(self, index: int) -> bool:
        """Whether chunk ``index`` can be received in place: not one whose states are kept (those are
        decoded the usual way), and not twice."""
        return not self.staged and 0 <= index < len(self.counts) and index not in self._added and not (
            self._state_names and index == len(self.counts) - 1)

    def place(self, index: int, layout: Layout) -> dict[str, list[memoryview]]:
        """The memory runs chunk ``index``'s K/V bytes go to: per tensor ``[H, n, D]``, one run per head
        (``[n, D]``, contiguous in the ``[1, H, S, D]`` cache). Raw tensors of the cache's dtype only."""
        h = layout.header
        with self._cv:
            _expect(not self._closed, "the load was given up: no more chunks are received into its cache")
        n = self._check(index, layout)
        off = self.offsets[index]
        runs: dict[str, list[memoryview]] = {}
        for s in self.layout:
            if not s.kv:
                continue
            row = s.kv[1] * self.kv[s.index][0].element_size()  # one token's bytes of one head
            a, b = off * row, (off + n) * row
            for x, full, heads in zip(("k", "v"), self.kv[s.index], self._heads[s.index]):
                name = f"L{s.index}.{x}"
                info = h.tensors[name]
                _expect(info.codec == "raw" and torch_dtype(info.dtype) == full.dtype,
                        f"chunk {index} {name} is {info.codec} {info.dtype}: only raw tensors of the cache's dtype "
                        "are received in place")
                runs[name] = [head[a:b] for head in heads]
        return runs

    def placed(self, index: int, layout: Layout) -> None:
        """Chunk ``index`` arrived whole, verified, in the runs ``place`` named: it counts as added."""
        _expect(index not in self._added, f"chunk {index} was added twice")
        self._added.add(index)

    def added_prefix(self) -> int:
        """How many leading chunks have been added (a load cut short uses these)."""
        k = 0
        while k in self._added:
            k += 1
        return k

    def finish(self, *, device: torch.device | str | None = None, upto: int | None = None) -> tuple[Any, int]:
        """The cache and its token count, once every chunk has been added; with ``upto``, of the first
        ``upto`` chunks only (a load cut short at its deadline: attention K/V only, since a hybrid model's
        states are those of the last chunk)."""
        self.close()  # (a load cut short: its late adds are waited for, and refused from here on)
        k = len(self.counts) if upto is None else upto
        missing = sorted(set(range(k)) - self._added)
        _expect(not missing, f"chunks {missing[:8]} of the prefix were never added")
        _expect(k == len(self.counts) or not self._state_names,
                "a hybrid model's cache cannot stop before the chunk whose states it holds")
        # Streamed adds each waited for their own copies; held chunks' are issued here, and the forward waits
        # for each layer's just before the layer runs (``kvmem.LayerWaits``).
        events = self._upload_held(k)
        self._finished = True
        device = device if device is not None else (self.device if self.staged else None)
        if events and device is not None and torch.device(device) != self.device:
            # assembled on another device: read out of the stack now, so after every copy
            assert self._copies is not None
            for ev in {id(e): e for e in events.values()}.values():
                self._copies.wait(ev)
            events = {}
        if k == len(self.counts):
            full = self.full if self.room else None  # without room the first new token concatenates anyway
            cache, n = _assemble(self.model, self.layout, self.kv, self.last, device, None, full), self.tokens
        else:
            n = self.offsets[k]
            kv = {i: (a[:, :, :n, :], b[:, :, :n, :]) for i, (a, b) in self.kv.items()}  # [1, H, n, D] views
            cache = _assemble(self.model, self.layout, kv, {}, device, None, self.full)  # (the rest is room too)
        if events:
            assert self._copies is not None
            self.waits = kvmem.LayerWaits(self.model, cache, len(self.layout), events, self._copies)
        return cache, n




def continue_from_cache(model: Any, cache: Any, n_cached: int, suffix_ids: list[int] | torch.Tensor, *,
                        last: int | None = None) -> torch.Tensor:
    """Run ``suffix_ids`` at positions ``n_cached..`` on top of ``cache`` (updated in place); logits ``[n, vocab]``,
    or of the ``last`` positions only: a request needs its last one, and the vocabulary projection of every
    prompt token (2 x hidden x vocab FLOPs a token: 57 MFLOP for SmolLM2) was a fifth of a 1.8k-token prefill."""
    ids = torch.as_tensor(suffix_ids, dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():
        return _forward(model, cache, ids, n_cached, logits=True, keep=last).logits[0]
