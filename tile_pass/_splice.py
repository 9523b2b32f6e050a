"""Splice a matched region into the graph: one call of the tiled op in place of its nodes.

The matcher (:mod:`tile_pass._region_match`) only proves a region row-wise and records it as a
:class:`~tile_pass._region_match.RowRegion`; this module changes the graph, in named steps:
hoist the op's inputs above its first reader, slice and cast the tiles' rows, call the op, restore
each output to the shape the user's graph gave it, hand returned logits to the caller, erase the
region. Nothing is changed before every step that can refuse has run.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tile_pass import _region, _rules
from tile_pass._fx import NoMatch, describe, val
from tile_pass._plan import RegionCall
from tile_pass._region import Layout, RowProgram
from tile_pass._region_match import RowRegion
from tile_pass._returned_logits import ReturnedLogits
from tile_pass._token_layout import after_tiles, per_token, restore, select, spread
from tile_pass.tiled_region import run_region


class _ProgramPrefix(torch.nn.Module):
    """The returned rows of a region, computed whole, for the gradient path of logits that are
    also returned (see :mod:`tile_pass._returned_logits`): the same program, on all tokens."""

    def __init__(self, program: RowProgram, output: int, flat_tokens: bool, has_bias: bool):
        super().__init__()
        self.program, self.output, self.flat_tokens, self.has_bias = program, output, flat_tokens, has_bias

    def forward(self, hidden, weight, *rest):
        bias, rest = (rest[0], rest[1:]) if self.has_bias else (None, rest)
        count = len(self.program.token_layouts)
        flat = hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0)
        outputs = _region.run_program(
            self.program, flat, weight, bias, list(rest[:count]), list(rest[count:])
        )
        return restore(outputs[self.output], hidden, self.flat_tokens)


def _to_hoist(graph: torch.fx.Graph, nodes, point: torch.fx.Node, autocast_states) -> list[torch.fx.Node]:
    """The op's inputs defined after ``point`` (its insertion point), in an order they can be
    moved before it: pure torch ops only, in the same autocast context as ``point``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moving: list[torch.fx.Node] = []

    def need(node):
        if not isinstance(node, torch.fx.Node) or order[node] < order[point] or node in moving:
            return
        if _rules.rule_for(node) is None and node.target != "expand":
            raise NoMatch("{} is computed after the logits are first read and cannot be moved before the "
                          "tiled region; compute it before the LM head", node)  # fmt: skip
        if autocast_states.get(node, ()) != autocast_states.get(point, ()):
            raise NoMatch("{} is computed in another autocast context than the region's first reader", node)
        for arg in node.all_input_nodes:
            need(arg)
        moving.append(node)

    for node in nodes:
        need(node)
    return moving


def rewrite_row_region(
    graph: torch.fx.Graph,
    region: RowRegion,
    *,
    call: RegionCall,
    result,
    autocast_states,
) -> str:
    """Replace the region by one call of :func:`tile_pass.tiled_region.run_region`; returns how
    returned rows were handled. Raises ``NoMatch`` before changing anything."""
    members = set(region.nodes) | set(region.reduction_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for n in members for u in n.users if u not in members]
    point = min(readers, key=order.__getitem__)
    inputs = [region.hidden, region.weight, region.bias, *[t.node for t in region.token_inputs],
              *[r.node for r in region.row_inputs], *region.reduce_inputs]  # fmt: skip
    torch.fx.node.map_arg(region.slices, inputs.append)  # symbolic slice bounds
    for node in _to_hoist(graph, inputs, point, autocast_states):
        point.prepend(node)

    economy = region.program.reduction is not None
    existing = set(graph.nodes)
    with graph.inserting_before(point):
        tokens = region.hidden  # the rows the tiles run: the hidden states after the token slices
        for index in region.slices:
            tokens = graph.call_function(operator.getitem, (tokens, index))
        hidden, weight, bias = tokens, region.weight, region.bias
        if bias is not None and val(bias).dim() != 1:  # a [1, 1, V] bias added after the matmul
            bias = graph.call_method("reshape", (bias, (-1,)))
        if region.autocast_dtype is not None:  # what autocast does to F.linear's inputs
            hidden, weight = (graph.call_method("to", (t, region.autocast_dtype)) for t in (hidden, weight))
            if bias is not None:
                bias = graph.call_method("to", (bias, region.autocast_dtype))

        def given(entry):  # what the op takes: detached unless a node that needs a gradient reads it
            needs = getattr(val(entry.node), "requires_grad", False) and not entry.differentiable
            return graph.call_method("detach", (entry.node,)) if needs else entry.node

        token_nodes = [
            graph.call_function(per_token, (given(t), tokens, t.flat_tokens, len(t.part)))
            if t.subset is None
            else graph.call_function(spread, (given(t), tokens, t.flat_tokens, len(t.part), t.subset))
            for t in region.token_inputs
        ]  # fmt: skip
        row_nodes = [
            given(r) if r.whole else graph.call_method("reshape", (given(r), () if r.zero_dim else (-1,)))
            for r in region.row_inputs
        ]
        reduce_nodes = [tokens if n is region.hidden else n for n in region.reduce_inputs]
        call = graph.call_function(
            run_region, (hidden, weight, bias, token_nodes, row_nodes, reduce_nodes),
            {"call": call.key},
        )  # fmt: skip
        offset = 1 if economy else 0
        restored = {}
        for k, out in enumerate(region.outputs):
            if economy and out.node is region.sink:  # the op's loss (below) replaces it
                continue
            flat = graph.call_function(operator.getitem, (call, k + offset))
            rows = tokens
            if out.subset is not None:
                flat = graph.call_function(select, (flat, tokens, out.subset))
                rows = graph.call_function(operator.getitem, (tokens, out.subset))
            if out.after_tiles is not None:
                after = out.after_tiles
                args = (flat, after.how, rows, out.flat_tokens, *after.operands)
                value = graph.call_function(after_tiles, args)
            else:
                value = graph.call_function(restore, (flat, rows, out.flat_tokens))
            restored[out.node] = value
            out.node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in members)
        if economy:
            loss = graph.call_function(operator.getitem, (call, 0))
            loss.meta.update(region.sink.meta)
            region.sink.replace_all_uses_with(loss)

    anchor = (region.sink or region.outputs[0].node).meta.get("stack_trace")
    for node in graph.nodes:  # the inserted nodes show the loss's line in dumps and traces
        if node not in existing and anchor and not node.meta.get("stack_trace"):
            node.meta["stack_trace"] = anchor
    handled = "not returned"
    if region.kept_whole:
        handled = (
            "returned whole, as the graph computes them (the caller asked for all of them); the loss "
            "tiles the sliced hidden states, so the loss's own float32 copy and gradient of the logits "
            "are not formed"
        )
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    returned = [o for o in region.outputs if o.shape.layout is Layout.ROWS]
    if returned or region.dropped:
        if result.num_outputs == 0:
            result.num_outputs = len(outputs)
        extra_base = len(outputs) - result.num_outputs
        extras: list[torch.fx.Node] = []
        for node in region.dropped:
            for position in [i for i, n in enumerate(outputs) if n is node]:
                outputs[position] = None
                result.returned_logits.append(ReturnedLogits(
                    position, [extra_base + len(extras)], None, val(region.weight).shape[0], val(node).dtype
                ))  # fmt: skip
                extras.append(region.hidden)
            handled = "dropped (drop_logits=True): a zero-byte NaN placeholder is returned"
        prefix_inputs = [hidden, weight, *([bias] if bias is not None else []), *token_nodes, *row_nodes]
        for out in returned:
            k = region.outputs.index(out)
            for position in [i for i, n in enumerate(outputs) if n is restored[out.node]]:
                if out.differentiable:
                    prefix = _ProgramPrefix(region.program, k, out.flat_tokens, region.bias is not None)
                    first = extra_base + len(extras)
                    result.returned_logits.append(
                        ReturnedLogits(position, list(range(first, first + len(prefix_inputs))), prefix)
                    )
                    extras += prefix_inputs
            handled = (
                "returned exactly, written by the tiles (no extra GEMM) in the dtype the graph returns, and "
                "its gradient is computed only if the caller uses it"
            )
        output.args = ((*outputs, *extras),)
    kept: set[torch.fx.Node] = set()  # the returned rows before a slice, and what they are computed from
    stack = list(region.kept_whole)
    while stack:
        node = stack.pop()
        if node in members and node not in kept:
            kept.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(members - kept, key=order.__getitem__, reverse=True):
        if node.users:
            raise RuntimeError(f"tile_pass: internal error, {describe(node)} is still read after the rewrite")
        graph.erase_node(node)
    return handled
