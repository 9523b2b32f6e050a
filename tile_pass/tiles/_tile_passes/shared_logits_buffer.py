"""On the CPU, the logits GEMM writes into the tile loop's shared buffer (see
:mod:`tile_pass.tiles._tile_buffers`).

A tile's logits, and the gradient stored over them, are dead when its graph returns, except in
what the graph returns: the tile loops copy every returned tile (kept logits, returned rows)
into their outputs before the next tile runs. A float32 GEMM routed to oneDNN, which writes no
given buffer, keeps its own.
"""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.tiles import _tile_buffers
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes._graph import logits_gemm


def run(gm: torch.fx.GraphModule, key: TileKernelKey) -> torch.fx.GraphModule:
    logits = logits_gemm(gm)
    if logits is None or logits.target not in _tile_buffers.REPLACES:
        return gm
    tile = logits.meta.get("val")
    if logits.kwargs or not isinstance(tile, torch.Tensor) or not tile.is_contiguous():
        return gm
    if key.onednn and tile.dtype == torch.float32:
        return gm
    logits.target = _tile_buffers.REPLACES[logits.target]
    gm.recompile()
    return gm
