"""The passes every derived tile graph gets, in order, after :func:`tile_pass.tiles._tile_kernel.trace_fake`.

As Inductor's ``post_grad`` passes: each one an exact rewrite of the graph (where a value is
stored or which kernel computes it, never what it is), a module of its own with its reason
and its test, applied by :func:`finish_tile_graph` where its predicate holds for the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch.fx

from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes import (
    accumulate_in_place,
    compiled_middle,
    huge_pages,
    onednn_gemms,
    shared_logits_buffer,
    split_accumulation,
    upcast_accumulation,
)


class TilePass(NamedTuple):
    """``run(gm, key) -> gm``, applied where ``applies(key)``."""

    run: Callable[[torch.fx.GraphModule, TileKernelKey], torch.fx.GraphModule]
    applies: Callable[[TileKernelKey], bool]


#: The order is semantics. The in-place ``addmm_`` comes first: the split below counts it as a
#: backward GEMM (so the weight gradient stays out of the middle), and the middle's row blocks
#: are traced and fused alike. The CPU buffer passes retarget GEMMs of the flat graph, before the
#: split moves them into its parts. The middle is split off while every backward product is
#: still an ``aten.mm`` (a GEMM of the split); the blocked accumulations then find those products
#: in the split's parts; oneDNN comes last, as it replaces the ``aten.mm`` they look for, and
#: the buffer passes leave its float32 GEMMs alone.
TILE_PASSES: tuple[TilePass, ...] = (
    TilePass(accumulate_in_place.run, lambda key: True),
    TilePass(shared_logits_buffer.run, lambda key: key.device.type == "cpu"),
    TilePass(huge_pages.run, lambda key: key.device.type == "cpu"),
    TilePass(compiled_middle.run, lambda key: key.compiled),
    TilePass(upcast_accumulation.run, lambda key: key.compiled),
    TilePass(split_accumulation.run, lambda key: key.weight_grad is WeightGradSchedule.SPLIT),
    TilePass(onednn_gemms.run, lambda key: key.onednn),
)


def finish_tile_graph(gm: torch.fx.GraphModule, key: TileKernelKey, retrace=None) -> torch.fx.GraphModule:
    """``gm`` after :data:`TILE_PASSES`. ``retrace(rows)``: the same tile function traced at
    ``rows`` tokens, for the CPU's blocked middle (without it the middle runs whole)."""
    gm.meta[compiled_middle.RETRACE] = retrace
    for tile_pass in TILE_PASSES:
        if tile_pass.applies(key):
            gm = tile_pass.run(gm, key)
    gm.meta.pop(compiled_middle.RETRACE, None)
    return gm
