"""Finding the region and its outputs: every node that depends on the logits, classified in graph
order by its op's rule, and the region values read outside the region."""

from __future__ import annotations

import torch
import torch.fx

from tile_pass.match._fx import NoMatch, as_linear, describe, same, val
from tile_pass.match._matcher import RegionMatcher, memory, writes_in_place
from tile_pass.match._partners import add_partner, partner_projections
from tile_pass.match._records import RegionOutput, RegionOutputs
from tile_pass.match._rule_base import Shape
from tile_pass.match._selections import leave_returned_selections, row_selection, token_slice
from tile_pass.match._sharding import no_op_redistribute
from tile_pass.program._op_facts import facts_for
from tile_pass.program._region import Layout


def _projection_like(node: torch.fx.Node) -> bool:
    """A linear layer or matmul: where the logits' cone stops (a later layer's inputs)."""
    try:
        return as_linear(node) is not None
    except NoMatch:
        return True


def bias_after(matcher: RegionMatcher, node: torch.fx.Node) -> bool:
    """``x @ W.t() + b`` (or ``logits += b``) with a ``[V]`` bias of the logits' dtype, the
    projection's only reader: the bias joins the projection, so a learnable bias is
    differentiated as a linear's is; the tiles still add it after the matmul, rounding the
    product first as eager does (``F.linear(x, W, b)``'s one rounding less moves half-precision
    soft-capped losses off eager's, issue 48)."""
    facts = facts_for(node.target) if node.op in ("call_function", "call_method") else None
    if facts is None or not facts.bias_add:
        return False
    if (
        matcher.bias is not None
        or matcher.shard is not None
        or matcher.autocast_dtype is not None
        or node.kwargs
    ):
        return False
    if len(node.args) != 2 or list(matcher.projection.users) != [node] or len(matcher.program) > 1:
        return False
    logits, bias = node.args if node.args[0] is matcher.projection else node.args[::-1]
    if logits is not matcher.projection or not isinstance(bias, torch.fx.Node) or bias in matcher.depends:
        return False
    logits_val, bias_val, out_val = val(logits), val(bias), val(node)
    if not isinstance(bias_val, torch.Tensor) or out_val is None or bias_val.dim() == 0:
        return False
    if bias_val.dtype != logits_val.dtype or out_val.dtype != logits_val.dtype:
        return False  # a promoting add is not the linear's
    if bias_val.device != logits_val.device or not same(bias_val.shape[-1], matcher.vocab):
        return False
    if bias_val.dim() > logits_val.dim() or not all(same(d, 1) for d in bias_val.shape[:-1]):
        return False
    matcher.bias, matcher.bias_added = bias, True
    matcher.head_form += " + bias"
    matcher.values[node] = matcher.values[matcher.projection]
    return True


def walk(matcher: RegionMatcher) -> None:
    """Every node that depends on the logits, in graph order: it joins the region by its op's rule, or
    its reason is kept in ``matcher.outside``."""
    cone = {matcher.projection}  # reached from the logits without another projection between
    partners = partner_projections(matcher)
    for node in matcher.graph.nodes:
        if node in partners:
            try:
                add_partner(matcher, node)
                matcher.depends.add(node)
            except NoMatch as why:
                matcher.outside[node] = why.but(node=node)
            continue
        if node is matcher.projection or not any(a in matcher.depends for a in node.all_input_nodes):
            continue
        matcher.depends.add(node)
        if writes_in_place(node) and memory(node.args[0]) is not None:  # a buffer given the logits' values
            matcher.written.setdefault(memory(node.args[0]), node)
        if any(a in cone for a in node.all_input_nodes) and not _projection_like(node):
            cone.add(node)
            # a loss-like op reading the logits, however far: this projection is a head
            facts = facts_for(node.target) if node.op in ("call_function", "call_method") else None
            sign = facts is not None and facts.head_sign
            read = val(node.args[0] if node.args else node.kwargs.get("input"))  # over this vocabulary
            matcher.head_signs |= sign and read is not None and same(read.shape[-1], matcher.vocab)
        if any(a in matcher.depends and a not in matcher.values for a in node.all_input_nodes):
            matcher.outside[node] = NoMatch(
                "{} reads a value computed from the logits outside the region", node
            )
            continue
        if matcher.shard is not None and no_op_redistribute(node):
            matcher.values[node] = matcher.values[node.args[0]]  # ColwiseParallel's output hook
            continue
        try:
            if row_selection(matcher, node) or token_slice(matcher, node) or bias_after(matcher, node):
                continue
            selection = matcher.selection_of(node)
            classified = matcher.classify(node)
        except NoMatch as why:
            matcher.outside[node] = why.but(node=node)
            continue
        for entry in classified:
            matcher.add(node, entry, selection=selection)
        matcher.no_gradient_through(node)


def collect_outputs(matcher: RegionMatcher) -> RegionOutputs | None:
    """The region values read outside the region; None if it holds no head."""
    if not matcher.head_signs:
        return None
    leave_returned_selections(matcher)
    outputs, dropped, kept_whole = [], [], []
    for node, record in matcher.values.items():
        users = [u for u in node.users if u not in matcher.values]
        if not users:
            continue
        index, shape = record.value.index, record.shape
        if record.after_tiles is not None:  # the output is the tiles' per-token value
            grad = bool(val(node).requires_grad)
            shape = Shape(record.value.shape.layout, record.shape.tokens)  # its own token dims
            outputs.append(RegionOutput(node, index, shape, grad, record.after_tiles))
            continue
        if shape.layout is Layout.TUPLE:
            raise NoMatch("{} is used whole; take its values and indices apart first", node)
        if shape.layout is Layout.ROWS:
            left = _rows_left(matcher, node, users)
            if left is not None:
                (dropped if left else kept_whole).append(node)
                continue
        value = val(node)
        outputs.append(
            RegionOutput(node, index, shape, bool(value.requires_grad) and value.is_floating_point())
        )
    if outputs and all(o.shape.layout is Layout.ROWS for o in outputs):
        raise NoMatch("{} gives [tokens, V] rows that the graph returns whole, and nothing per token "
                      "reads them; tiling would save nothing", outputs[-1].node)  # fmt: skip
    if not outputs:
        return None
    for out in outputs:
        selection = matcher.values[out.node].selection
        out.flat_tokens = matcher.flat_tokens(out.shape.tokens, out.node, selection)
        out.subset = None if selection is None else matcher.selections[selection][0]
    return RegionOutputs(outputs, dropped, kept_whole)


def _rows_left(matcher: RegionMatcher, node: torch.fx.Node, users: list[torch.fx.Node]) -> bool | None:
    """For rows ``node`` that ``users`` read outside the region: True if the graph only returns
    them and they are not computed (``drop_logits=True``); False if it only returns them whole,
    computed before the token slice (the tiles run the sliced rows); None if the tiles write
    them. ``NoMatch`` if a reader needs them whole."""
    if matcher.values[node].selection is not None:
        _selection_read_whole(matcher, node, users)
    returned = all(u.op == "output" for u in users)
    if matcher.before_slice(node):  # before the token slice: returned whole, or dropped
        if returned:
            return bool(matcher.drop_rows) and len(matcher.slices) == 1
        first = next(n for n, r in matcher.values.items() if r.sliced)  # the first slice
        raise NoMatch("{} slices the logits' token rows while {} reads them whole, so they must "
                      "exist whole", first, users[0])  # fmt: skip
    if matcher.drop_rows and returned and not matcher.slices:
        return True
    user = next((u for u in users if u.op != "output" and u not in matcher.left_to_graph), None)
    if user is not None:  # it must exist whole for a reader that is not the output
        why = matcher.outside.get(user)
        detail = str(why).removeprefix(describe(user)).strip(" ,:") if why else "is not row-wise"
        raise NoMatch("the logits ({}) are also consumed by {}, which {}; so they must exist "
                      "whole", node, user, detail, node=user,
                      eager_raises=getattr(why, "eager_raises", False))  # fmt: skip
    return None


def _selection_read_whole(matcher: RegionMatcher, node: torch.fx.Node, users: list[torch.fx.Node]) -> None:
    """Raise why rows of a selection of the logits (``node``) that ``users`` read outside the
    region must exist whole: the reader's own reason if it has one (values of two selections
    combined), else that it reads them as rows."""
    user = next((u for u in users if u.op != "output"), users[0])
    why = matcher.outside.get(user)
    if why is not None:
        detail = str(why).removeprefix(describe(user)).strip(" ,:")
        raise NoMatch("{} (rows of a selection of the logits) is also consumed by {}, which {}; so "
                      "those rows must exist whole", node, user, detail, node=user)  # fmt: skip
    raise NoMatch("{} selects token rows that {} reads as [tokens, V] rows, so they must exist "
                  "whole", node, user, node=user)  # fmt: skip
