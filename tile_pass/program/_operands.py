"""A region's operands, in one record and one order, across every boundary they cross.

A region takes the head (``hidden``, ``weight``, ``bias``) and three groups of tensors from
outside it: ``tokens`` (one value or row per token, sliced per tile: labels, masks, a teacher's
logits, a partner head's hidden states), ``shared`` (the same for every row: a ``[V]`` offset, a
0-d scale, class weights, a partner head's weight) and ``reduce`` (read only by the scalar loss
after the tiles: advantages, a ``num_items_in_batch``). The matcher fills the record with graph
nodes, the rewritten graph with tensors, the tile tracer with shapes, the ops' ``need`` with
booleans and their results with gradients: the same :class:`RegionOperands` each time, so code
reads a group by its name and never by a position it worked out.

A custom op takes tensors in a flat list: :meth:`RegionOperands.flat` lays a record out and
:meth:`RegionOperands.unflatten` reads it back with the group sizes the program recorded
(:class:`OperandCounts`). Those two are the only places that know the order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")
U = TypeVar("U")

#: the groups after the head, in the record's order
GROUPS = ("tokens", "shared", "reduce")
#: the groups a tile reads: per token (sliced per tile, as the hidden states are), or whole
TILE_GROUPS = ("tokens", "shared")


class OperandCounts(NamedTuple):
    """How many tensors each group holds: what a program records to read its flat operands."""

    tokens: int = 0
    shared: int = 0
    reduce: int = 0


class RegionOperands(NamedTuple, Generic[T]):
    """The region's operands by group (nodes, tensors, specs, need flags or gradients).

    ``bias`` is ``None`` where the head has none (``False`` in a record of need flags).
    A ``NamedTuple``: a pytree (a tile tracer's input), hashable (a kernel key's part) and
    cheap to build once per tile."""

    hidden: T
    weight: T
    bias: T | None
    tokens: tuple[T, ...] = ()
    shared: tuple[T, ...] = ()
    reduce: tuple[T, ...] = ()

    @property
    def counts(self) -> OperandCounts:
        return OperandCounts(len(self.tokens), len(self.shared), len(self.reduce))

    def flat(self) -> list[T | None]:
        """The head, then every group in :data:`GROUPS` order."""
        return [self.hidden, self.weight, self.bias, *self.tokens, *self.shared, *self.reduce]

    @classmethod
    def unflatten(cls, flat: Sequence, counts: OperandCounts) -> RegionOperands:
        """The record :meth:`flat` laid out, for groups of ``counts`` tensors."""
        tokens, shared, reduce = counts
        if len(flat) != 3 + tokens + shared + reduce:
            raise ValueError(f"{len(flat)} operands for a region of 3 + {tuple(counts)}")
        first_shared, first_reduce = 3 + tokens, 3 + tokens + shared
        return cls(
            flat[0], flat[1], flat[2],
            tuple(flat[3:first_shared]), tuple(flat[first_shared:first_reduce]), tuple(flat[first_reduce:]),
        )  # fmt: skip

    def map(self, fn: Callable[[T], U]) -> RegionOperands[U]:
        """``fn`` of every operand, ``None`` kept (a missing bias stays missing)."""
        return RegionOperands.unflatten([None if x is None else fn(x) for x in self.flat()], self.counts)

    def any(self) -> bool:
        """For need flags: whether anything is differentiated."""
        return any(self.flat())

    def picked(self, values: Iterable) -> RegionOperands:
        """For need flags: ``values`` (one per set flag, in :meth:`flat` order) at the set flags'
        places, ``None`` elsewhere: what an op returns as its needed gradients, read back."""
        given = iter(values)
        placed = RegionOperands.unflatten([next(given) if n else None for n in self.flat()], self.counts)
        if next(given, None) is not None:
            raise ValueError("more values than set flags")
        return placed


def no_gradient(counts: OperandCounts) -> RegionOperands[bool]:
    """Need flags of a loop that differentiates nothing."""
    return RegionOperands.unflatten([False] * (3 + sum(counts)), counts)
