"""Row selections and token slices of the logits: ``logits[:, :-1]`` moved onto the hidden states
(a token slice: the tiles run only those rows), and ``logits[:B]``, ``logits.chunk(2)`` read
beside all rows (a row selection: the tiles run every row, and what is computed from the
selection is a value of its rows alone)."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from tile_pass.match._fx import NoMatch, leading_index, same_shape, val
from tile_pass.match._matcher import RegionMatcher
from tile_pass.match._op_facts import Selects, facts_for
from tile_pass.match._rules import Shape
from tile_pass.program._region import Layout


def index_text(index: tuple) -> str:
    """``[:4]``, ``[:, :-1]``: a row selection as the user wrote it."""

    def one(i):
        if not isinstance(i, slice):
            return repr(i)
        text = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
        return text + (f":{i.step}" if i.step is not None else "")

    explicit = list(index[:-1])
    while explicit and explicit[-1] == slice(None):
        explicit.pop()
    return "[" + ", ".join(one(i) for i in explicit) + "]"


def token_slice(matcher: RegionMatcher, node: torch.fx.Node) -> bool:
    """``logits[:, :-1, :]``, ``logits[..., -k:, :]``: a selection of token rows of the logits
    before any regrouping, moved onto the hidden states (the tiles then run only those rows,
    and every value before it is computed on them too, being row-wise). Values computed
    before the slice may then be read only on the way to it."""
    source = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
    shape = matcher.shape_of(source)
    if shape is None or shape.layout is not Layout.ROWS:
        return False
    matcher.saw_selection = True  # if it cannot move onto the hidden states, a selection (second pass)
    if matcher.before_slice(source):
        raise NoMatch("{} slices the logits' token rows a second way", node)
    index = leading_index(node, len(shape.tokens) + 1)
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
    matcher.hidden_tokens, matcher.num_tokens = tokens, math.prod(tokens)
    matcher.join(node, matcher.values[source].value, Shape(Layout.ROWS, tokens))
    return True


def row_selection(matcher: RegionMatcher, node: torch.fx.Node) -> bool:
    """``logits[:B]``, ``logits[B:]``, ``logits[:, :-1]`` read beside all rows (the second
    matching pass): the tiles compute every row, and what is computed from the selection is
    a value of its rows alone. Per-token operands of those rows are spread over all rows
    (:func:`_spread`), and outputs are selected back after the tiles (:func:`_select`), so
    a mean over the selection keeps eager's denominator."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    source, facts = node.args[0], facts_for(node.target)
    selects = None if facts is None else facts.selects
    shape = matcher.shape_of(source)
    splits = selects in (Selects.PIECES, Selects.ONE_PIECE)
    if splits and shape is not None and shape.layout is Layout.ROWS:
        matcher.saw_selection = True  # the second pass takes it
    if not matcher.select_rows:
        return False
    split = matcher.values.get(source) if isinstance(source, torch.fx.Node) else None
    if selects is Selects.INDEX and split is not None and split.pieces and isinstance(node.args[1], int):
        index, source = split.pieces[node.args[1]], split.source
        shape = matcher.shape_of(source)
    elif splits and shape is not None and shape.layout is Layout.ROWS:
        return _split(matcher, node, selects is Selects.ONE_PIECE, source, shape)
    elif selects is Selects.INDEX and shape is not None and shape.layout is Layout.ROWS:
        index = leading_index(node, len(shape.tokens) + 1)
        if index is None:
            return False
    else:
        return False
    if matcher.values[source].selection is not None or not same_shape(shape.tokens, matcher.hidden_tokens):
        raise NoMatch("{} selects token rows of rows already selected or regrouped", node)
    bounds: list[torch.fx.Node] = []
    torch.fx.node.map_arg(index, bounds.append)
    if bounds:
        raise NoMatch("{} selects token rows with a symbolic bound", node)
    return row_selection_of(matcher, node, source, index)


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
    if matcher.values[source].selection is not None or not same_shape(shape.tokens, matcher.hidden_tokens):
        raise NoMatch("{} selects token rows of rows already selected or regrouped", node)

    def index(start, stop):
        return (*(slice(None),) * dim, slice(start, stop), *(slice(None),) * (ndim - dim - 1))

    if one_piece:  # narrow(dim, start, length)
        start, length = node.args[2:4] if len(node.args) >= 4 else (None, None)
        if not isinstance(start, int) or not isinstance(length, int):
            raise NoMatch("{} selects token rows with a symbolic bound", node)
        return row_selection_of(matcher, node, source, index(start, start + length))
    pieces = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(pieces, (list, tuple)) or any(not isinstance(p.shape[dim], int) for p in pieces):
        raise NoMatch("{} splits the token rows into pieces of symbolic sizes", node)
    starts = [sum(p.shape[dim] for p in pieces[:k]) for k in range(len(pieces) + 1)]
    pieces = tuple(index(a, b) for a, b in zip(starts, starts[1:], strict=False))
    tuple_shape = Shape(Layout.TUPLE, shape.tokens, Layout.ROWS)
    matcher.join(node, matcher.values[source].value, tuple_shape, pieces=pieces, source=source)
    return True


def row_selection_of(
    matcher: RegionMatcher, node: torch.fx.Node, source: torch.fx.Node, index: tuple
) -> bool:
    """``node`` is the rows ``index`` of the region value ``source`` (all rows)."""
    tokens = tuple(val(node).shape[:-1])
    known = next((k for k, (i, _) in enumerate(matcher.selections) if repr(i) == repr(index)), None)
    if known is None:
        matcher.selections.append((index, tokens))
        known = len(matcher.selections) - 1
    matcher.join(node, matcher.values[source].value, Shape(Layout.ROWS, tokens), selection=known)
    return True


def selection_read(matcher: RegionMatcher, node: torch.fx.Node) -> int | None:
    """The row selection the region values ``node`` reads were computed on (``None``: all rows)."""
    found = {matcher.values[a].selection for a in node.all_input_nodes if a in matcher.values}
    if len(found) > 1:
        raise NoMatch("{} combines values of different selections of the token rows", node)
    return found.pop() if found else None
