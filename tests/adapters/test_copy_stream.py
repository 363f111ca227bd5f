"""Device copies that overlap the forward, checked on the CPU with a stand-in device.

There is no GPU here. ``kdn.kernels.pinned.Copies`` is the seam: the loaders issue every copy, event and wait
through it, so a fake that runs each copy at once on the CPU (the bytes can be checked) and records the order
of copies, events and waits shows what a CUDA copy stream would be asked to do:

- vLLM (``adapters/vllm/stage.py``, ``Upload``): every layer's copy issued when the load's staging is whole,
  copies of at least ``MIN_COPY`` bytes (a layer's K and V in one; small layers merged), an event per layer,
  and layer ``j``'s wait waits for event ``j`` only; a slot is reused only after the forward took its layer;
  the staging goes back to the arena only once the copies reading it are done;
- transformers (``adapters/hf/cache.py``, ``CacheBuilder`` with ``held`` chunks): the copies issued by
  ``finish`` layer after layer, and a pre-hook per decoder layer making the forward wait for that layer's
  event just before it runs, removed once waited; bit-identical logits all the while;
- the host tier's mapping registered page-locked (``register_mapping``), against a stand-in CUDA runtime.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from kdn.kernels import pinned
from kdn.kernels.pinned import MIN_COPY
from kdn.wire.arena import Arena


class FakeEvent:
    def __init__(self, n: int) -> None:
        self.n, self.done = n, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class FakeDevice:
    """A ``Copies`` whose copies run at once on the CPU and whose events are done only when the test says (or
    someone synchronizes them); ``log`` holds ``("copy", src address, bytes)``, ``("mark", n)``,
    ``("wait", n)`` and ``("follow",)`` in the order they were asked for."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events: list[FakeEvent] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.log.append(("copy", src.data_ptr(), src.numel() * src.element_size()))

    def mark(self) -> FakeEvent:
        ev = FakeEvent(len(self.events))
        self.events.append(ev)
        self.log.append(("mark", ev.n))
        return ev

    def wait(self, event: FakeEvent) -> None:
        self.log.append(("wait", event.n))

    def follow(self) -> None:
        self.log.append(("follow",))

    def since(self, i: int) -> list[tuple]:
        """The log from ``i`` on, copies by their size only."""
        return [("copy", e[2]) if e[0] == "copy" else e for e in self.log[i:]]


# --- vLLM: the staging's layers onto the device --------------------------------------------------------------

H, D = 2, 64


def staging(layers: int, tokens: int, arena: Arena):
    from kdn.adapters.vllm.stage import Staging

    st = Staging(arena, [(H, D)] * layers, 0, tokens, torch.bfloat16)
    g = torch.Generator().manual_seed(layers * tokens)
    for j in range(layers):
        st.k[j].copy_(torch.randn(H, tokens, D, generator=g).to(torch.bfloat16))
        st.v[j].copy_(torch.randn(H, tokens, D, generator=g).to(torch.bfloat16))
    return st


def layer_of(st, address: int) -> int:
    return next(j for j, (off, _) in enumerate(st.spans) if st.raw.data_ptr() + off == address)


def test_every_layer_crosses_at_load_start_and_each_layer_waits_for_its_own_event_only():
    arena = Arena(64 << 20)
    st = staging(4, 256, arena)  # a layer's K and V: 2 x 2 x 256 x 64 x 2 B = 128 KiB
    dev = FakeDevice()
    up = st.upload(torch.device("cpu"), copies=dev)
    # at load start: the copy stream follows the compute stream once, then every layer's copy and its event
    assert dev.log[0] == ("follow",)
    copies = [e for e in dev.log if e[0] == "copy"]
    assert [layer_of(st, e[1]) for e in copies] == [0, 1, 2, 3]
    assert all(e[2] == 128 << 10 and e[2] >= MIN_COPY for e in copies)  # one copy a layer, K and V together
    assert [e[0] for e in dev.log[1:]] == ["copy", "mark"] * 4 and not any(e[0] == "wait" for e in dev.log)
    event_of = {layer_of(st, dev.log[i][1]): dev.log[i + 1][1] for i in range(1, len(dev.log), 2)}
    for j in range(4):
        before = len(dev.log)
        k, v = up.layer(j, torch.bfloat16)
        assert dev.log[before:] == [("wait", event_of[j])]  # layer j's event, no other
        want_k, want_v = st.kv(j)
        assert k.is_contiguous() and torch.equal(k, want_k) and torch.equal(v, want_v)
        assert k.data_ptr() != st.k[j].data_ptr()  # the backend gets the copy, never the host memory


def test_a_slot_is_copied_into_again_only_after_the_forward_took_its_layer():
    """``ahead`` for two layers of four: layer j + 2 crosses into layer j's slot once layer j was taken, after
    the copy stream follows the compute stream (which has the reorder out of the slot queued)."""
    st = staging(4, 256, Arena(64 << 20))
    dev = FakeDevice()
    up = st.upload(torch.device("cpu"), copies=dev, ahead=256 << 10)
    assert len(up.slots) == 2
    assert [layer_of(st, e[1]) for e in dev.log if e[0] == "copy"] == [0, 1]
    before = len(dev.log)
    k, _ = up.layer(0, torch.bfloat16)
    assert [e[0] for e in dev.log[before:]] == ["wait", "follow", "copy", "mark"]
    assert layer_of(st, dev.log[before + 2][1]) == 2
    assert torch.equal(k, st.kv(0)[0])
    for j in (1, 2, 3):
        k, v = up.layer(j, torch.float32, upto=200)  # (the cache's dtype and a load cut at token 200)
        assert torch.equal(k, st.kv(j, 200)[0].float()) and torch.equal(v, st.kv(j, 200)[1].float())
    assert [layer_of(st, e[1]) for e in dev.log if e[0] == "copy"] == [0, 1, 2, 3]


def test_a_layer_asked_for_out_of_order_is_copied_there_and_then_and_still_right():
    st = staging(4, 256, Arena(64 << 20))
    dev = FakeDevice()
    up = st.upload(torch.device("cpu"), copies=dev, ahead=256 << 10)
    before = len(dev.log)
    k, v = up.layer(3, torch.bfloat16)  # not in a slot yet: copied on the compute stream, in order with it
    assert dev.log[before:] == [] and torch.equal(k, st.kv(3)[0]) and torch.equal(v, st.kv(3)[1])
    for j in range(4):
        assert torch.equal(up.layer(j, torch.bfloat16)[0], st.kv(j)[0])
    assert torch.equal(up.layer(0, torch.bfloat16)[0], st.kv(0)[0])  # asked twice: its slot was reused since


def test_small_layers_are_merged_into_one_copy_never_one_per_block():
    from kdn.adapters.vllm.stage import _groups

    st = staging(4, 16, Arena(64 << 20))  # 8 KiB a layer: all four in one copy
    dev = FakeDevice()
    up = st.upload(torch.device("cpu"), copies=dev)
    assert [e for e in dev.log if e[0] == "copy"] == [("copy", st.raw.data_ptr(), 32 << 10)]
    for j in range(4):
        before = len(dev.log)
        assert torch.equal(up.layer(j, torch.bfloat16)[1], st.kv(j)[1])
        assert dev.log[before:] == [("wait", 0)]
    K = 1 << 10
    spans = [(0, 100 * K), (100 * K, 10 * K), (110 * K, 10 * K), (120 * K, 100 * K), (220 * K, 5 * K)]
    # a big layer alone; small ones join the next until big enough; a small remainder joins the group before
    assert _groups(spans) == [(0, 1, 0, 100 * K), (1, 5, 100 * K, 125 * K)]


def test_the_staging_goes_back_only_once_the_copies_reading_it_are_done():
    from kdn.adapters.vllm import stage

    arena = Arena(64 << 20)
    st = staging(2, 256, arena)
    dev = FakeDevice()
    up = st.upload(torch.device("cpu"), copies=dev)
    up.layer(0, torch.bfloat16)
    up.layer(1, torch.bfloat16)
    st.release()  # the end of the step: the copies may still be reading the host memory
    assert arena.in_use > 0 and stage.reap() == 0 and arena.in_use > 0
    for ev in dev.events:
        ev.done = True
    assert stage.reap() == 1 and arena.in_use == 0


def test_on_a_device_without_streams_the_same_path_copies_in_place():
    """``kv_on`` off the CPU starts the upload itself, with the device's ``copy_stream``: in place (``Inline``)
    on a device that has no streams; shown on the meta device (shapes and strides, no data)."""
    st = staging(2, 256, Arena(64 << 20))
    assert isinstance(pinned.copy_stream("meta"), pinned.Inline)
    k, v = st.kv_on(1, torch.device("meta"), torch.float16, 100)
    assert k.device.type == "meta" and k.shape == (100, H, D) and k.is_contiguous() and k.dtype == torch.float16
    st.release()


# --- transformers: held chunks, a wait per decoder layer -------------------------------------------------------


def blobs(model, ids, chunk: int, encoding: str = "raw"):
    from kdn.adapters.hf import extract_chunks
    from kdn.format.objects import encode_object, from_torch

    with torch.inference_mode():
        chunks = list(extract_chunks(model, ids, chunk_tokens=chunk))
    return [encode_object(kind=c.kind, address="ab" * 32, model_id="cd" * 32, namespace="public", start=c.start,
                          end=c.end, position=c.start, parent=None, tensors=from_torch(c.tensors), encoding=encoding)
            for c in chunks]


@pytest.fixture(scope="module")
def llama():
    from kdn.adapters.hf import load_model

    return load_model("tiny-llama", dtype=torch.float32).model  # 2 layers, 2 KV heads x 16: 256 B a token-layer


def own_logits(model, ids, n):
    from kdn.adapters.hf import continue_from_cache, prefill

    with torch.inference_mode():
        return continue_from_cache(model, prefill(model, ids[:n], chunk_tokens=n), n, ids[n:])


def ran_log(model, dev):
    """Log ``("ran", i)`` after decoder layer ``i`` runs, in the device's log."""
    return [layer.register_forward_hook(lambda m, a, o, i=i: dev.log.append(("ran", i)))
            for i, layer in enumerate(model.model.layers)]


def test_held_chunks_cross_layer_after_layer_and_each_layer_waits_for_its_own_event_just_before_it_runs(llama):
    from kdn.adapters.hf import CacheBuilder, continue_from_cache
    from kdn.format.objects import ObjectView

    ids = torch.randint(0, 500, (2 * 256 + 9,), generator=torch.Generator().manual_seed(3))
    own = own_logits(llama, ids, 512)
    dev = FakeDevice()
    b = CacheBuilder(llama, [256, 256], device="cpu", staged=True, copies=dev, room=9)
    views = [ObjectView(bytearray(x)) for x in blobs(llama, ids[:512], 256)]
    for i, v in enumerate(views):
        b.add(i, v, held=True)
    assert not any(e[0] == "copy" for e in dev.log) and not b.copied()  # held: nothing crosses before finish
    start = len(dev.log)
    cache, n = b.finish()
    # layer 0 of every chunk, its event; then layer 1 of every chunk, its event: 64 KiB a copy (K and V of a
    # layer of one chunk, side by side in the object and in the device stack)
    assert dev.since(start) == [("copy", 64 << 10), ("copy", 64 << 10), ("mark", 0),
                                ("copy", 64 << 10), ("copy", 64 << 10), ("mark", 1)]
    # (each copy lands in a contiguous device buffer first, then in its strided slice of the stack: 2 device copies)
    assert b.waits is not None and b.waits.pending == 2 and b.device_copies == 8
    hooks = ran_log(llama, dev)
    try:
        start = len(dev.log)
        got = continue_from_cache(llama, cache, n, ids[512:])
    finally:
        for h in hooks:
            h.remove()
    assert dev.log[start:] == [("wait", 0), ("ran", 0), ("wait", 1), ("ran", 1)]
    assert torch.equal(got, own)
    assert b.waits.pending == 0 and not any(layer._forward_pre_hooks for layer in llama.model.layers)
    assert not b.copied() and b.copied(wait=True)  # the host bytes are the caller's again once the device read them


def test_another_requests_forward_does_not_take_this_loads_waits(llama):
    from kdn.adapters.hf import CacheBuilder, continue_from_cache, prefill
    from kdn.format.objects import ObjectView

    ids = torch.randint(0, 500, (2 * 256 + 9,), generator=torch.Generator().manual_seed(4))
    dev = FakeDevice()
    b = CacheBuilder(llama, [256, 256], device="cpu", staged=True, copies=dev)
    for i, x in enumerate(blobs(llama, ids[:512], 256)):
        b.add(i, ObjectView(bytearray(x)), held=True)
    cache, n = b.finish()
    start = len(dev.log)
    with torch.inference_mode():
        other = prefill(llama, ids[:40], chunk_tokens=40)  # another request, its own cache
    continue_from_cache(llama, other, 40, ids[40:45])
    assert dev.log[start:] == [] and b.waits is not None and b.waits.pending == 2
    continue_from_cache(llama, cache, n, ids[512:])
    assert [e for e in dev.log[start:]] == [("wait", 0), ("wait", 1)] and b.waits.pending == 0
    del cache  # (and a cache dropped unused takes its hooks with it: shown below)
    b2 = CacheBuilder(llama, [256, 256], device="cpu", staged=True, copies=FakeDevice())
    for i, x in enumerate(blobs(llama, ids[:512], 256)):
        b2.add(i, ObjectView(bytearray(x)), held=True)
    cache2, _ = b2.finish()
    assert any(layer._forward_pre_hooks for layer in llama.model.layers)
    del cache2
    import gc

    gc.collect()
    assert not any(layer._forward_pre_hooks for layer in llama.model.layers)


def test_small_chunks_cross_whole_and_every_layer_waits_for_the_last_copy(llama):
    """32-token chunks are 8 KiB a layer: below ``MIN_COPY`` the held chunks cross chunk after chunk (one copy
    of each region, one placing it), and every layer's event is the last one."""
    from kdn.adapters.hf import CacheBuilder, continue_from_cache
    from kdn.format.objects import ObjectView

    ids = torch.randint(0, 500, (3 * 32 + 5,), generator=torch.Generator().manual_seed(5))
    own = own_logits(llama, ids, 96)
    dev = FakeDevice()
    b = CacheBuilder(llama, [32] * 3, device="cpu", staged=True, copies=dev)
    for i, x in enumerate(blobs(llama, ids[:96], 32, "zstd")):
        b.add(i, ObjectView(bytearray(x)), held=True)
    start = len(dev.log)
    cache, n = b.finish()
    kinds = [e[0] for e in dev.log[start:]]
    assert kinds == ["copy"] * 3 + ["mark"]  # each chunk's region in one copy (landed, then placed, on the device)
    got = continue_from_cache(llama, cache, n, ids[96:])
    assert torch.equal(got, own) and [e for e in dev.log if e[0] == "wait"] == [("wait", 0), ("wait", 0)]


def test_streamed_adds_wait_for_their_own_copies_and_leave_nothing_for_the_forward(llama):
    from kdn.adapters.hf import CacheBuilder, continue_from_cache
    from kdn.format.objects import ObjectView

    ids = torch.randint(0, 500, (2 * 256 + 3,), generator=torch.Generator().manual_seed(6))
    own = own_logits(llama, ids, 512)
    dev = FakeDevice()
    b = CacheBuilder(llama, [256, 256], device="cpu", staged=True, copies=dev)
    for i, x in enumerate(blobs(llama, ids[:512], 256)):
        b.add(i, ObjectView(bytearray(x)))
        assert dev.events[-1].done  # waited for: the caller may hand the bytes back now
    cache, n = b.finish()
    assert b.waits is None and b.device_copies == 4 and b.copied()
    assert torch.equal(continue_from_cache(llama, cache, n, ids[512:]), own)


def test_on_the_cpu_the_held_path_runs_with_no_stream_and_its_decode_buffers_go_back(llama):
    """The default ``copies`` off a GPU: copies in place, events done; the hooks are no-ops that remove
    themselves. A held zstd chunk's decode buffer (from the arena) goes back at ``copied``."""
    from kdn.adapters.hf import CacheBuilder, continue_from_cache
    from kdn.format.objects import ObjectView

    ids = torch.randint(0, 500, (2 * 256 + 4,), generator=torch.Generator().manual_seed(7))
    own = own_logits(llama, ids, 512)
    arena = Arena(64 << 20)
    b = CacheBuilder(llama, [256, 256], device="cpu", staged=True, arena=arena)
    for i, x in enumerate(blobs(llama, ids[:512], 256, "zstd")):
        b.add(i, ObjectView(bytearray(x)), held=True)
    assert arena.in_use > 0
    cache, n = b.finish()
    assert torch.equal(continue_from_cache(llama, cache, n, ids[512:]), own)
    assert not any(layer._forward_pre_hooks for layer in llama.model.layers)
    assert b.copied() and arena.in_use == 0


# --- the host tier's mapping, page-locked ------------------------------------------------------------------


class FakeCudart:
    def __init__(self, answer: int = 0) -> None:
        self.answer, self.calls = answer, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the runtime's name)
        self.calls.append(("register", ptr, size, flags))
        return self.answer

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def mapping(tmp_path):
    path = tmp_path / "segment"
    path.write_bytes(b"\x01" * (4 * mmap.PAGESIZE))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # as an engine maps it
    view = memoryview(mm)
    yield view
    view.release()
    mm.close()


def test_without_cuda_the_mapping_stays_as_it_is(mapping):
    assert not torch.cuda.is_available()
    assert pinned.register_mapping(mapping) is None


def test_the_mapping_is_registered_read_only_and_unregistered_once_on_close(mapping):
    cudart = FakeCudart()
    reg = pinned.register_mapping(mapping, cudart=cudart)
    assert reg is not None
    ptr = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    assert cudart.calls == [("register", ptr, len(mapping), 1 | 8)]  # portable | read-only (PROT_READ pages)
    reg.close()
    reg.close()
    assert cudart.calls[1:] == [("unregister", ptr)]


def test_a_refused_registration_is_none_and_clears_the_runtime_error(mapping, monkeypatch):
    cleared = []
    monkeypatch.setattr(pinned, "_clear_runtime_error", lambda: cleared.append(1))
    cudart = FakeCudart(answer=1)  # cudaErrorInvalidValue: a driver without read-only registration
    assert pinned.register_mapping(mapping, cudart=cudart) is None and cleared == [1]
    assert pinned.register_mapping(memoryview(b""), cudart=cudart) is None  # nothing to register


def test_a_device_without_read_only_registration_is_not_asked(mapping, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_read_only_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("the runtime was asked"))
    assert pinned.register_mapping(mapping) is None
