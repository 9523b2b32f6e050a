"""What the tile passes share: which nodes are GEMMs and views, and walks over a (split) tile graph."""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.tiles import _tile_buffers

aten = torch.ops.aten

GEMMS = {
    aten.mm.default,
    aten.addmm.default,
    aten.addmm_.default,
    *_tile_buffers.REPLACES.values(),
    _tile_buffers.fresh_mm,
}
# detach is traced as aten.alias from torch 2.14 on: both are views
VIEWS = {
    aten.t.default,
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten.transpose.int,
    aten.permute.default,
}


def logits_gemm(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The tile's first GEMM, the one that makes the logits."""
    return next((n for n in gm.graph.nodes if n.target in GEMMS), None)


def strip_transpose_pairs(node: torch.fx.Node) -> torch.fx.Node:
    while (
        node.target is aten.t.default
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target is aten.t.default
    ):
        node = node.args[0].args[0]
    return node


def chain_to(node: torch.fx.Node, source: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from ``node`` back to ``source`` through single-input views, inclusive."""
    chain = [node]
    while chain[-1] is not source:
        chain.append(chain[-1].args[0])
    return chain


def view_source(value):
    """What ``value`` is a view of, through any chain of views (``value`` itself if none)."""
    while isinstance(value, torch.fx.Node) and value.op != "placeholder" and value.target in VIEWS:
        value = value.args[0]
    return value


def results(gm: torch.fx.GraphModule) -> tuple[list, bool]:
    """What a graph returns, in order, and whether it returns one value rather than a tuple."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    single = isinstance(out, torch.fx.Node)
    return ([out] if single else list(out)), single


def graph_nodes(root: torch.fx.GraphModule):
    """Every ``(graph module, node)`` of ``root`` and of the graph modules nested in it (the
    parts of a split tile), listed up front so that a pass may add and erase nodes; the calls
    of those nested modules (``call_module``) are not listed: no pass rewrites them."""
    for module in [m for m in root.modules() if isinstance(m, torch.fx.GraphModule)]:
        for node in [n for n in module.graph.nodes if n.op != "call_module"]:
            yield module, node


def replace_with_call(gm: torch.fx.GraphModule, node: torch.fx.Node, op: str, target, args) -> None:
    """Put a call of ``target`` (``op``: ``call_function`` or ``call_module``) in ``node``'s place."""
    with gm.graph.inserting_before(node):
        call = gm.graph.create_node(op, target, tuple(args))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)


def recompile_all(root: torch.fx.GraphModule) -> None:
    for module in root.modules():
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()


def block_heights(rows: int, block_rows: int) -> set[int]:
    """The heights of the row blocks ``rows`` rows are cut into, ``block_rows`` at a time."""
    return {min(block_rows, rows), rows % block_rows if rows > block_rows else 0} - {0}
