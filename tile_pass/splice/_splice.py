"""Splice a matched region into the graph: one call of the tiled op in place of its nodes.

The matcher (:mod:`tile_pass.match._region_match`) only proves a region row-wise and records it as a
:class:`~tile_pass.match._records.RowRegion`; this module changes the graph, in named steps:
hoist the op's inputs above its first reader, slice and cast the tiles' rows, call the op, restore
each output to the shape the user's graph gave it, hand returned logits to the caller, erase the
region. Nothing is changed before every step that can refuse has run.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from tile_pass.match import _rules
from tile_pass.match._fx import NoMatch, describe, projection_of, val
from tile_pass.match._matcher import memory, writes_in_place
from tile_pass.match._records import RowRegion
from tile_pass.plan._plan import RegionCall
from tile_pass.program import _region
from tile_pass.program._op_facts import spelling
from tile_pass.program._region import Layout, RowProgram
from tile_pass.program._row_selection import selected_tokens
from tile_pass.program._token_layout import after_tiles, per_token, restore, select, spread
from tile_pass.splice._returned_logits import ReturnedLogits
from tile_pass.tiles.tiled_region import run_region


class _ProgramPrefix(torch.nn.Module):
    """The returned rows of a region, computed whole, for the gradient path of logits that are
    also returned (see :mod:`tile_pass.splice._returned_logits`): the same program, on all tokens."""

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


def _grad_modes(graph: torch.fx.Graph) -> dict[torch.fx.Node, bool]:
    """Whether each node runs with gradients enabled, as far as the graph's own
    ``torch.no_grad()`` / ``enable_grad()`` blocks say (Dynamo records them as
    ``torch._C._set_grad_enabled`` calls); relative to the mode the graph is called in."""
    enabled, modes = True, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled and node.args:
            enabled = bool(node.args[0])
        modes[node] = enabled
    return modes


def _writes_in_place(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``user`` writes ``node``'s memory in place (``x[mask] = 0``, ``x.add_(1)``)."""
    if user.op not in ("call_function", "call_method") or not user.args or user.args[0] is not node:
        return False
    if user.target is operator.setitem:
        return True
    spelled = spelling(user.target)
    return spelled is not None and spelled.inplace


#: methods with no row-wise rule that are pure all the same (no write, no randomness, no sync)
_PURE = {"expand", "clone", torch.clone}


def _pure_projection(node: torch.fx.Node) -> bool:
    """A projection (``F.linear``, ``h @ W.T``) or the transpose of its weight: pure ops that may
    move (a reference model's frozen head computed after the policy's logits are read)."""
    return projection_of(node) is not None or any(
        (linear := projection_of(user)) is not None and linear[3] is node for user in node.users
    )


def _to_hoist(graph: torch.fx.Graph, nodes, point: torch.fx.Node, autocast_states) -> list[torch.fx.Node]:
    """The op's inputs defined after ``point`` (its insertion point), in an order they can be
    moved before it: pure torch ops only (row-wise ops, projections), in the same autocast
    context as ``point``, and in its grad mode unless nothing they read needs a gradient (then
    either mode computes the same value, with no gradient)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    modes = _grad_modes(graph)
    moving: list[torch.fx.Node] = []

    def need(node):
        if not isinstance(node, torch.fx.Node) or order[node] < order[point] or node in moving:
            return
        if _rules.rule_for(node) is None and node.target not in _PURE and not _pure_projection(node):
            raise NoMatch("{} is computed after the logits are first read and cannot be moved before the "
                          "tiled region; compute it before the LM head", node)  # fmt: skip
        if autocast_states.get(node, ()) != autocast_states.get(point, ()):
            raise NoMatch("{} is computed in another autocast context than the region's first reader", node)
        if written := next((u for u in node.users if _writes_in_place(u, node)), None):
            raise NoMatch("{} is computed after the logits are first read and written in place by {}; "
                          "moving it before the tiled region would read it unwritten: compute it before "
                          "the LM head", node, written)  # fmt: skip
        needs_grad = any(getattr(val(a), "requires_grad", False) for a in node.all_input_nodes)
        if modes[node] != modes[point] and needs_grad:
            raise NoMatch("{} is computed in another grad mode (torch.no_grad) than the region's first "
                          "reader, from values that need a gradient; compute it before the LM head",
                          node)  # fmt: skip
        for arg in node.all_input_nodes:
            need(arg)
        moving.append(node)

    for node in nodes:
        need(node)
    return moving


@dataclass
class Splice:
    """What one region's splice made, step by step; the report reads it (``returned_logits``)."""

    region: RowRegion
    call: RegionCall
    members: set[torch.fx.Node] = field(default_factory=set)
    point: torch.fx.Node | None = None  # the region's first reader outside it: the op goes before it
    tokens: torch.fx.Node | None = None  # the rows the tiles run: the hidden states after the token slices
    head: tuple = ()  # (hidden, weight, bias) as the op takes them: sliced, reshaped, cast
    token_nodes: list[torch.fx.Node] = field(default_factory=list)
    row_nodes: list[torch.fx.Node] = field(default_factory=list)
    op: torch.fx.Node | None = None  # the call of run_region
    restored: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)  # output -> its new value
    returned_logits: str = "not returned"  # how logits the graph also returns are handled


def rewrite_row_region(
    graph: torch.fx.Graph, region: RowRegion, *, call: RegionCall, result, autocast_states
) -> Splice:
    """Replace the region by one call of :func:`tile_pass.tiles.tiled_region.run_region`, in named steps.
    Raises ``NoMatch`` (from :func:`_hoist`, the only step that can refuse) before changing anything."""
    splice = Splice(region, call, members=set(region.nodes) | _erased_reduction(region))
    existing = set(graph.nodes)
    _hoist(graph, splice, autocast_states)
    with graph.inserting_before(splice.point):
        _slice_and_cast(graph, splice)
        _per_token_inputs(graph, splice)
        _call(graph, splice)
        _restore_outputs(graph, splice)
    _show_the_loss_line(graph, splice, existing)
    _hand_back_returned_logits(graph, splice, result)
    _after_the_op(graph, splice)
    _erase(graph, splice)
    return splice


def _after_the_op(graph: torch.fx.Graph, splice: Splice) -> None:
    """The graph's own views of rows the op returns whole (``logits[:, 0]`` returned beside the
    rows it selects from), which only the graph's output reads, move to just before the output."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in splice.region.left_to_graph:
        output.prepend(node)


def _hoist(graph: torch.fx.Graph, splice: Splice, autocast_states) -> None:
    """The op goes before the region's first outside reader; its inputs computed later move up."""
    region = splice.region
    order = {n: i for i, n in enumerate(graph.nodes)}
    left = set(region.left_to_graph)  # views of returned rows: they move after the op (_after_the_op)
    readers = [u for n in splice.members for u in n.users if u not in splice.members and u not in left]
    splice.point = min(readers, key=order.__getitem__)
    inputs = [region.hidden, region.weight, region.bias, *[t.node for t in region.token_inputs],
              *[r.node for r in region.row_inputs], *region.reduce_inputs]  # fmt: skip
    torch.fx.node.map_arg(region.slices, inputs.append)  # symbolic slice bounds
    _read_as_written(graph, inputs, splice, order)
    for node in _to_hoist(graph, inputs, splice.point, autocast_states):
        splice.point.prepend(node)


def _read_as_written(graph: torch.fx.Graph, inputs, splice: Splice, order: dict) -> None:
    """Each input the op reads at its point holds there the value the region's nodes read in
    eager: no in-place write to its memory (through any name) comes between the point and a
    reader. A buffer the user's code writes the region's own values into and then reads
    (``lse[a:b] = logits[a:b].logsumexp(-1)``, then ``picked - lse``) would be read unwritten."""
    writes: dict[int, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if writes_in_place(node) and memory(node.args[0]) is not None:
            writes.setdefault(memory(node.args[0]), []).append(order[node])
    point = order[splice.point] - 0.5  # the op runs just before the point
    for node in inputs:
        if not isinstance(node, torch.fx.Node) or memory(node) not in writes:
            continue
        for reader in [u for u in node.users if u in splice.members] or [node]:  # where eager reads it
            low, high = sorted((point, order[reader]))
            written = [w for w in writes[memory(node)] if low < w < high]
            if written:
                raise NoMatch("{} reads {} after {} writes into its memory in place, but the tiled region "
                              "runs before that write and would read it unwritten; compute it out of place "
                              "(torch.cat of the pieces) instead", reader, node,
                              next(n for n in graph.nodes if order[n] == written[0]))  # fmt: skip


def _slice_and_cast(graph: torch.fx.Graph, splice: Splice) -> None:
    """The token slices of the hidden states, a broadcast bias flattened, autocast's casts."""
    region = splice.region
    tokens = region.hidden
    for index in region.slices:
        tokens = graph.call_function(operator.getitem, (tokens, index))
    hidden, weight, bias = tokens, region.weight, region.bias
    if bias is not None and val(bias).dim() != 1:  # a [1, 1, V] bias added after the matmul
        bias = graph.call_method("reshape", (bias, (-1,)))
    if region.autocast_dtype is not None:  # what autocast does to F.linear's inputs
        hidden, weight = (graph.call_method("to", (t, region.autocast_dtype)) for t in (hidden, weight))
        if bias is not None:
            bias = graph.call_method("to", (bias, region.autocast_dtype))
    splice.tokens, splice.head = tokens, (hidden, weight, bias)


def _per_token_inputs(graph: torch.fx.Graph, splice: Splice) -> None:
    """The op's per-token inputs flat over the tiles' rows, its row-shared inputs as the rows take
    them; detached unless a node that needs a gradient reads them."""

    def given(entry):
        needs = getattr(val(entry.node), "requires_grad", False) and not entry.differentiable
        return graph.call_method("detach", (entry.node,)) if needs else entry.node

    tokens = splice.tokens
    splice.token_nodes = [
        graph.call_function(per_token, (given(t), tokens, t.flat_tokens, len(t.part)))
        if t.subset is None
        else graph.call_function(spread, (given(t), tokens, t.flat_tokens, len(t.part), t.subset))
        for t in splice.region.token_inputs
    ]  # fmt: skip
    splice.row_nodes = [
        given(r) if r.whole else graph.call_method("reshape", (given(r), () if r.zero_dim else (-1,)))
        for r in splice.region.row_inputs
    ]


def _call(graph: torch.fx.Graph, splice: Splice) -> None:
    reduce_nodes = [splice.tokens if n is splice.region.hidden else n for n in splice.region.reduce_inputs]
    splice.op = graph.call_function(
        run_region,
        (*splice.head, splice.token_nodes, splice.row_nodes, reduce_nodes),
        {"call": splice.call.key},
    )


def _restore_outputs(graph: torch.fx.Graph, splice: Splice) -> None:
    """Each output read back in the shape the user's graph gave it (a selection's rows, a token
    reduction finished after the tiles); the op's scalar loss replaces the region's sink."""
    region, tokens = splice.region, splice.tokens
    economy = region.program.reduction is not None
    offset = 1 if economy else 0
    for k, out in enumerate(region.outputs):
        if economy and out.node is region.sink:  # the op's loss (below) replaces it
            continue
        flat = graph.call_function(operator.getitem, (splice.op, k + offset))
        rows = tokens
        if out.subset is not None:
            flat = graph.call_function(select, (flat, tokens, out.subset))
            rows = graph.call_function(selected_tokens, (tokens, out.subset))
        if out.after_tiles is not None:
            after = out.after_tiles
            value = graph.call_function(
                after_tiles, (flat, after.how, rows, out.flat_tokens, *after.operands)
            )
        else:
            value = graph.call_function(restore, (flat, rows, out.flat_tokens))
        splice.restored[out.node] = value
        out.node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in splice.members)
    if economy:
        loss = graph.call_function(operator.getitem, (splice.op, 0))
        loss.meta.update(region.sink.meta)
        region.sink.replace_all_uses_with(loss)


def _show_the_loss_line(graph: torch.fx.Graph, splice: Splice, existing: set) -> None:
    """The inserted nodes show the loss's line in dumps and traces."""
    anchor = (splice.region.sink or splice.region.outputs[0].node).meta.get("stack_trace")
    for node in graph.nodes:
        if node not in existing and anchor and not node.meta.get("stack_trace"):
            node.meta["stack_trace"] = anchor


def _hand_back_returned_logits(graph: torch.fx.Graph, splice: Splice, result) -> None:
    """Logits the graph also returns: kept whole where the caller asked for all of them, dropped
    under ``drop_logits``, or written by the tiles with a gradient path (see _returned_logits)."""
    region = splice.region
    if region.kept_whole:
        splice.returned_logits = (
            "returned whole, as the graph computes them (the caller asked for all of them); the loss "
            "tiles the sliced hidden states, so the loss's own float32 copy and gradient of the logits "
            "are not formed"
        )
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    returned = [o for o in region.outputs if o.shape.layout is Layout.ROWS]
    if not (returned or region.dropped):
        return
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
        splice.returned_logits = "dropped (drop_logits=True): a zero-byte NaN placeholder is returned"
    hidden, weight, bias = splice.head
    prefix_inputs = [
        hidden,
        weight,
        *([bias] if bias is not None else []),
        *splice.token_nodes,
        *splice.row_nodes,
    ]
    for out in returned:
        k = region.outputs.index(out)
        for position in [i for i, n in enumerate(outputs) if n is splice.restored[out.node]]:
            if out.differentiable:
                prefix = _ProgramPrefix(region.program, k, out.flat_tokens, region.bias is not None)
                first = extra_base + len(extras)
                result.returned_logits.append(
                    ReturnedLogits(position, list(range(first, first + len(prefix_inputs))), prefix)
                )
                extras += prefix_inputs
        splice.returned_logits = (
            "returned exactly, written by the tiles (no extra GEMM) in the dtype the graph returns, and "
            "its gradient is computed only if the caller uses it"
        )
    output.args = ((*outputs, *extras),)


def _erased_reduction(region) -> set[torch.fx.Node]:
    """The loss's nodes the op replaces: all but those a value outside the loss is also computed
    from (a detached reward of each sequence), which the graph keeps computing from the op's
    outputs."""
    reduction = set(region.reduction_nodes)
    inside = reduction | set(region.nodes)
    kept: set[torch.fx.Node] = set()
    todo = [n for n in reduction if n is not region.sink and any(u not in inside for u in n.users)]
    while todo:
        node = todo.pop()
        if node in kept:
            continue
        kept.add(node)
        todo.extend(a for a in node.all_input_nodes if a in reduction)
    return reduction - kept


def _erase(graph: torch.fx.Graph, splice: Splice) -> None:
    """The region's nodes, except returned rows before a slice and what they are computed from."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept: set[torch.fx.Node] = set()
    stack = list(splice.region.kept_whole)
    while stack:
        node = stack.pop()
        if node in splice.members and node not in kept:
            kept.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(splice.members - kept, key=order.__getitem__, reverse=True):
        if node.users:
            raise RuntimeError(f"tile_pass: internal error, {describe(node)} is still read after the rewrite")
        graph.erase_node(node)
