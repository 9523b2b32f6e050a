"""The split weight-gradient sum's add, formed block by block (see :mod:`tile_pass.tiles._split_planes`).

Also the compiled passes over the planes the tile loop runs outside the graph: the add of a
block (:func:`_compiled_split_add`) and the final rounding (:func:`finish_split`).
"""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.plan import _weight_grad
from tile_pass.tiles import _split_planes, _split_sum_cpu
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


class _BlockedSplitAccumulate(torch.nn.Module):
    """``sum += a @ b`` on the planes of a split float32 sum, the product one block of rows at
    a time (see :func:`tile_pass.plan._split_planes.split_accumulate_mm_`)."""

    _is_impure = True  # it mutates the planes and returns nothing: never dead code

    def __init__(self, add=None, store=None, add_and_round=None):
        super().__init__()
        self.add, self.store, self.add_and_round = add, store, add_and_round

    def forward(self, hi, lo, a, b):
        _split_planes.split_accumulate_mm_(hi, lo, a, b, self.add, self.store, self.add_and_round)


def _compiled_split_add(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor):
    """:func:`tile_pass.plan._split_planes.split_add_` as one vectorized pass over a block (read both
    planes and the product, write both planes): on the CPU the C loop of
    :mod:`tile_pass.tiles._split_sum_cpu`; otherwise compiled by Inductor, once per layout, on the
    planes' int32 words where the rows pair up."""
    c_loop = _split_sum_cpu.add(hi, lo, x)
    if c_loop is not None:
        return c_loop
    words = _split_planes.as_words(hi, lo, x)
    if words is None:
        return inductor_once("split", _split_planes.split_add_, (hi, lo, x))
    compiled = inductor_once("split", _split_planes.add_words_, words)
    return lambda hi, lo, x: compiled(*_split_planes.as_words(hi, lo, x))


def finish_split(hi: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype, compiled: bool) -> torch.Tensor:
    """:func:`tile_pass.plan._split_planes.finish`; with ``compiled``, one vectorized pass with no
    temporaries: on the CPU the C loop of :mod:`tile_pass.tiles._split_sum_cpu`, otherwise (bfloat16
    planes whose rows pair up) an Inductor kernel over the int32 words, compiled once per
    shape. Each rounds as the eager conversion does. Planes the last tile's add already rounded
    (:func:`tile_pass.plan._split_planes.last_add`) are returned as they are."""
    if _split_planes.rounded_by_last_add(hi):
        return hi.view(dtype)
    if compiled:
        rounded = _split_sum_cpu.finish(hi, lo, dtype)
        if rounded is not None:
            return rounded
    words = _split_planes.as_words(hi, lo, lo) if compiled and dtype == torch.bfloat16 else None
    if words is None:
        return _split_planes.finish(hi, lo, dtype)
    inductor_once("finish", _split_planes.round_words_, words[:2])(*words[:2])
    return hi.view(dtype)


class _SplitAddByBlockHeight:
    """The compiled per-block add for each block height a ``[V, H]`` plane is cut into."""

    def __init__(self, adds: dict[int, object]):
        self.adds = adds

    def __call__(self, hi, lo, x):
        self.adds[hi.shape[0]](hi, lo, x)


def run(root: torch.fx.GraphModule, key: TileKernelKey) -> torch.fx.GraphModule:
    """Turn ``split_accumulate_(hi, lo, mm(a, b))`` (modulo double transposes, the product used
    nowhere else) into a blocked product, so the tile never holds a ``[V, H]`` temporary; in
    compiled tiles each block is added by one Inductor kernel."""
    rewritten = 0
    for gm, node in graph_nodes(root):
        if node.target is not torch.ops.tile_pass.split_accumulate_.default:
            continue
        hi, lo, update = node.args
        product = strip_transpose_pairs(update)
        chain = chain_to(update, product)
        if product.target is not aten.mm.default or any(len(n.users) != 1 for n in chain):
            continue
        add = store = add_and_round = None
        if key.compiled:
            V, H = key.vocab_size, key.hidden_size
            itemsize = key.weight_dtype.itemsize
            heights = block_heights(V, _weight_grad.product_block_rows(V, H * itemsize))
            add = _SplitAddByBlockHeight({
                h: _compiled_split_add(
                    torch.empty((h, H), dtype=torch.int16, device=key.device),
                    torch.empty((h, H), dtype=torch.int16, device=key.device),
                    torch.empty((h, H), dtype=key.weight_dtype, device=key.device),
                )
                for h in heights
            })  # fmt: skip
            product_dtype = product.meta["val"].dtype if "val" in product.meta else key.weight_dtype
            row = [
                torch.empty((1, H), dtype=d, device=key.device)
                for d in (torch.int16, torch.int16, product_dtype)
            ]
            store = _split_sum_cpu.store(*row)
            add_and_round = _split_sum_cpu.add_and_round(*row, key.weight_dtype)
        name = f"_split_accumulate_{rewritten}"
        gm.add_submodule(name, _BlockedSplitAccumulate(add, store, add_and_round))
        replace_with_call(gm, node, "call_module", name, (hi, lo, *product.args))
        for dead in chain:
            gm.graph.erase_node(dead)
        rewritten += 1
    recompile_all(root)
    return root
