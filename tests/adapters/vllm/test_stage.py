"""The vLLM load's staging: each object decoded into its place as it lands, released only when no one writes."""

from __future__ import annotations

import threading

import pytest
import torch

from kdn.wire.arena import Arena
from kdn.format.objects import ObjectView, encode_object, from_torch

from kdn.adapters.vllm.stage import Staging, StagingClosed

H, D = 2, 64


def obj(start: int, end: int, encoding: str, dtype=torch.bfloat16, seed: int = 0) -> tuple[ObjectView, dict]:
    g = torch.Generator().manual_seed(seed)
    t = {f"L{i}.{x}": torch.randn(H, end - start, D, generator=g).to(dtype) for i in (0, 3) for x in "kv"}
    blob = encode_object(kind="kv", address="ab" * 32, model_id="cd" * 32, namespace="public", start=start, end=end,
                         position=start, parent=None, tensors=from_torch(t), encoding=encoding)
    return ObjectView(bytearray(blob)), t


@pytest.mark.parametrize("encoding", ["raw", "zstd"])
def test_chunks_land_in_place_whole_and_sliced(encoding):
    """A load of tokens [128, 600) from chunks [0, 256), [256, 512), [512, 700): the first and last sliced."""
    arena = Arena(64 << 20)
    st = Staging(arena, [(H, D), (H, D)], 128, 600, torch.bfloat16)
    want_k, want_v = [[], []], [[], []]
    for (s, e), seed in zip(((0, 256), (256, 512), (512, 700)), (1, 2, 3)):
        view, t = obj(s, e, encoding, seed=seed)
        lo, hi = max(s, 128), min(e, 600)
        for j, layer in enumerate((0, 3)):
            st.put(j, view, (f"L{layer}.k", f"L{layer}.v"), lo, hi, s)
            want_k[j].append(t[f"L{layer}.k"][:, lo - s:hi - s])
            want_v[j].append(t[f"L{layer}.v"][:, lo - s:hi - s])
    for j in range(2):
        k, v = st.kv(j)  # [n, H, D] views
        assert k.shape == (472, H, D)
        assert torch.equal(k, torch.cat(want_k[j], dim=1).transpose(0, 1))
        assert torch.equal(v, torch.cat(want_v[j], dim=1).transpose(0, 1))
        assert torch.equal(st.kv(j, upto=300)[0], k[:172])
    st.release()
    assert arena.in_use == 0


def test_a_staging_made_in_inference_mode_takes_a_sliced_chunk_from_a_worker_thread():
    """vLLM starts a load inside its forward (inference mode); chunks are decoded on worker threads. A sliced
    chunk once failed there ("Inplace update to inference tensor outside InferenceMode") and was recomputed."""
    with torch.inference_mode():
        st = Staging(Arena(64 << 20), [(H, D)], 768, 896, torch.float32)
    view, t = obj(768, 1000, "zstd", dtype=torch.float32)
    errors = []

    def put():
        try:
            st.put(0, view, ("L0.k", "L0.v"), 768, 896, 768)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=put)
    th.start()
    th.join()
    assert not errors
    assert torch.equal(st.kv(0)[0], t["L0.k"][:, :128].transpose(0, 1))


def test_another_dtype_is_converted_into_place():
    st = Staging(Arena(64 << 20), [(H, D)], 0, 256, torch.bfloat16)
    view, t = obj(0, 256, "raw", dtype=torch.float32)
    st.put(0, view, ("L0.k", "L0.v"), 0, 256, 0)
    assert torch.equal(st.kv(0)[1], t["L0.v"].to(torch.bfloat16).transpose(0, 1))


def test_a_release_while_a_chunk_is_decoding_waits_for_it():
    """A timed-out load releases its staging while a worker may still write into it: the memory goes back
    only when that writer is out, so the next load can never receive a late write."""
    arena = Arena(64 << 20)
    st = Staging(arena, [(H, D)], 0, 256, torch.bfloat16)
    with st.writing():
        st.release()
        assert arena.in_use > 0  # still ours: a writer is inside
    assert arena.in_use == 0
    with pytest.raises(StagingClosed):
        with st.writing():
            pass


def test_a_raw_chunk_received_into_the_staging_runs_is_what_decoding_it_gives():
    """fetching.ChunkLoader._fetch_placed: a raw object's body lands through kdn.wire.scatter straight into ``Staging.runs``;
    the staging then holds exactly what decoding the same object into it (``put``) holds, for chunks in
    any order and bodies handed over in small reads."""
    from kdn.wire.scatter import Scatter

    placed = Staging(Arena(64 << 20), [(H, D), (H, D)], 0, 512, torch.bfloat16)
    decoded = Staging(Arena(64 << 20), [(H, D), (H, D)], 0, 512, torch.bfloat16)
    for (s, e), seed in (((256, 512), 5), ((0, 256), 4)):
        view, _ = obj(s, e, "raw", seed=seed)  # layers 0 and 3; the staging takes them as its layers 0 and 1
        raw = bytes(view._mv)  # the object's bytes, as an edge sends them
        sink = Scatter(len(raw), lambda layout, s=s, e=e: {
            n: r for j, layer in enumerate((0, 3))
            for n, r in zip((f"L{layer}.k", f"L{layer}.v"), placed.runs(j, s, e))})
        pos = 0
        while pos < len(raw):  # as the socket hands the body over: a region at a time, at most 1000 bytes
            dst = sink.region(pos)[:1000]
            dst[:] = raw[pos:pos + len(dst)]
            pos += len(dst)
        for j, layer in enumerate((0, 3)):
            decoded.put(j, view, (f"L{layer}.k", f"L{layer}.v"), s, e, s)
    for j in range(2):
        assert torch.equal(placed.kv(j)[0], decoded.kv(j)[0]) and torch.equal(placed.kv(j)[1], decoded.kv(j)[1])
    assert placed.kv(0)[0].abs().sum() > 0


@pytest.mark.parametrize("upto", [None, 400])
def test_what_a_device_backend_is_given_is_contiguous_and_a_cpu_one_gets_views(upto):
    """A GPU's reshape_and_cache reads each token's H x D values as one row: a strided [n, H, D] view of the
    [H, n, D] staging would be misread there, so off the CPU each layer goes over whole and is reordered
    into a contiguous tensor (shown on the meta device: shapes and strides, no GPU here). On the CPU the
    backend gets views of the staging, no copy."""
    arena = Arena(64 << 20)
    st = Staging(arena, [(H, D), (H, D)], 128, 600, torch.bfloat16)
    view, t = obj(0, 700, "raw")
    st.put(1, view, ("L3.k", "L3.v"), 128, 600, 0)
    n = (600 if upto is None else upto) - 128
    k, v = st.kv_on(1, torch.device("cpu"), torch.bfloat16, upto)
    assert k.data_ptr() == st.k[1].data_ptr() and torch.equal(k, t["L3.k"][:, 128:128 + n].transpose(0, 1))
    assert torch.equal(v, t["L3.v"][:, 128:128 + n].transpose(0, 1))
    k, v = st.kv_on(1, torch.device("meta"), torch.float16, upto)
    for x in (k, v):
        assert x.device.type == "meta" and x.shape == (n, H, D) and x.is_contiguous() and x.dtype == torch.float16
    st.release()
    assert arena.in_use == 0


class _Copy:
    """Stands in for a CUDA event recorded after a copy out of the staging (no GPU here): done or not."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_a_staging_still_read_by_a_device_copy_goes_back_only_once_the_copy_is_done():
    from kdn.adapters.vllm import stage

    arena = Arena(64 << 20)
    st = Staging(arena, [(H, D)], 0, 256, torch.bfloat16)
    copy = _Copy()
    st._reads.append(copy)
    st.release()  # the end of the step: returns at once, the memory is still the copy's
    assert arena.in_use > 0 and stage.reap() == 0 and arena.in_use > 0 and not copy.waited
    copy.done = True
    assert stage.reap() == 1 and arena.in_use == 0  # the next step hands it back
    st2 = Staging(arena, [(H, D)], 0, 256, torch.bfloat16)
    late = _Copy()
    st2._reads.append(late)
    st2.release()
    assert stage.reap(wait=True) == 1 and late.waited and arena.in_use == 0  # an arena out of room waits for it


def test_a_load_writes_runs_of_staged_chunks_once_and_each_chunk_read_in_place_alone():
    """``segments``: a load of tokens [128, 1000) whose second and fourth chunks were read in place (host-tier
    leases): staged neighbours merge into one write, a held chunk is its own (the first one sliced), and a
    failure that lowers ``upto`` cuts the writes there."""
    from kdn.adapters.vllm.fetching import Staged
    from kdn.adapters.vllm.meta import LoadJob
    from kdn.adapters.vllm.plan import LoadPlan
    from kdn.chunk import Chunk
    from kdn.adapters.vllm.worker import _Running, segments

    bounds = [(0, 256), (256, 512), (512, 768), (768, 1024)]
    chunks = tuple(Chunk("ab" * 32, a, b, "raw", "cd" * 32, 1) for a, b in bounds)
    run = _Running(LoadJob("r", LoadPlan(128, 1000, chunks), ([],), False))
    kv = [(torch.zeros(256, H, D), torch.zeros(256, H, D))]
    run.staged = [Staged("host", "raw", 1, kv=kv, start=0), Staged("edge", "raw", 1),
                  Staged("edge", "raw", 1), Staged("host", "raw", 1, kv=kv, start=768)]
    got = [(lo, hi, held is not None) for lo, hi, held in segments(run)]
    assert got == [(128, 256, True), (256, 768, False), (768, 1000, True)]
    run.staged[0] = Staged("edge", "raw", 1)  # (a new answer only for a new upto: made once per load)
    run.upto = 600
    assert [(lo, hi, held is not None) for lo, hi, held in segments(run)] == [(128, 600, False)]


def test_a_lazy_staging_takes_memory_only_for_a_chunk_that_needs_it():
    """``lazy``: a load whose chunks are all read in place (the host tier's mapping) takes no arena memory; its
    first staged chunk takes it, and a full arena fails that chunk (``ArenaFull``), not the load's start."""
    from kdn.wire.arena import ArenaFull

    arena = Arena(64 << 20)
    st = Staging(arena, [(H, D), (H, D)], 0, 256, torch.bfloat16, lazy=True)
    assert arena.in_use == 0 and st.lease is None
    view, t = obj(0, 256, "raw")
    with st.writing():
        st.put(0, view, ("L0.k", "L0.v"), 0, 256, 0)
    assert arena.in_use > 0 and torch.equal(st.kv(0)[0], t["L0.k"].transpose(0, 1))
    st.release()
    assert arena.in_use == 0
    small = Staging(Arena(1 << 10), [(H, D)], 0, 256, torch.bfloat16, lazy=True)  # room for nothing
    with pytest.raises(ArenaFull):
        with small.writing():
            pass
    small.release()
