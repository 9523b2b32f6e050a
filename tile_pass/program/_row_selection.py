"""A selection of the hidden states' token rows, however the user's code nested it, as one map.

The tiles compute every row of the hidden states once, flat and in their order. A reader of a
selection of the logits' rows (``logits[:B]``; a slice of a slice, ``logits[:, 2:-1][i:i + 1]``;
chunks of rows that were flattened or squeezed, ``logits.reshape(-1, V)[k:k + 8]``; the token
dimensions permuted, ``logits.transpose(0, 1)``) reads the tiles' values at the rows it selects.
Each such chain of index ops is recorded as a :class:`RowSelection` and replayed on the grid of
row numbers (:func:`row_map`): the result is the selection's rows as positions among the tiles'
flat rows, in the selection's own token shape. Every op admitted here picks each row at most once,
so writing a selection's per-token operand into the tiles' rows (:func:`spread`) never collides.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class SelectionOp:
    """The ops of a selection, applied to the grid of row numbers (plain strings: a selection is
    an argument of the rewritten graph, which prints it as Python)."""

    FLATTEN = "flatten"  # the token dims flattened into one (``logits.reshape(-1, V)``)
    INDEX = "index"  # ``rows[index]``: ints and slices over the token dims
    PERMUTE = "permute"  # the token dims reordered (``logits.transpose(0, 1)``)


class RowSelection(NamedTuple):
    """The chain of ops that selects rows from the hidden states' token grid, outermost last;
    each op is ``(SelectionOp, argument)`` (the index's token part, the permutation, or None).
    A named tuple of plain values: the rewritten graph's code spells it out."""

    ops: tuple = ()

    def then(self, op: str, argument: object = None) -> RowSelection:
        """This selection followed by ``op`` (a selection of its rows)."""
        return RowSelection((*self.ops, (op, argument)))

    def describe(self) -> str:
        """``[:, 2:-1][0:1]``, ``.flatten()[8:16]``, ``.permute(1, 0, 2)``: as the user's code reads."""
        parts = []
        for op, argument in self.ops:
            if op == SelectionOp.FLATTEN:
                parts.append(".flatten()")
            elif op == SelectionOp.PERMUTE:
                parts.append(f".permute({', '.join(map(str, argument))})")
            else:
                parts.append(_index_text(argument))
        return "".join(parts) or "[:]"


def _index_text(index: tuple) -> str:
    def one(i):
        if not isinstance(i, slice):
            return repr(i)
        text = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
        return text + (f":{i.step}" if i.step is not None else "")

    explicit = list(index)
    while len(explicit) > 1 and explicit[-1] == slice(None):
        explicit.pop()
    return "[" + ", ".join(one(i) for i in explicit) + "]"


def row_map(hidden: torch.Tensor, selection: RowSelection) -> torch.Tensor:
    """The selected rows' positions among the tiles' flat rows (``[N]``, the hidden states' token
    dims flattened), shaped as the selection's token dims."""
    tokens = tuple(hidden.shape[:-1])
    rows = torch.arange(math.prod(tokens), device=hidden.device).view(tokens)
    for op, argument in selection.ops:
        if op == SelectionOp.FLATTEN:
            rows = rows.reshape(-1)
        elif op == SelectionOp.PERMUTE:
            rows = rows.permute(*argument)
        else:
            rows = rows[argument]
    return rows


def selected_tokens(hidden: torch.Tensor, selection: RowSelection) -> torch.Tensor:
    """A stand-in for the selected rows' hidden states where only their token shape is read
    (``restore``, ``after_tiles``): ``[*selected tokens, 1]``."""
    return row_map(hidden, selection).unsqueeze(-1)


def same_rows(a: RowSelection, b: RowSelection, tokens: tuple) -> bool:
    """Whether two selections pick the same rows in the same order from a token grid of
    ``tokens``: the same ops, or, where the grid's sizes are known, the same row map."""
    if a == b:
        return True
    if not all(type(t) is int for t in tokens):
        return False
    grid = torch.empty(*tokens, 0, device="cpu")
    first, second = row_map(grid, a), row_map(grid, b)
    return first.shape == second.shape and bool(torch.equal(first, second))
