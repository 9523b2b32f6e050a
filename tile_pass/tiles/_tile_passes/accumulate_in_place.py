"""The weight gradient accumulated in place.

The derived graph ends in ``acc.add_(t(t(mm(a, b))))``; where the dtypes allow, that becomes
``acc.addmm_(a, b)``, so no ``[V, H]`` temporary is made per tile. The rewrite changes where
the sum lands, not what is summed.
"""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes._graph import aten, strip_transpose_pairs


def run(gm: torch.fx.GraphModule, key: TileKernelKey | None = None) -> torch.fx.GraphModule:
    """Turn ``acc.add_(mm(a, b))`` (modulo double transposes) into ``acc.addmm_(a, b)``."""
    for node in list(gm.graph.nodes):
        if node.target is not aten.add_.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        acc, update = node.args
        source = strip_transpose_pairs(update)
        if source.target is not aten.mm.default:
            continue
        a, b = source.args
        acc_val, a_val, b_val = acc.meta.get("val"), a.meta.get("val"), b.meta.get("val")
        if acc_val is None or a_val is None or b_val is None:
            continue
        if not (acc_val.dtype == a_val.dtype == b_val.dtype):
            continue  # a half-precision tile gradient is added (upcast) into the fp32 sum
        with gm.graph.inserting_before(node):
            addmm = gm.graph.call_function(aten.addmm_.default, (acc, a, b))
        addmm.meta = dict(node.meta)
        node.replace_all_uses_with(addmm)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
