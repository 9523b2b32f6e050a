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

How the tiles take a group is declared once, in :data:`GROUPS` (a :class:`GroupKind`): the
tile loop, the traced tile function, the results and the splice treat every group of a kind
alike (:meth:`RegionOperands.of_kind`, :meth:`RegionOperands.with_kind`), so a new group of an
existing kind is a field here, its :class:`~tile_pass.program._region.RefKind`, and the matcher
that produces it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class GroupKind(enum.Enum):
    """How the tiles take a group: one row per token (sliced per tile as the hidden states
    are; its gradient per token), whole (every tile the same; its gradient summed across the
    tiles), or not at all (read only by the scalar loss, after the tiles)."""

    PER_TOKEN = "per token"
    WHOLE = "whole"
    LOSS = "loss"


#: the groups after the head, in the record's order, and how the tiles take each: the only
#: table code outside this module consults (through the methods below) to treat a group
GROUPS: dict[str, GroupKind] = {
    "tokens": GroupKind.PER_TOKEN,
    "shared": GroupKind.WHOLE,
    "reduce": GroupKind.LOSS,
}


class OperandCounts(NamedTuple):
    """How many tensors each group holds: what a program records to read its flat operands."""

    tokens: int = 0
    shared: int = 0
    reduce: int = 0

    def in_tiles(self) -> OperandCounts:
        """The counts of what a tile takes: the scalar loss's own groups empty."""
        return self._replace(**{group: 0 for group, kind in GROUPS.items() if kind is GroupKind.LOSS})


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
        return OperandCounts(*(len(getattr(self, group)) for group in GROUPS))

    def flat(self) -> list[T | None]:
        """The head, then every group in :data:`GROUPS` order."""
        return [self.hidden, self.weight, self.bias, *itertools.chain(*(getattr(self, g) for g in GROUPS))]

    @classmethod
    def unflatten(cls, flat: Sequence, counts: OperandCounts) -> RegionOperands:
        """The record :meth:`flat` laid out, for groups of ``counts`` tensors."""
        if len(flat) != 3 + sum(counts):
            raise ValueError(f"{len(flat)} operands for a region of 3 + {tuple(counts)}")
        groups, first = {}, 3
        for group, count in zip(GROUPS, counts, strict=True):
            groups[group], first = tuple(flat[first : first + count]), first + count
        return cls(flat[0], flat[1], flat[2], **groups)

    def map(self, fn: Callable[[T], U]) -> RegionOperands[U]:
        """``fn`` of every operand, ``None`` kept (a missing bias stays missing)."""
        return RegionOperands.unflatten([None if x is None else fn(x) for x in self.flat()], self.counts)

    def of_kind(self, kind: GroupKind) -> list[T]:
        """The operands of every group the tiles take as ``kind``, flat, in group order."""
        return [x for group, k in GROUPS.items() if k is kind for x in getattr(self, group)]

    def with_kind(self, kind: GroupKind, fn: Callable[[T], U]) -> RegionOperands:
        """``fn`` of each operand of every group of ``kind`` (the head and others unchanged)."""
        return self._replace(
            **{group: tuple(fn(x) for x in getattr(self, group)) for group, k in GROUPS.items() if k is kind}
        )

    def in_tiles(self) -> RegionOperands:
        """The operands a tile takes: the scalar loss's own groups left out."""
        return self._replace(**{group: () for group, k in GROUPS.items() if k is GroupKind.LOSS})

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


def filled(operands: RegionOperands, kind: GroupKind, values: Iterable) -> RegionOperands:
    """``operands`` with the groups of ``kind`` taking ``values`` in order (one per operand)."""
    given = iter(values)
    return operands.with_kind(kind, lambda _: next(given))


def no_gradient(counts: OperandCounts) -> RegionOperands[bool]:
    """Need flags of a loop that differentiates nothing."""
    return RegionOperands.unflatten([False] * (3 + sum(counts)), counts)
