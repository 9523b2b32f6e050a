"""The elementwise rules (unary and binary maths, comparisons, ``where``, dtype casts), the views
that only regroup the token dimensions, and the facts of the views other passes see through."""

from __future__ import annotations

import math

import torch
import torch.fx

from tile_pass.match._functionalize import KEPT_IN_PLACE
from tile_pass.match._fx import NoMatch, same, same_shape, val
from tile_pass.match._rule_base import Classified, Rule, Shape, rows_operand
from tile_pass.match._zero_rules import (
    divide,
    first_factor,
    keeps_zeros,
    masked_fill,
    power,
    product,
    sum_of,
    where,
)
from tile_pass.program._op_facts import (
    AS_KEY,
    FACTS,
    Fold,
    Linear,
    RuleKind,
    Selects,
    declare_ops,
    register_ops,
    spelling,
)
from tile_pass.program._region import Layout, row_part


def _elementwise(matcher, node: torch.fx.Node, target=None) -> list[Classified]:
    out = val(node)
    if not isinstance(out, torch.Tensor):
        raise NoMatch("{} does not give a tensor", node)
    inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    shapes = [matcher.shape_of(a) for a in inputs if matcher.shape_of(a) is not None]
    layouts = {shape.layout for shape in shapes}
    if Layout.REDUCED in layouts or Layout.TUPLE in layouts or not shapes:
        raise NoMatch("{} reads a value reduced over the tokens", node)
    if len(layouts) > 1 and layouts != {Layout.ROWS, Layout.TOKENS1}:
        raise NoMatch("{} combines per-token values of different layouts", node)
    layout = Layout.ROWS if Layout.ROWS in layouts else layouts.pop()
    tokens = shapes[0].tokens
    if any(not same_shape(shape.tokens, tokens) for shape in shapes):
        raise NoMatch("{} combines values with different token dimensions", node)
    shape = Shape(layout, tokens)
    if not same_shape(tuple(out.shape), (*tokens, *row_part(layout, matcher.vocab))):
        raise NoMatch("{} changes the shape of the logits' rows", node)
    if out.device.type != matcher.device_type:
        raise NoMatch("{} moves the logits to another device", node)
    if FACTS[spelling(node.target).key].dtype_cast and any(
        isinstance(a, (torch.fx.Node, torch.device, str)) for a in node.args[1:]
    ):
        raise NoMatch("{} casts with a device or a tensor; only a dtype cast is replayed", node)
    args = [matcher.operand(a, shape, node) for a in node.args]
    kwargs = [(k, matcher.operand(v, shape, node)) for k, v in node.kwargs.items()]
    return [Classified(matcher.step(node, target or node.target, args, kwargs, node.op), shape)]


def _elementwise_ops(
    *keys: str,
    zeros,
    linear: Linear,
    inplace: bool,
    aliases: bool = False,
    dtype_cast: bool = False,
    bias_add: bool = False,
) -> None:
    """Register the elementwise ops ``keys`` by the facts that vary between them (``inplace``: its
    in-place spelling is replayed out of place; ``aliases``: it may return its input; a
    ``dtype_cast``; a ``bias_add``); the facts every elementwise op shares are stated here once:
    no sharded form (it needs none), it signs no head and selects no rows, a per-row loop of it
    folds, the report shows it and its numbers."""
    register_ops(
        *keys, kind=RuleKind.ELEMENTWISE, zeros=zeros, linear=linear, inplace=inplace, aliases=aliases,
        dtype_cast=dtype_cast, bias_add=bias_add, sharded=None, head_sign=False, selects=None,
        folds=Fold.ALWAYS, shown=AS_KEY, shows_numbers=True, signature=None,
    )(_elementwise)  # fmt: skip


_elementwise_ops(
    "log", "sigmoid", "rsqrt", "log1p", "expm1", "clamp_min", "clamp_max", "exp2", "nan_to_num",
    "logical_not", "isnan", "isfinite", "isinf", "reciprocal", "softplus", "logsigmoid", "eq", "ne", "lt",
    "le", "gt", "ge", "maximum", "minimum", "logical_and", "logical_or", "logical_xor", "invert",
    "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "xlogy", "lerp", "rdiv", "and_", "or_", "xor",
    zeros=None, linear=Linear.NONE, inplace=False,
)  # fmt: skip
_elementwise_ops("exp", "clamp", "clip", zeros=None, linear=Linear.NONE, inplace=True)
_elementwise_ops(
    "abs", "sqrt", "square", "relu", "sign", zeros=keeps_zeros, linear=Linear.NONE, inplace=False
)
_elementwise_ops("tanh", zeros=keeps_zeros, linear=Linear.NONE, inplace=True)
_elementwise_ops("neg", zeros=keeps_zeros, linear=Linear.FIRST, inplace=True)
_elementwise_ops(
    "detach", "half", "bfloat16", zeros=keeps_zeros, linear=Linear.NONE, inplace=False, aliases=True
)
_elementwise_ops("float", "double", zeros=keeps_zeros, linear=Linear.FIRST, inplace=False, aliases=True)
_elementwise_ops(
    "to", "type", zeros=keeps_zeros, linear=Linear.CAST, inplace=False, aliases=True, dtype_cast=True
)  # fmt: skip
_elementwise_ops("add", zeros=sum_of, linear=Linear.TERMS, inplace=True, bias_add=True)
_elementwise_ops("sub", zeros=sum_of, linear=Linear.TERMS, inplace=True)
_elementwise_ops("rsub", zeros=sum_of, linear=Linear.TERMS, inplace=False)
_elementwise_ops("mul", zeros=product, linear=Linear.FACTOR, inplace=True)
_elementwise_ops("div", zeros=divide, linear=Linear.DIVIDEND, inplace=True)
_elementwise_ops("pow", zeros=power, linear=Linear.NONE, inplace=True)
_elementwise_ops("where", zeros=where, linear=Linear.NONE, inplace=False)
_elementwise_ops("masked_fill", zeros=masked_fill, linear=Linear.NONE, inplace=True)
_elementwise_ops("xlog1py", zeros=first_factor, linear=Linear.FIRST, inplace=False)


def _inplace(matcher, node: torch.fx.Node) -> list[Classified]:
    """An in-place write the graph still holds: :mod:`._functionalize` replays every write it can
    prove exact out of place before matching, and says on the node why it kept this one."""
    why, nodes = node.meta.get(KEPT_IN_PLACE, ("{} writes in place where the pass did not look", (node,)))
    raise NoMatch(why, *nodes)


INPLACE = Rule(RuleKind.INPLACE, _inplace)


#: ops that select or regroup a tensor's memory without a row-wise rule: other passes see through them
_VIEW_ONLY = {"zeros": None, "linear": Linear.NONE, "sharded": None, "folds": Fold.NEVER,
              "head_sign": False, "shown": AS_KEY, "shows_numbers": True, "inplace": False, "bias_add": False,
              "dtype_cast": False, "signature": None}  # fmt: skip
declare_ops(
    "expand", "view_as", "reshape_as", "t", "transpose", "permute", "select", "unbind", "as_strided",
    "movedim", "swapaxes", "unflatten", aliases=True, selects=None, **_VIEW_ONLY
)  # fmt: skip
declare_ops("split", "chunk", aliases=True, selects=Selects.PIECES, **_VIEW_ONLY)
declare_ops("tensor_split", aliases=False, selects=Selects.PIECES, **_VIEW_ONLY)
declare_ops("narrow", aliases=True, selects=Selects.ONE_PIECE, **_VIEW_ONLY)
#: the facts every view with a rule shares: it aliases its input, writes nothing, is linear in it
#: and zero where it is, has no sharded form (it needs none) and the report shows no numbers
_VIEW = {"kind": RuleKind.VIEW, "zeros": keeps_zeros, "linear": Linear.FIRST, "shown": AS_KEY,
         "shows_numbers": False, "aliases": True, "inplace": False, "dtype_cast": False, "sharded": None,
         "head_sign": False, "selects": None, "bias_add": False, "signature": None}  # fmt: skip


@register_ops("contiguous", folds=Fold.NEVER, **_VIEW)
def _contiguous(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = rows_operand(matcher, node)
    return [Classified(matcher.step(node, "contiguous", (source,), op="call_method"), shape)]


@register_ops("squeeze", "unsqueeze", folds=Fold.NEGATIVE_DIMS, **_VIEW)
@register_ops("view", "reshape", "flatten", folds=Fold.NEVER, **_VIEW)
def _view(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = rows_operand(matcher, node)
    sizes = tuple(val(node).shape)
    count = math.prod(shape.tokens)
    if shape.layout is Layout.ROWS:
        if not (sizes and same(sizes[-1], matcher.vocab) and same(math.prod(sizes[:-1]), count)):
            raise NoMatch("{} reshapes across the vocabulary dimension", node)
        new = Shape(Layout.ROWS, sizes[:-1])
    elif sizes and same(sizes[-1], 1) and same(math.prod(sizes[:-1]), count) and len(sizes) > 1:
        new = Shape(Layout.TOKENS1, sizes[:-1])
    elif same(math.prod(sizes), count):
        new = Shape(Layout.TOKENS, sizes)
    else:
        raise NoMatch("{} reshapes across the tokens", node)
    matcher.flat_tokens(new.tokens, node, matcher.selection_of(node))
    args = (source, -1, *row_part(new.layout, matcher.vocab))
    return [Classified(matcher.step(node, "reshape", args, op="call_method"), new)]
