"""On the CPU, each GEMM output the graph returns (the weight gradient of the only tile) gets a
buffer from :func:`tile_pass.tiles._tile_buffers.empty`, which puts it on huge pages where it is
large enough.

A float32 GEMM that :mod:`.onednn_gemms` routes to oneDNN keeps its own; a GEMM whose output
is summed into, not returned, is left to the weight-gradient schedules.
"""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.tiles import _tile_buffers
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes import onednn_gemms
from tile_pass.tiles._tile_passes._graph import aten, logits_gemm, results, view_source


def run(gm: torch.fx.GraphModule, key: TileKernelKey) -> torch.fx.GraphModule:
    moved, logits = 0, logits_gemm(gm)
    for node in {view_source(result) for result in results(gm)[0]}:
        if not isinstance(node, torch.fx.Node) or node.target is not aten.mm.default or node.kwargs:
            continue
        val = node.meta.get("val")
        to_onednn = key.onednn and (node is logits or onednn_gemms.backward_products_on_onednn())
        if not isinstance(val, torch.Tensor) or (to_onednn and val.dtype == torch.float32):
            continue
        node.target = _tile_buffers.fresh_mm
        moved += 1
    if moved:
        gm.recompile()
    return gm
