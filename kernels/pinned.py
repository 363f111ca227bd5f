"""Host memory a device copies from at the link's speed, and the stream those copies run on.

A pageable buffer crosses PCIe through a bounce buffer at a fraction of the
link (7-8 GB/s against 52-55 GB/s pinned, measured on an H200 host); a
page-locked one is copied by DMA, asynchronously (``non_blocking=True``) on a
stream of its own. Pinning costs a system call and locked RAM, so buffers are
made once and reused: ``host_arena`` is the arena an engine's loader receives
bodies into; ``register_mapping`` page-locks memory that is not torch's (the
host tier's read-only mapping of its segment).

``copy_stream(device)`` is where a load's host-to-device copies run: one copy
stream per device, an event marked after each group of copies, and the forward
(the compute stream) made to wait for one event at a time, so layer ``j`` is
computed while layers after it are still crossing. On the CPU (and in tests)
the same calls run with no stream: copies happen as they are issued and every
event is already done.

Not measured yet (no GPU here): torch's pinned allocator rounds each buffer up to
a power of two and keeps freed ones cached, so the page-locked memory a process
holds can reach twice the arena's budget (a 40 MiB size class takes 64 MiB).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kdn.wire.arena import Arena

log = logging.getLogger("kdn.kernels.pinned")

# The smallest host-to-device copy a loader issues: smaller ones are merged (a layer's K and V, or several
# layers) or left whole (a chunk). Each ``cudaMemcpyAsync`` costs microseconds of launch, and vLLM's batched
# DMA collapses below ~28 KiB a descriptor: thousands of small copies cannot reach the link's speed.
MIN_COPY = 64 << 10


def pinned(n: int) -> memoryview:
    """``n`` page-locked bytes (the tensor stays alive as long as the view: numpy keeps it as its base)."""
    t = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
    return t.numpy().data[:n]


def host_arena(budget: int, *, pin: bool | None = None) -> Arena:
    """An arena of ``budget`` bytes; page-locked when a CUDA device is present (or ``pin`` says so)."""
    if pin is None:
        pin = torch.cuda.is_available()
    return Arena(budget, allocate=pinned if pin else _plain, name="pinned host arena" if pin else "host arena")


def _plain(n: int) -> memoryview:
    return memoryview(bytearray(n))


def as_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view``'s bytes (no copy; page-locked if the memory is)."""
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


# --- the copy stream ---------------------------------------------------------------------------------------


class Event(Protocol):
    """A point in a stream's work: done once every copy issued before it has finished."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Copies(Protocol):
    """Where a load's host-to-device copies run, and how the forward waits for them.

    The order a loader follows: ``follow`` (the copies may write memory the compute stream just handed out),
    ``copy`` a group of at least ``MIN_COPY`` bytes, ``mark`` it; later, before the compute stream reads what
    a group wrote, ``wait`` for its event only. The host memory a copy reads stays untouched until its event
    is done (``Event.query``): the copy is asynchronous.
    """

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst <- src`` after every earlier copy, without waiting for it."""

    def mark(self) -> Event:
        """An event done once every copy issued so far is."""

    def wait(self, event: Event) -> None:
        """The compute stream (the calling thread's current one) waits for ``event`` before its next work; the
        host does not wait."""

    def follow(self) -> None:
        """Later copies start only after the work already given to the compute stream (memory it allocated or
        read may be written then)."""


class Done:
    """An event that is already done: a copy that ran as it was issued."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = Done()


class Inline:
    """Copies that run where they are issued, in order with the compute: on the CPU (no stream), on a device
    without streams, or on a CUDA device's compute stream itself (the serial baseline ``bench/gpu_check.py``
    measures the copy stream against). Its events are the compute stream's own there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.device.type == "cuda")

    def mark(self) -> Event:
        if self.device.type != "cuda":
            return DONE
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))  # the host memory is read once the compute stream is here
        return ev

    def wait(self, event: Event) -> None:
        pass  # (the copies are in the compute stream's own order)

    def follow(self) -> None:
        pass


class Stream:
    """A CUDA device's copy stream (``copy_stream``: one per device, shared by every load on it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        if dst.is_cuda:
            # The destination is the copy stream's too until its copies are done: were the compute stream to
            # drop it first (a request given up before its forward ran), the allocator would hand the memory
            # out again while this stream still writes it.
            dst.record_stream(self.stream)

    def mark(self) -> Event:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, event: Event) -> None:
        assert isinstance(event, torch.cuda.Event), type(event)
        torch.cuda.current_stream(self.device).wait_event(event)

    def follow(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))


def copy_stream(device: torch.device | str) -> Copies:
    """Where loads onto ``device`` copy: its copy stream on CUDA (made once: a stream per load would each keep
    its own cached blocks in the caching allocator), copies in place elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return Inline(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _stream_of(device)


@functools.cache
def _stream_of(device: torch.device) -> Stream:
    return Stream(device)


# --- the host tier's mapping, page-locked --------------------------------------------------------------------

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads it (needed for a PROT_READ mapping)
_READ_ONLY_SUPPORTED = 113  # CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED


class Registration:
    """A mapping page-locked with ``cudaHostRegister``; ``close`` unregisters it (before the mapping is unmapped:
    unmapping registered memory is undefined)."""

    def __init__(self, cudart: Any, ptr: int, size: int) -> None:
        self._cudart, self.ptr, self.size = cudart, ptr, size

    def close(self) -> None:
        if self._cudart is None:
            return
        cudart, self._cudart = self._cudart, None
        err = int(cudart.cudaHostUnregister(self.ptr))
        if err:
            log.warning("cudaHostUnregister of %d bytes at %#x failed (error %d)", self.size, self.ptr, err)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_mapping(view: memoryview, *, cudart: Any = None) -> Registration | None:
    """``view``'s pages page-locked for DMA, read-only (the host tier's segment as an engine maps it:
    ``PROT_READ``), so a host-to-device copy out of a leased object runs at the link's speed with no bounce
    buffer; None where that cannot be (no CUDA device, a driver without read-only registration, or a refusal)
    and copies stay pageable (correct, slower). Register the whole mapping once, page-aligned as ``mmap``
    gives it, and ``close`` the registration before unmapping. Locks every page of the view in RAM.

    ``cudart``: torch's CUDA runtime bindings (``torch.cuda.cudart()``); tests pass a stand-in.
    """
    if not len(view):
        return None
    if cudart is None:
        if not torch.cuda.is_available() or not _read_only_supported():
            return None
        cudart = torch.cuda.cudart()
    import numpy as np

    ptr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)  # (numpy reads a read-only buffer's address)
    err = int(cudart.cudaHostRegister(ptr, len(view), HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY))
    if err:
        # A failed runtime call is left as the thread's "last error", which torch's next kernel-launch check
        # would report as its own failure: clear it here.
        _clear_runtime_error()
        log.warning("cudaHostRegister of %d read-only bytes failed (error %d): copies from the mapping stay "
                    "pageable", len(view), err)
        return None
    return Registration(cudart, ptr, len(view))


def pin_mapping(view: memoryview) -> Callable[[], None] | None:
    """``register_mapping`` as ``kdn.client.host.HostClient(on_map=)`` takes it: the registration's ``close``, or
    None (nothing registered: no CUDA device, or a refusal)."""
    reg = register_mapping(view)
    return reg.close if reg is not None else None


def _read_only_supported() -> bool:
    """Whether the current device can page-lock read-only memory (CUDA 11.1+ and the device's attribute), asked
    of the driver API: a query there leaves the runtime's error state alone."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()):
            return False
        return not cuda.cuDeviceGetAttribute(ctypes.byref(value), _READ_ONLY_SUPPORTED, dev) and value.value == 1
    except (OSError, AttributeError):
        return False


def _clear_runtime_error() -> None:
    """``cudaGetLastError()`` in the CUDA runtime torch loaded (found by its path in this process's maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass
