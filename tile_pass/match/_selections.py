"""Row selections and token slices of the logits: ``logits[:, :-1]`` moved onto the hidden states
(a token slice: the tiles run only those rows), and ``logits[:B]``, ``logits.chunk(2)``,
``logits.transpose(0, 1)`` read beside all rows (a row selection: the tiles run every row, and
what is computed from the selection is a value of its rows alone).

Selections nest as the user's code nests them (a slice of a slice, chunks of a token slice, chunks
of rows that were flattened or squeezed): each is composed with the selection it is taken of into
one :class:`~tile_pass.program._row_selection.RowSelection` of the hidden states' rows, an index
map the tiles' readers read their rows through. A selection that keeps every row in the tiles'
order (``flat[0:N]``, OpenRLHF's one chunk) is no selection at all.

A matching pass takes slices in one of three ways (:class:`~tile_pass.match._records.SliceMode`):
every slice moved onto the hidden states; only the first (the response's logits, then chunks of
them); or none (a slice read beside all rows)."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from tile_pass.match._fx import NoMatch, leading_index, permutation, same, same_shape, val
from tile_pass.match._matcher import RegionMatcher
from tile_pass.match._records import SliceMode
from tile_pass.match._rule_base import Shape
from tile_pass.program._op_facts import Selects, facts_for
from tile_pass.program._region import Layout, target_name
from tile_pass.program._row_selection import RowSelection, SelectionOp, row_map, same_rows

#: the ops that reorder a tensor's dims (a permutation of the token dims is a selection of every row)
_PERMUTES = ("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis")


def token_slice(matcher: RegionMatcher, node: torch.fx.Node) -> bool:
    """``logits[:, :-1, :]``, ``logits[..., -k:, :]``: a selection of token rows of the logits
    before any regrouping, moved onto the hidden states (the tiles then run only those rows,
    and every value before it is computed on them too, being row-wise). Values computed
    before the slice may then be read only on the way to it. A slice that keeps every row in
    order (``flat[0:N]``) is no slice: its value is its source's."""
    source = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
    shape = matcher.shape_of(source)
    if shape is None or shape.layout is not Layout.ROWS:
        return False
    matcher.saw_selection = True  # if it cannot move onto the hidden states, a selection (another pass)
    index = leading_index(node, len(shape.tokens) + 1)
    if index is not None and not matcher.before_slice(source) and _keeps_every_row(shape.tokens, index):
        tokens = tuple(val(node).shape[:-1])
        matcher.join(node, matcher.values[source].value, Shape(Layout.ROWS, tokens),
                     selection=matcher.values[source].selection)  # fmt: skip
        return True
    if matcher.slice_mode is SliceMode.SELECTED or matcher.selections:
        return False  # a selection of the rows (row_selection), or refused there
    if matcher.before_slice(source):
        raise NoMatch("{} slices the logits' token rows a second way", node)
    if index is None:
        raise NoMatch("{} indexes the logits by something other than token rows", node)
    if not same_shape(shape.tokens, matcher.hidden_tokens):
        raise NoMatch("{} slices token rows that were regrouped; slice before reshaping", node)
    if matcher.token_inputs:
        raise NoMatch("{} slices the token rows after a per-token value was combined with them; slice "
                      "the logits first", node)  # fmt: skip
    tokens = tuple(val(node).shape[:-1])
    matcher.slices.append(index)
    matcher.slice_steps.append(len(matcher.program))  # the first value after it (the report shows it there)
    matcher.hidden_tokens = tokens
    matcher.join(node, matcher.values[source].value, Shape(Layout.ROWS, tokens))
    return True


def _keeps_every_row(tokens: tuple, index: tuple) -> bool:
    """Whether ``x[index]`` is every row of ``x`` (token dims ``tokens``), in order (sizes known)."""
    bounds: list[torch.fx.Node] = []
    torch.fx.node.map_arg(index, bounds.append)
    if bounds or not all(type(t) is int for t in tokens):
        return False
    rows = torch.arange(math.prod(tokens)).view(tokens)
    return rows[index[:-1]].shape == rows.shape


def row_selection(matcher: RegionMatcher, node: torch.fx.Node) -> bool:
    """``logits[:B]``, ``logits[B:]``, ``logits[:, :-1]``, a piece of ``chunk``/``split``/
    ``narrow``, the token dims permuted, and any nesting of them, read beside all rows: the tiles
    compute every row, and what is computed from the selection is a value of its rows alone.
    Per-token operands of those rows are spread over all rows (:func:`~tile_pass.program.
    _token_layout.spread`), and outputs are selected back after the tiles (``select``), so a
    mean over the selection keeps eager's denominator."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    source, facts = node.args[0], facts_for(node.target)
    selects = None if facts is None else facts.selects
    shape = matcher.shape_of(source)
    rows = shape is not None and shape.layout is Layout.ROWS
    splits = rows and selects in (Selects.PIECES, Selects.ONE_PIECE)
    permutes = rows and target_name(node.target) in _PERMUTES
    if splits or permutes:
        matcher.saw_selection = True  # a pass that selects rows takes it
    if matcher.slice_mode is SliceMode.MOVED:
        return False
    split = matcher.values.get(source) if isinstance(source, torch.fx.Node) else None
    if selects is Selects.INDEX and split is not None and split.pieces and isinstance(node.args[1], int):
        index, source = split.pieces[node.args[1]], split.source
    elif splits:
        return _split(matcher, node, selects is Selects.ONE_PIECE, source, shape)
    elif permutes:
        order = permutation(node, len(shape.tokens) + 1)
        if order is None or order[-1] != len(order) - 1:
            raise NoMatch("{} moves the vocabulary dimension of the logits", node)
        return row_selection_of(matcher, node, source, SelectionOp.PERMUTE, tuple(order[:-1]))
    elif selects is Selects.INDEX and rows:
        if matcher.slice_mode is SliceMode.FIRST_MOVED and not matcher.slices and not matcher.selections:
            return False  # the first slice moves onto the hidden states (token_slice)
        index = leading_index(node, len(shape.tokens) + 1)
        if index is None:
            return False
    else:
        return False
    bounds: list[torch.fx.Node] = []
    torch.fx.node.map_arg(index, bounds.append)
    if bounds:
        raise NoMatch("{} selects token rows with a symbolic bound", node)
    return row_selection_of(matcher, node, source, SelectionOp.INDEX, index[:-1])


def _split(
    matcher: RegionMatcher, node: torch.fx.Node, one_piece: bool, source: torch.fx.Node, shape: Shape
) -> bool:
    """``logits.chunk(2)``, ``logits.split(B)``, ``logits.narrow(0, 0, B)`` over a token
    dimension: each piece is a selection of the rows (a ``narrow`` one piece)."""
    ndim = len(shape.tokens) + 1
    default = node.args[1] if one_piece else node.args[2] if len(node.args) > 2 else 0
    dim = node.kwargs.get("dim", default)
    if not isinstance(dim, int) or not 0 <= dim % ndim < ndim - 1:
        raise NoMatch("{} splits the logits along the vocabulary, not the token rows", node)
    dim %= ndim

    def index(start, stop):
        return (*(slice(None),) * dim, slice(start, stop), *(slice(None),) * (ndim - dim - 1))

    if one_piece:  # narrow(dim, start, length)
        start, length = node.args[2:4] if len(node.args) >= 4 else (None, None)
        if not isinstance(start, int) or not isinstance(length, int):
            raise NoMatch("{} selects token rows with a symbolic bound", node)
        return row_selection_of(matcher, node, source, SelectionOp.INDEX, index(start, start + length)[:-1])
    pieces = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(pieces, (list, tuple)) or any(not isinstance(p.shape[dim], int) for p in pieces):
        raise NoMatch("{} splits the token rows into pieces of symbolic sizes", node)
    starts = [sum(p.shape[dim] for p in pieces[:k]) for k in range(len(pieces) + 1)]
    pieces = tuple(index(a, b) for a, b in zip(starts, starts[1:], strict=False))
    tuple_shape = Shape(Layout.TUPLE, shape.tokens, Layout.ROWS)
    matcher.join(node, matcher.values[source].value, tuple_shape, pieces=pieces, source=source)
    return True


def row_selection_of(
    matcher: RegionMatcher, node: torch.fx.Node, source: torch.fx.Node, op: str, argument
) -> bool:
    """``node`` is ``op`` (an index, a permutation) of the rows of the region value ``source``,
    itself all rows or a selection of them, flat or not: the two compose into one selection."""
    if matcher.before_slice(source):  # its grid is not the tiles' rows (a pass that moves no slice takes it)
        raise NoMatch("{} selects token rows of {}, computed before the logits' token slice", node, source)
    parent = matcher.values[source].selection
    grid = matcher.hidden_tokens if parent is None else matcher.selections[parent][1]
    selection = RowSelection() if parent is None else matcher.selections[parent][0]
    tokens = matcher.shape_of(source).tokens
    if not same_shape(tokens, grid):
        if not (len(tokens) == 1 and same(tokens[0], math.prod(grid))):
            raise NoMatch("{} selects token rows that were regrouped into {}", node, tuple(tokens))
        selection = selection.then(SelectionOp.FLATTEN)
    selection = selection.then(op, argument)
    tokens = tuple(val(node).shape[:-1])
    known = next(
        (k for k, (s, _) in enumerate(matcher.selections) if same_rows(s, selection, matcher.hidden_tokens)),
        None,
    )
    if known is None and not _every_row(matcher, selection, tokens):
        matcher.selections.append((selection, tokens))
        known = len(matcher.selections) - 1
    matcher.join(node, matcher.values[source].value, Shape(Layout.ROWS, tokens), selection=known)
    return True


def _every_row(matcher: RegionMatcher, selection: RowSelection, tokens: tuple) -> bool:
    """Whether a selection is the tiles' rows themselves, in their order, flat or as the hidden
    states' token dims (then it is no selection: its values are all rows' values)."""
    grid = matcher.hidden_tokens
    if not all(type(t) is int for t in grid):
        return False
    if not (same_shape(tokens, grid) or tuple(tokens) == (math.prod(grid),)):
        return False
    rows = row_map(torch.empty(*grid, 0), selection).reshape(-1)
    return rows.numel() == math.prod(grid) and bool(torch.equal(rows, torch.arange(rows.numel())))


def leave_returned_selections(matcher: RegionMatcher) -> None:
    """A view selecting rows that only the graph's output reads (``logits[:, 0]``, ProphetNet's
    main stream, returned beside the rows it selects from) is left to the graph: the region
    returns the rows it is a view of (the tiles write them whole, as the graph gives them), and
    the graph takes its view of them as eager does (the splice moves it after the op)."""
    left = True
    while left:
        left = False
        for node, record in list(matcher.values.items()):
            if record.shape.layout is not Layout.ROWS or record.selection is None or not node.users:
                continue
            if any(
                u in matcher.values or (u.op != "output" and u not in matcher.left_to_graph)
                for u in node.users
            ):
                continue
            if not any(
                matcher.values[a].value is record.value for a in node.all_input_nodes if a in matcher.values
            ):
                continue  # a value of its own (computed from the selection): the tiles give it
            del matcher.values[node]
            matcher.left_to_graph.add(node)
            left = True
