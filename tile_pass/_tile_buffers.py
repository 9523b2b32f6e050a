"""One logits buffer for all the tiles of a loop, on the CPU.

A tile's logits GEMM writes a fresh ``[tile, V]`` tensor. On the CPU an allocation that
large is a mapping of its own (glibc hands blocks above its 32 MiB threshold back to the OS
when they are freed), so every tile pays again for faulting its pages in: 37 ms of a
512 x 128256 bfloat16 tile's 122 ms logits GEMM on a 2-core Xeon. The tile loops run inside
:func:`shared`, and the logits GEMM of every derived tile graph (rewritten by
:func:`tile_pass._tile_kernel.finish_tile_graph`) writes into that scope's buffer instead:
allocated by the first tile, reused by the others, freed when the loop ends. Outside a scope
(or on an accelerator, whose caching allocator already reuses memory) each GEMM allocates as
before.

Reuse is safe because a tile's logits, and the gradient stored over them, are dead when its
graph returns, but for what it returns, and the loops copy every returned tile (kept logits,
returned rows) into their outputs before the next tile runs. A shorter last tile takes a
prefix of the same buffer, so the buffer is never held twice.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch

_local = threading.local()


@contextlib.contextmanager
def shared() -> Iterator[None]:
    """Run the tiles of one loop with one shared logits buffer per dtype, freed on exit."""
    outer = getattr(_local, "buffers", None)
    _local.buffers = {}
    try:
        yield
    finally:
        _local.buffers = outer


def _take(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        return torch.empty(shape, dtype=dtype, device=device)
    numel, key = math.prod(shape), (dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffers.pop(key, None)
        del buffer  # the smaller buffer goes before the larger one is made
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``aten.mm``), written into the scope's buffer."""
    return torch.mm(a, b, out=_take((a.shape[0], b.shape[1]), a.dtype, a.device))


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``bias + a @ b`` (``aten.addmm``), written into the scope's buffer."""
    return torch.addmm(bias, a, b, out=_take((a.shape[0], b.shape[1]), a.dtype, a.device))


#: the aten GEMM each function stands for
REPLACES = {torch.ops.aten.mm.default: mm, torch.ops.aten.addmm.default: addmm}
