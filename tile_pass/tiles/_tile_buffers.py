"""One logits buffer for all the tiles of a loop, on the CPU.

A tile's logits GEMM writes a fresh ``[tile, V]`` tensor. On the CPU an allocation that
large is a mapping of its own (glibc hands blocks above its 32 MiB threshold back to the OS
when they are freed), so every tile pays again for faulting its pages in: 37 ms of a
512 x 128256 bfloat16 tile's 122 ms logits GEMM on a 2-core Xeon. The tile loops run inside
:func:`shared`, and the logits GEMM of every derived tile graph (rewritten by
:func:`tile_pass.tiles._tile_kernel.finish_tile_graph`) writes into that scope's buffer instead:
allocated by the first tile, reused by the others, freed when the loop ends. Outside a scope
(or on an accelerator, whose caching allocator already reuses memory) each GEMM allocates as
before.

Reuse is safe because a tile's logits, and the gradient stored over them, are dead when its
graph returns, but for what it returns, and the loops copy every returned tile (kept logits,
returned rows) into their outputs before the next tile runs. A shorter last tile takes a
prefix of the same buffer, so the buffer is never held twice. A loop that runs only some tokens
gathers each tile's rows of every per-token input into one buffer per input the same way
(:func:`gathered`). The float32 logits GEMM routed to oneDNN still returns a fresh tile: its op
writes into no given buffer.

Every large CPU buffer tile_pass makes (this one, the weight-gradient sums, the gradients it
returns) comes from :func:`empty`, which asks Linux for transparent huge pages on it where the
system leaves that to the program (``madvise`` mode, the common default): a 256 MiB buffer
then faults in 128 pages instead of 65536 and its passes miss the TLB less. On a 2-core Xeon a
1024 x 128256 bfloat16 logits GEMM into a fresh buffer takes 195 ms instead of 250, and a first
write of 256 MiB 23 ms instead of 60. ``TILE_PASS_HUGE_PAGES=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from tile_pass import _settings

_local = threading.local()

_HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
#: Smaller allocations may be carved from glibc's heap beside other objects (32 MiB is the
#: most its dynamic threshold for an allocation of its own mapping can reach), where a hint
#: would outlive the buffer.
HUGE_PAGE_MIN_BYTES = 32 << 20


@functools.cache
def _madvise():
    """libc's ``madvise`` where transparent huge pages can be asked for, else ``None``."""
    if sys.platform != "linux":
        return None
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    if "[never]" in mode:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, on huge pages where that is asked for and the buffer is large enough
    to have a mapping of its own (the hint covers the whole huge pages inside it, before any
    is touched). A refused hint changes nothing but speed."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES or not _settings.current().huge_pages:
        return tensor
    madvise = _madvise()
    if madvise is None or is_fake(tensor):  # a fake tensor: traced, not run
        return tensor
    start = -(-tensor.data_ptr() // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    stop = (tensor.data_ptr() + nbytes) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if stop > start:
        madvise(start, stop - start, _MADV_HUGEPAGE)
    return tensor


def zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`empty`, zeroed."""
    return empty(shape, dtype, device).zero_()


@contextlib.contextmanager
def shared() -> Iterator[None]:
    """Run the tiles of one loop with one shared logits buffer per dtype, freed on exit (or
    with the buffers of the enclosing :func:`across_loops`)."""
    outer, carried = getattr(_local, "buffers", None), getattr(_local, "carried", None)
    _local.buffers, _local.carried = ({} if carried is None else carried), None
    try:
        yield
    finally:
        _local.buffers, _local.carried = outer, carried


@contextlib.contextmanager
def across_loops() -> Iterator[None]:
    """The loops run directly inside (one per group of :mod:`tile_pass.tiles._summary_tiles`)
    share one set of buffers, freed on exit: a loop does not fault a fresh logits buffer in."""
    outer = getattr(_local, "carried", None)
    _local.carried = {}
    try:
        yield
    finally:
        _local.carried = outer


def _take(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        return empty(shape, dtype, device)
    return _reused(buffers, (dtype, device), shape, dtype, device)


def _reused(buffers: dict, key, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """The scope's buffer under ``key``, grown where ``shape`` needs more, as ``shape``."""
    numel = math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffers.pop(key, None)
        del buffer  # the smaller buffer goes before the larger one is made
        buffer = buffers[key] = empty(numel, dtype, device)
    return buffer[:numel].view(shape)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``aten.mm``), written into the scope's buffer."""
    return torch.mm(a, b, out=_take((a.shape[0], b.shape[1]), a.dtype, a.device))


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``bias + a @ b`` (``aten.addmm``), written into the scope's buffer."""
    return torch.addmm(bias, a, b, out=_take((a.shape[0], b.shape[1]), a.dtype, a.device))


def gathered(t: torch.Tensor, index: torch.Tensor, slot: int) -> torch.Tensor:
    """``t.index_select(0, index)`` into the scope's buffer of per-token input ``slot``, on the CPU.

    A tile that runs only some tokens gathers its rows of every per-token input; a distillation's
    teacher log-probabilities make that a ``[tile, V]`` copy per tile. Under a small mmap threshold
    (``MALLOC_MMAP_THRESHOLD_=65536``, which some users set to keep the resident size down)
    each such copy would be a fresh mapping: 8000 page faults a tile of 256 x 32000 float32.
    The traced tile only reads its inputs, and the loop is done with a tile's rows when the next
    tile gathers its own, so one buffer per input serves every tile."""
    buffers = getattr(_local, "buffers", None)
    if t.device.type != "cpu" or buffers is None or is_fake(t):
        return t.index_select(0, index)
    out = _reused(buffers, ("gather", slot, t.dtype), (index.shape[0], *t.shape[1:]), t.dtype, t.device)
    return torch.index_select(t, 0, index, out=out)


def fresh_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``aten.mm``) into a buffer of its own from :func:`empty`: for a large GEMM
    output that outlives the tile (the weight gradient of the only tile)."""
    return torch.mm(a, b, out=empty((a.shape[0], b.shape[1]), a.dtype, a.device))


#: the aten GEMM each function stands for
REPLACES = {torch.ops.aten.mm.default: mm, torch.ops.aten.addmm.default: addmm}
