"""What a row-wise rule takes and gives: the shape the matcher tracks a value by, the steps a rule
classifies a node into (:class:`Classified`), and the argument binding the rules share."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass.match._fx import NoMatch
from tile_pass.program._op_facts import RuleKind
from tile_pass.program._region import Layout, Ref, RefKind, Step
from tile_pass.program._token_layout import TokenReduction


@dataclass(frozen=True)
class Shape:
    """A value of the region as the matcher tracks it: its layout in a tile, and the token
    dimensions it has in the user's graph; ``max(dim)``'s pair has its items' layout too."""

    layout: Layout
    tokens: tuple
    item: Layout | None = None

    def __post_init__(self):
        if (self.layout is Layout.TUPLE) != (self.item is not None):
            raise ValueError(f"{self}: only a tuple has an item layout, and it must")


@dataclass(frozen=True)
class AfterTiles:
    """What the tiles leave to do for an op that also reduces over the tokens, and what that
    takes after the per-token values: the vocabulary size (``DIV_ELEMENTS``); the labels, the
    class weights and ``ignore_index`` (``MEAN_VALID``)."""

    how: TokenReduction
    operands: tuple = ()

    def __post_init__(self):
        wanted = {TokenReduction.DIV_ELEMENTS: 1, TokenReduction.MEAN_VALID: 3}.get(self.how, 0)
        if len(self.operands) != wanted:
            raise ValueError(f"{self.how} takes {wanted} operands, not {self.operands}")


class IndexCheck(NamedTuple):
    """A per-token index the tiles check as eager does: the token input holding it, eager's
    message (``{}``: the bad index), and the index eager ignores (``None``: none)."""

    token_input: int
    message: str
    ignore_index: int | None


@dataclass(frozen=True)
class Classified:
    """What a rule made of a node: the step to replay, the value's shape, for a reduction
    that also sums over tokens what the tiles leave to do after them, and the index the step
    reads that the tiles must check as eager does."""

    step: Step
    shape: Shape
    after_tiles: AfterTiles | None = None
    index_check: IndexCheck | None = None


#: an operand of a rule's second step: the value of its first (the walk numbers it)
PREVIOUS_STEP = Ref(RefKind.VALUE, -1)

#: a rule: (the ``_matcher.RegionMatcher``, the node) -> its steps, or ``NoMatch``
ClassifyFn = Callable[[Any, torch.fx.Node], list[Classified]]


@dataclass(frozen=True)
class Rule:
    kind: RuleKind
    classify: ClassifyFn


LOSS_SIGNATURES = {target: inspect.signature(target) for target in (F.cross_entropy, F.nll_loss, F.kl_div)}


def bind(signature: inspect.Signature, node: torch.fx.Node) -> dict:
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError as err:
        raise NoMatch("{} was called with arguments its signature rejects ({})", node, err) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def is_vocab_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim % ndim == ndim - 1


def loss_options(node: torch.fx.Node) -> dict:
    options = bind(LOSS_SIGNATURES[node.target], node)
    if options.get("size_average") is not None or options.get("reduce") is not None:
        raise NoMatch("{} uses the deprecated size_average/reduce arguments; pass reduction=", node)
    return options


def rows_operand(matcher, node: torch.fx.Node, source=None) -> tuple[Ref, Shape]:
    """The region value an op over rows takes first (``source``, if bound already), and its shape."""
    source = source if source is not None else node.args[0] if node.args else None
    shape = matcher.shape_of(source)
    if shape is None or shape.layout in (Layout.REDUCED, Layout.TUPLE):
        raise NoMatch("{} does not take the logits as its first operand", node)
    return matcher.value_ref(source), shape
