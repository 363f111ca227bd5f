"""Host memory a device copies from at the link's speed: page-locked buffers for ``kdn.wire.arena``.

A pageable buffer crosses PCIe through a bounce buffer at a fraction of the
link (7-8 GB/s against 52-55 GB/s pinned, measured on an H200 host); a
page-locked one is copied by DMA, asynchronously (``non_blocking=True``) on a
stream of its own. Pinning costs a system call and locked RAM, so buffers are
made once and reused: ``host_arena`` is the arena an engine's loader receives
bodies into.

Not measured yet (no GPU here): torch's pinned allocator rounds each buffer up to
a power of two and keeps freed ones cached, so the page-locked memory a process
holds can reach twice the arena's budget (a 40 MiB size class takes 64 MiB).
"""

from __future__ import annotations

import torch

from kdn.wire.arena import Arena


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
