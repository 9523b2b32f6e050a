"""A half-precision tile's weight gradient added into the float32 sum by Inductor."""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.tiles._tile_kernel import TileKernelKey, inductor_once
from tile_pass.tiles._tile_passes._graph import (
    aten,
    block_heights,
    chain_to,
    graph_nodes,
    recompile_all,
    replace_with_call,
    strip_transpose_pairs,
)
from tile_pass.tiles._tile_passes.compiled_middle import Compiled

#: Rows of the half-precision weight-gradient product formed at a time (see below).
UPCAST_BLOCK_BYTES = 8 * 1024 * 1024


class _BlockedUpcastAccumulate(torch.nn.Module):
    """``acc += a @ b`` for half-precision ``a``, ``b`` and a float32 ``acc``, ``rows`` rows at
    a time: each block of the product is formed in the model dtype, as the derived graph
    forms it, and added by a compiled pass, so the temporary is one block, not ``[V, H]``.
    Every element is the same product over the same tokens; only where it is stored changes.
    """

    _is_impure = True  # it mutates acc and returns nothing: never dead code

    def __init__(self, rows: int, adds: dict[int, object]):
        super().__init__()
        self.rows = rows
        self.adds = adds  # block height -> compiled ``acc_block.add_(block)``

    def forward(self, acc, a, b):
        for start in range(0, acc.shape[0], self.rows):
            stop = min(start + self.rows, acc.shape[0])
            self.adds[stop - start](acc[start:stop], torch.mm(a[start:stop], b))


def _add_(acc: torch.Tensor, x: torch.Tensor) -> None:
    """Compiled by Inductor once per layout (``inductor_once``): the weight-gradient sum has the
    same shape for every tile size, so the kernels of other tile sizes reuse it."""
    acc.add_(x)


def run(root: torch.fx.GraphModule, key: TileKernelKey) -> torch.fx.GraphModule:
    """Compile each ``acc.add_(x)`` whose ``x`` is narrower than ``acc`` with Inductor.

    A half-precision tile's weight gradient is added into the float32 sum once per tile.
    Eager ``add_`` with mixed dtypes converts through a temporary; Inductor makes it one
    vectorised pass (a ``[32000, 512]`` bf16 tile into float32 on 2 CPU cores: 24.5 ms
    eager, 3.0 ms compiled). Where ``x`` is a product ``a @ b`` used nowhere else, it is
    formed and added in blocks of rows (:class:`_BlockedUpcastAccumulate`).
    """
    compiled = 0
    for gm, node in graph_nodes(root):
        if node.target is not aten.add_.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args]
        if not all(isinstance(v, torch.Tensor) for v in vals) or vals[0].dtype == vals[1].dtype:
            continue
        acc, update = node.args
        product = strip_transpose_pairs(update)
        name = f"_accumulate_{compiled}"
        rows = max(1, UPCAST_BLOCK_BYTES // max(1, vals[1][0].numel() * vals[1].element_size()))
        blocked = (
            product.target is aten.mm.default
            and len(update.users) == 1
            and all(len(n.users) == 1 for n in chain_to(update, product))
            and vals[0].dim() == 2
            and vals[0].is_contiguous()
            and rows < vals[0].shape[0]
        )
        if blocked:
            adds = {}  # block height -> compiled ``acc_block.add_(block)``
            for height in block_heights(vals[0].shape[0], rows):
                examples = [torch.empty((height, v.shape[1]), dtype=v.dtype, device=key.device) for v in vals]
                adds[height] = inductor_once("add", _add_, examples)
            gm.add_submodule(name, _BlockedUpcastAccumulate(rows, adds))
            args = (acc, *product.args)
        else:
            example = [
                torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=key.device) for v in vals
            ]
            module = Compiled(inductor_once("add", _add_, example))
            module._is_impure = True  # it mutates acc; its result is unused
            gm.add_submodule(name, module)
            args = node.args
        replace_with_call(gm, node, "call_module", name, args)
        if blocked:  # the full-size product and its views are no longer used
            for dead in chain_to(update, product):
                gm.graph.erase_node(dead)
        compiled += 1
    recompile_all(root)
    return root
