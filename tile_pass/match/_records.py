"""The matcher's records: what it proved about each node, the region's operands and outputs, and
the matched region the splice reads (named fields, no positions)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.fx

from tile_pass.match._rule_base import AfterTiles, Shape
from tile_pass.program import _region
from tile_pass.program._op_facts import RuleKind
from tile_pass.program._region import Layout, RowProgram, Step
from tile_pass.program._row_selection import RowSelection


class SliceMode(enum.Enum):
    """How a matching pass takes the slices of the logits' token rows."""

    MOVED = "every token slice moves onto the hidden states (the tiles run only its rows)"
    FIRST_MOVED = "the first token slice moves onto the hidden states, later ones select its rows"
    SELECTED = "every slice is a selection of the tiles' rows (the tiles run every row)"


@dataclass(frozen=True)
class ProgramValue:
    """Value ``index`` of the program (``Ref(VALUE, index)``): the step that computes it (none for
    the logits, value 0), its shape in a tile, the kind of rule that made the step (the sharded
    form reads it), and where it is zero whatever the logits
    (:func:`~tile_pass.program._region.zero_where`)."""

    index: int
    step: Step | None
    shape: Shape
    kind: RuleKind | None = None
    zeros: _region.Zeros | None = None

    def __post_init__(self):
        if not (self.index == 0) == (self.step is None) == (self.kind is None):
            raise ValueError(f"{self}: the logits (value 0), and only they, have no step and no kind")
        if self.shape.layout is Layout.REDUCED:
            raise ValueError(f"{self}: a tile holds no value reduced over the tokens")


@dataclass(frozen=True)
class RegionValue:
    """Every fact the matcher proved about one node of the region, in one record: the program
    value it reads as (a view or a row selection shares its source's), its shape as its readers
    see it, and how it stands to the row selections, the token slices and the tiles."""

    value: ProgramValue
    shape: Shape  # REDUCED when a token reduction is left to after the tiles (the value is per token)
    selection: int | None = None  # the row selection (``RegionMatcher.selections``) it is computed on
    after_tiles: AfterTiles | None = None  # that token reduction
    pieces: tuple[tuple, ...] = ()  # a chunk/split of ``source``'s rows: each piece's index into them
    source: torch.fx.Node | None = None
    sliced: int = 0  # the logits' token slices before it (fewer than the region's: read only up to them)

    def __post_init__(self):
        if (self.after_tiles is None) == (self.shape.layout is Layout.REDUCED):
            raise ValueError(f"{self}: reduced over the tokens if and only if a token reduction is left")
        if bool(self.pieces) != (self.source is not None) or (self.pieces and self.shape.item is None):
            raise ValueError(f"{self}: only a split of the rows, a tuple, has pieces and a source")


@dataclass
class TokenInput:
    """A tensor from outside the region with one value (or row) per token, sliced per tile."""

    node: torch.fx.Node
    part: tuple  # its shape after the token dims: (), (1,) or (V,)
    flat_tokens: bool  # its site's token dims are the flattened [N] (else the hidden states')
    #: read with a selection of the token rows (``logits[:B]``): the input covers those rows only
    #: and is spread over all of them
    subset: RowSelection | None = None
    #: the region differentiates it (it requires grad where a node that needs a gradient reads it)
    differentiable: bool = False


@dataclass
class RowInput:
    """A tensor from outside the region that every row shares (0-d, ``[V]``, ``[1]``), or
    the weight (and bias) of another projection of the same rows, taken ``whole``."""

    node: torch.fx.Node
    zero_dim: bool
    whole: bool = False
    differentiable: bool = False  # as TokenInput's


@dataclass
class RegionOutput:
    node: torch.fx.Node  # the FX node whose value leaves the region
    value: int  # the program value
    shape: Shape
    differentiable: bool
    after_tiles: AfterTiles | None = None  # the token reduction left to do
    flat_tokens: bool = False  # its token dims are the flattened [N] (else the hidden states')
    subset: RowSelection | None = None  # computed on a selection of the token rows


@dataclass(frozen=True)
class RegionOutputs:
    """The region values read outside it, and the rows the graph returns that the tiles do not
    write: ``dropped`` (not computed, ``drop_logits=True``), ``kept_whole`` (computed before a
    token slice: the graph keeps computing them)."""

    outputs: list[RegionOutput]
    dropped: list[torch.fx.Node]
    kept_whole: list[torch.fx.Node]


@dataclass
class RowRegion:
    """One matched region: the record the rewrite reads (named fields, no positions)."""

    projection: torch.fx.Node
    hidden: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    autocast_dtype: torch.dtype | None
    nodes: list[torch.fx.Node]
    token_inputs: list[TokenInput]
    row_inputs: list[RowInput]
    outputs: list[RegionOutput]
    program: RowProgram
    reduction_nodes: list[torch.fx.Node] = field(default_factory=list)  # joined the op (the scalar loss)
    sink: torch.fx.Node | None = None  # the scalar loss they end in
    reduce_inputs: list[torch.fx.Node] = field(default_factory=list)
    steps_text: list[str] = field(default_factory=list)
    dropped: list[torch.fx.Node] = field(default_factory=list)  # returned rows replaced by a placeholder
    kept_whole: list[torch.fx.Node] = field(default_factory=list)  # returned rows before a token slice
    #: the graph's views of returned rows that only the graph's output reads (``logits[:, 0]``)
    left_to_graph: list[torch.fx.Node] = field(default_factory=list)
    slices: list[tuple] = field(default_factory=list)  # token selections applied to the hidden states
    num_tokens: object = 0  # the tokens the tiles run (after the slices)


def describe_output(output: RegionOutput) -> str:
    """``lse [tokens]`` and the like, for reports."""
    what = "rows" if output.shape.layout is Layout.ROWS else "per token"
    if output.after_tiles is not None:
        what = f"token {output.after_tiles.how.value}"
    return f"{output.node.name} ({what}{', differentiable' if output.differentiable else ''})"
