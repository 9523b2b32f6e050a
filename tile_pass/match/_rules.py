"""Which ops act on each token's row of logits independently: one rule per op, and its facts.

A region may contain an op only if a rule here proves that the op, run on a tile of rows,
gives those rows' slice of what it gives on all of them. Each rule is registered with every
other fact about its ops (where the op is zero, in which operands it is linear, its sharded
form, whether a per-row loop of it folds, its report name, ...) by
:func:`tile_pass.match._op_facts.register_ops`, on the op's canonical key (one for all the ways
Dynamo spells it). A rule takes the matcher and the node, checks the node's arguments (the
reduced dimension is the vocabulary, an index is per-token, ...) and returns the
:class:`Classified` steps to replay on a tile, or raises :class:`NoMatch` naming what it
found. Anything without a rule stops the region.

Adding an op is one registration here: its rule (often an existing one) and its facts.
"""

from __future__ import annotations

import enum
import inspect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass.match._functionalize import KEPT_IN_PLACE
from tile_pass.match._fx import NoMatch, same, same_shape, val
from tile_pass.match._op_facts import (
    AS_KEY,
    FACTS,
    Fold,
    Linear,
    OpFacts,
    RuleKind,
    Selects,
    declare_ops,
    register_ops,
    spelling,
)
from tile_pass.program._region import (
    Layout,
    Ref,
    RefKind,
    Step,
    ZeroAll,
    ZeroAny,
    ZeroIf,
    ZeroKind,
    Zeros,
    row_part,
)


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


class TokenReduction(enum.Enum):
    """A token reduction an op folds in, finished after the tiles; the value is the report's name."""

    SUM = "sum"
    DIV_ELEMENTS = "div_elements"  # a mean over the tokens and the vocabulary
    DIV_TOKENS = "div_tokens"
    DIV_FIRST_DIM = "div_first_dim"  # kl_div's batchmean: the input's first dimension
    MEAN_VALID = "mean_valid"  # eager's denominator: the labelled tokens (class-weighted)


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


@dataclass(frozen=True)
class Classified:
    """What a rule made of a node: the step to replay, the value's shape, and for a reduction
    that also sums over tokens, what the tiles leave to do after them."""

    step: Step
    shape: Shape
    after_tiles: AfterTiles | None = None


#: an operand of a rule's second step: the value of its first (the walk numbers it)
PREVIOUS_STEP = Ref(RefKind.VALUE, -1)

#: a rule: (the ``_matcher.RegionMatcher``, the node) -> its steps, or ``NoMatch``
ClassifyFn = Callable[[Any, torch.fx.Node], list[Classified]]


@dataclass(frozen=True)
class Rule:
    kind: RuleKind
    classify: ClassifyFn


def rule_for(node: torch.fx.Node) -> Rule | OpFacts | None:
    """The row-wise rule of ``node``'s op as spelled (an in-place spelling's is :func:`_inplace`,
    if its op's facts allow it); ``None``: the op stops a region."""
    if node.op not in ("call_function", "call_method"):
        return None
    spelled = spelling(node.target)
    facts = None if spelled is None else FACTS.get(spelled.key)
    if facts is None or facts.kind is None:
        return None
    if spelled.inplace:
        return _INPLACE if facts.inplace else None
    return facts


# ------------------------------------------------------------------------ argument binding

_SUM_SIGNATURE = inspect.Signature.from_callable(lambda input, dim=None, keepdim=False, *, dtype=None: None)
_AMAX_SIGNATURE = inspect.Signature.from_callable(lambda input, dim=(), keepdim=False: None)
_REDUCTION_SIGNATURES = {
    "sum": _SUM_SIGNATURE, "mean": _SUM_SIGNATURE, "amax": _AMAX_SIGNATURE, "amin": _AMAX_SIGNATURE,
    "logsumexp": inspect.Signature.from_callable(lambda input, dim, keepdim=False: None),
    **dict.fromkeys(("argmax", "argmin", "max", "min"),
                    inspect.Signature.from_callable(lambda input, dim=None, keepdim=False: None)),
}  # fmt: skip
_NORMALIZE_SIGNATURE = inspect.Signature.from_callable(
    lambda input, dim=None, _stacklevel=3, dtype=None: None
)
_GATHER_SIGNATURE = inspect.Signature.from_callable(lambda input, dim, index, *, sparse_grad=False: None)
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


def _rows_operand(matcher, node: torch.fx.Node, source=None) -> tuple[Ref, Shape]:
    """The region value an op over rows takes first (``source``, if bound already), and its shape."""
    source = source if source is not None else node.args[0] if node.args else None
    shape = matcher.shape_of(source)
    if shape is None or shape.layout in (Layout.REDUCED, Layout.TUPLE):
        raise NoMatch("{} does not take the logits as its first operand", node)
    return matcher.value_ref(source), shape


# ------------------------------------------------------------------------------ zero rules
# ``rule(step, of, token)``: where the step's value is zero whatever the logits, from ``of(arg)``
# (an operand's :class:`~tile_pass.program._region.Zeros` or ``None``) and ``token(arg)`` (a per-token
# input?); read by :func:`tile_pass.program._region.zero_where`, registered as an op's ``zeros`` fact.


def _number(arg) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _either(*parts) -> Zeros | None:
    parts = tuple(p for p in parts if p is not None)
    return None if not parts else parts[0] if len(parts) == 1 else ZeroAny(parts)


def _ignored_label(step, of, token):
    """A loss is zero, and its gradient too, at a token whose label is ``ignore_index``."""
    kwargs = dict(step.kwargs)
    target = step.args[1] if len(step.args) > 1 else kwargs.get("target")
    return ZeroIf(target.index, ZeroKind.EQUALS, kwargs.get("ignore_index", -100)) if token(target) else None


def _product(step, of, token):
    """Zero where a factor is; a per-token factor where it is 0, but not for ``inf`` logits (0 * inf)."""
    factors = [ZeroIf(a.index, ZeroKind.ZERO, exact=False) if token(a) else of(a) for a in step.args]
    return _either(*factors) if len(factors) == 2 else None


def _divide(step, of, token):
    """Zero where the dividend is, divided by a nonzero number."""
    return of(step.args[0]) if len(step.args) == 2 and _number(step.args[1]) and step.args[1] != 0 else None


def _power(step, of, token):
    """Zero where the base is, to a positive power (``0 ** 0`` is 1)."""
    return of(step.args[0]) if len(step.args) == 2 and _number(step.args[1]) and step.args[1] > 0 else None


def _sum(step, of, token):
    """Zero where both terms are."""
    a, b = (of(arg) for arg in step.args) if len(step.args) == 2 else (None, None)
    return None if a is None or b is None else ZeroAll((a, b))


def _where(step, of, token):
    """``where(mask, x, 0)`` is zero where the mask is false or ``x`` is; ``where(mask, 0, y)``: true."""
    if len(step.args) != 3 or not token(step.args[0]):
        return None
    cond, x, y = step.args
    if _number(y) and y == 0:
        return _either(ZeroIf(cond.index, ZeroKind.FALSE), of(x))
    return _either(ZeroIf(cond.index, ZeroKind.TRUE), of(y)) if _number(x) and x == 0 else None


def _masked_fill(step, of, token):
    """``masked_fill(mask, 0)`` is zero where the mask is true or the input is zero."""
    args = step.args
    if len(args) >= 3 and token(args[1]) and _number(args[2]) and args[2] == 0:
        return _either(ZeroIf(args[1].index, ZeroKind.TRUE), of(args[0]))
    return None


def _first_factor(step, of, token):
    """``xlog1py(x, y) = x * log1p(y)`` is zero where ``x`` is; for a per-token ``x`` where it is
    0, but not for NaN logits (``xlog1py(0, nan)`` is NaN)."""
    if len(step.args) != 2:
        return None
    x = step.args[0]
    return ZeroIf(x.index, ZeroKind.ZERO, exact=False) if token(x) else of(x)


def _keeps_zeros(step, of, token):
    """``f(0) == 0``: zero where the (first) operand is."""
    return of(step.args[0]) if step.args else None


# ------------------------------------------------------------------------------ rules
# Each registration states every fact of its ops (see tile_pass.match._op_facts.OpFacts).
_ELEMENTWISE = RuleKind.ELEMENTWISE
#: the facts every elementwise op shares, stated once: no sharded form (it needs none), it signs
#: no head and selects no rows, a per-row loop of it folds, the report shows it and its numbers
_ELEMENTWISE_FACTS = {"sharded": None, "head_sign": False, "selects": None, "folds": Fold.ALWAYS,
                      "shown": AS_KEY, "shows_numbers": True}  # fmt: skip


#: the elementwise ops, a row per set of facts: (keys, where the result is zero, what it is linear in,
#: replayed out of place when written in place, aliases its input, a dtype cast, a bias add); each row
#: states every fact that varies, :data:`_ELEMENTWISE_FACTS` the ones they all share
_ELEMENTWISE_OPS = (
    (("log", "sigmoid", "rsqrt", "log1p", "expm1", "clamp_min", "clamp_max", "exp2", "nan_to_num",
      "logical_not", "isnan", "isfinite", "isinf", "reciprocal", "softplus", "logsigmoid", "eq", "ne", "lt",
      "le", "gt", "ge", "maximum", "minimum", "logical_and", "logical_or", "logical_xor", "invert",
      "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "xlogy", "lerp", "rdiv", "and_", "or_",
      "xor"),
     None, Linear.NONE, False, False, False, False),
    (("exp", "clamp", "clip"), None, Linear.NONE, True, False, False, False),
    (("abs", "sqrt", "square", "relu", "sign"), _keeps_zeros, Linear.NONE, False, False, False, False),
    (("tanh",), _keeps_zeros, Linear.NONE, True, False, False, False),
    (("neg",), _keeps_zeros, Linear.FIRST, True, False, False, False),
    (("detach", "half", "bfloat16"), _keeps_zeros, Linear.NONE, False, True, False, False),
    (("float", "double"), _keeps_zeros, Linear.FIRST, False, True, False, False),
    (("to", "type"), _keeps_zeros, Linear.CAST, False, True, True, False),
    (("add",), _sum, Linear.TERMS, True, False, False, True),
    (("sub",), _sum, Linear.TERMS, True, False, False, False),
    (("rsub",), _sum, Linear.TERMS, False, False, False, False),
    (("mul",), _product, Linear.FACTOR, True, False, False, False),
    (("div",), _divide, Linear.DIVIDEND, True, False, False, False),
    (("pow",), _power, Linear.NONE, True, False, False, False),
    (("where",), _where, Linear.NONE, False, False, False, False),
    (("masked_fill",), _masked_fill, Linear.NONE, True, False, False, False),
    (("xlog1py",), _first_factor, Linear.FIRST, False, False, False, False),
)  # fmt: skip


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


for _keys, _zeros, _linear, _inplace, _aliases, _cast, _bias_add in _ELEMENTWISE_OPS:
    register_ops(*_keys, kind=_ELEMENTWISE, zeros=_zeros, linear=_linear, inplace=_inplace, aliases=_aliases,
                 dtype_cast=_cast, bias_add=_bias_add, **_ELEMENTWISE_FACTS)(_elementwise)  # fmt: skip


def _inplace(matcher, node: torch.fx.Node) -> list[Classified]:
    """An in-place write the graph still holds: :mod:`._functionalize` replays every write it can
    prove exact out of place before matching, and says on the node why it kept this one."""
    why, nodes = node.meta.get(KEPT_IN_PLACE, ("{} writes in place where the pass did not look", (node,)))
    raise NoMatch(why, *nodes)


_INPLACE = Rule(RuleKind.INPLACE, _inplace)


#: ops that select or regroup a tensor's memory without a row-wise rule: other passes see through them
_VIEW_ONLY = {"zeros": None, "linear": Linear.NONE, "sharded": None, "folds": Fold.NEVER,
              "head_sign": False, "shown": AS_KEY, "shows_numbers": True, "inplace": False, "bias_add": False,
              "dtype_cast": False}  # fmt: skip
declare_ops(
    "expand", "view_as", "reshape_as", "t", "transpose", "permute", "select", "unbind", "as_strided",
    "movedim", "swapaxes", "unflatten", aliases=True, selects=None, **_VIEW_ONLY
)  # fmt: skip
declare_ops(
    "split", "chunk", aliases=True, selects=Selects.PIECES, **_VIEW_ONLY
)  # fmt: skip
declare_ops(
    "tensor_split", aliases=False, selects=Selects.PIECES, **_VIEW_ONLY
)  # fmt: skip
declare_ops(
    "narrow", aliases=True, selects=Selects.ONE_PIECE, **_VIEW_ONLY
)  # fmt: skip


@register_ops(
    "contiguous", kind=RuleKind.VIEW, zeros=_keeps_zeros, linear=Linear.FIRST, folds=Fold.NEVER,
    shown=AS_KEY, shows_numbers=False, aliases=True, inplace=False, dtype_cast=False, sharded=None,
    head_sign=False, selects=None, bias_add=False
)  # fmt: skip
def _contiguous(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = _rows_operand(matcher, node)
    return [Classified(matcher.step(node, "contiguous", (source,), op="call_method"), shape)]


@register_ops(
    "squeeze", "unsqueeze", kind=RuleKind.VIEW, zeros=_keeps_zeros, linear=Linear.FIRST,
    folds=Fold.NEGATIVE_DIMS, shown=AS_KEY, shows_numbers=False, aliases=True, inplace=False,
    dtype_cast=False, sharded=None, head_sign=False, selects=None, bias_add=False
)  # fmt: skip
@register_ops(
    "view", "reshape", "flatten", kind=RuleKind.VIEW, zeros=_keeps_zeros, linear=Linear.FIRST,
    folds=Fold.NEVER, shown=AS_KEY, shows_numbers=False, aliases=True, inplace=False, dtype_cast=False,
    sharded=None, head_sign=False, selects=None, bias_add=False
)  # fmt: skip
def _view(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = _rows_operand(matcher, node)
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
    matcher.flat_tokens(new.tokens)
    args = (source, -1, *row_part(new.layout, matcher.vocab))
    return [Classified(matcher.step(node, "reshape", args, op="call_method"), new)]


_REDUCES_ROWS = {"inplace": False, "aliases": False, "selects": None, "bias_add": False, "dtype_cast": False,
               "shown": AS_KEY, "shows_numbers": False}  # fmt: skip


def _vocab_reduction(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = _rows_operand(matcher, node)
    name = spelling(node.target).key
    options = bind(_REDUCTION_SIGNATURES[name], node)
    dim = options["dim"]
    if shape.layout is not Layout.ROWS:
        raise NoMatch("{} reduces over the tokens", node)
    if dim is None or dim == () or dim == []:
        if name not in ("sum", "mean") or options.get("dtype") is not None:
            raise NoMatch("{} reduces over the tokens and the vocabulary at once", node)
        if val(node.args[0]).dtype not in (torch.float32, torch.float64):
            raise NoMatch("{} sums half-precision logits over all tokens", node)
        step = matcher.step(node, "sum", (source, -1), op="call_method")
        how = TokenReduction.SUM if name == "sum" else TokenReduction.DIV_ELEMENTS
        after = AfterTiles(how, () if name == "sum" else (matcher.vocab,))
        return [Classified(step, Shape(Layout.TOKENS, shape.tokens), after_tiles=after)]
    if not is_vocab_dim(dim, len(shape.tokens) + 1):
        raise NoMatch("{} reduces over the token dimensions", node)
    keepdim = bool(options["keepdim"])
    kwargs = (("dtype", options["dtype"]),) if options.get("dtype") is not None else ()
    item = Layout.TOKENS1 if keepdim else Layout.TOKENS
    result = Shape(Layout.TUPLE, shape.tokens, item) if name in ("max", "min") else Shape(item, shape.tokens)
    return [Classified(matcher.step(node, name, (source, -1, keepdim), kwargs, op="call_method"), result)]


def _normalize(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = _rows_operand(matcher, node)
    options = bind(_NORMALIZE_SIGNATURE, node)
    if shape.layout is not Layout.ROWS or not is_vocab_dim(options["dim"], val(node).dim()):
        raise NoMatch("{} is not taken over the vocabulary dimension", node)
    kwargs = (("dtype", options["dtype"]),) if options["dtype"] is not None else ()
    target = getattr(F, spelling(node.target).key)  # F.softmax, F.log_softmax
    return [Classified(matcher.step(node, target, (source, -1), kwargs), shape)]


#: the ops over each row's vocabulary, a row per set of facts: (keys, rule, where the result is zero,
#: what it is linear in, its vocabulary-sharded step, how a per-row loop of it folds, whether it signs an
#: LM head); :data:`_REDUCES_ROWS` holds the facts they all share
_NEG = Fold.NEGATIVE_DIMS
_OVER_THE_ROW = (
    (("sum",), _vocab_reduction, _keeps_zeros, Linear.FIRST, "shard_sum", _NEG, False),
    (("mean",), _vocab_reduction, None, Linear.FIRST, "shard_mean", _NEG, False),
    (("logsumexp",), _vocab_reduction, None, Linear.NONE, "shard_logsumexp", _NEG, True),
    (("amax", "amin"), _vocab_reduction, None, Linear.NONE, None, _NEG, False),
    (("argmax", "argmin", "max", "min"), _vocab_reduction, None, Linear.NONE, None, Fold.NEVER, False),
    (("softmax",), _normalize, None, Linear.NONE, "shard_softmax", _NEG, False),
    (("log_softmax",), _normalize, None, Linear.NONE, "shard_log_softmax", _NEG, True),
)  # fmt: skip
for _keys, _rule, _zeros, _linear, _sharded, _folds, _head_sign in _OVER_THE_ROW:
    _kind = RuleKind.VOCAB_REDUCTION if _rule is _vocab_reduction else RuleKind.NORMALIZE
    register_ops(*_keys, kind=_kind, zeros=_zeros, linear=_linear, sharded=_sharded, folds=_folds,
                 head_sign=_head_sign, **_REDUCES_ROWS)(_rule)  # fmt: skip


@register_ops(
    "gather", kind=RuleKind.GATHER, zeros=_keeps_zeros, linear=Linear.NONE, sharded="shard_gather",
    folds=Fold.NEGATIVE_DIMS, head_sign=True, **_REDUCES_ROWS
)  # fmt: skip
def _gather(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = _rows_operand(matcher, node)
    options = bind(_GATHER_SIGNATURE, node)
    ndim = len(shape.tokens) + 1
    if shape.layout is not Layout.ROWS or not is_vocab_dim(options["dim"], ndim):
        raise NoMatch("{} does not gather along the vocabulary dimension", node)
    result = Shape(Layout.TOKENS1, shape.tokens)
    if not same_shape(tuple(val(node).shape), (*shape.tokens, 1)):
        raise NoMatch("{} gathers more than one id per token", node)
    index = matcher.operand(options["index"], result, node)
    if index.kind is RefKind.TOKEN:
        bounds = (
            f"index {{}} is out of bounds for dimension {options['dim'] % ndim} with size {matcher.vocab}"
        )
        matcher.index_checks.append((index.index, bounds, None))
    return [Classified(matcher.step(node, torch.gather, (source, -1, index)), result)]


@register_ops(
    "getitem", kind=RuleKind.GETITEM, zeros=None, linear=Linear.FIRST, sharded=None, folds=Fold.NEVER,
    head_sign=False, shown=AS_KEY, shows_numbers=True, aliases=True, inplace=False, selects=Selects.INDEX,
    bias_add=False, dtype_cast=False
)  # fmt: skip
def _getitem(matcher, node: torch.fx.Node) -> list[Classified]:
    shape = matcher.shape_of(node.args[0])
    if shape is None:
        raise NoMatch("{} does not take the logits as its first operand", node)
    if shape.layout is not Layout.TUPLE or not isinstance(node.args[1], int):
        raise NoMatch(
            "{} slices the logits' token rows; that is not tiled in a multi-output region yet", node
        )
    step = matcher.step(node, operator.getitem, (matcher.value_ref(node.args[0]), node.args[1]))
    return [Classified(step, Shape(shape.item, shape.tokens))]


@register_ops(
    "cross_entropy", kind=RuleKind.LOSS, zeros=_ignored_label, linear=Linear.NONE,
    sharded="shard_cross_entropy", folds=Fold.NEVER, head_sign=True, **_REDUCES_ROWS
)  # fmt: skip
@register_ops(
    "nll_loss", kind=RuleKind.LOSS, zeros=_ignored_label, linear=Linear.NONE, sharded="shard_nll_loss",
    folds=Fold.NEVER, head_sign=True, **_REDUCES_ROWS
)  # fmt: skip
@register_ops(
    "kl_div", kind=RuleKind.LOSS, zeros=None, linear=Linear.NONE, sharded="shard_kl_div", folds=Fold.NEVER,
    head_sign=True, **_REDUCES_ROWS
)  # fmt: skip
def _loss(matcher, node: torch.fx.Node) -> list[Classified]:
    if node.target not in LOSS_SIGNATURES:  # torch.kl_div: another signature than F.kl_div's
        raise NoMatch("{} is not torch.nn.functional's loss", node)
    options = loss_options(node)
    source, shape = _rows_operand(matcher, node, options["input"])
    reduction = options["reduction"]
    if not isinstance(reduction, str) or reduction not in ("none", "sum", "mean", "batchmean"):
        raise NoMatch("{} has reduction={!r}", node, reduction)
    if shape.layout is not Layout.ROWS:
        raise NoMatch("{} does not take [tokens, V] logits", node)
    if node.target is F.kl_div:
        return _kl_div(matcher, node, options, source, shape)
    if reduction == "batchmean":
        raise NoMatch("{} has reduction='batchmean'", node)
    if len(shape.tokens) != 1:
        raise NoMatch("{} takes [B, T, V] logits, whose class dimension is not the last", node)
    for name, kinds in (("ignore_index", int), ("label_smoothing", (int, float))):
        value = options.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise NoMatch("{} has a {} that is not a compile-time constant ({!r})", node, name, value)
    target_node = options["target"]
    target_val = val(target_node)
    if target_val is None or matcher.shape_of(target_node) is not None:
        raise NoMatch("{} takes a target computed from the logits", node)
    soft = target_val.is_floating_point()
    if soft and node.target is F.nll_loss:
        raise NoMatch("nll_loss takes class indices, not class probabilities", node=node)
    if not soft and target_val.dtype not in (torch.int64, torch.uint8):
        raise NoMatch(
            "{} has a {} target; eager expects int64 (or uint8)", node, target_val.dtype, eager_raises=True
        )
    target = matcher.operand(target_node, Shape(Layout.ROWS if soft else Layout.TOKENS, shape.tokens), node)
    weight = options.get("weight")
    kwargs = [("ignore_index", options["ignore_index"]), ("reduction", "none")]
    if node.target is F.cross_entropy:
        smoothing = float(options["label_smoothing"])
        if smoothing > 1.0:
            raise NoMatch("label_smoothing is above 1; eager raises for it", node=node, eager_raises=True)
        # eager smooths only above 0: a negative or NaN value is no smoothing, as it is here
        kwargs.append(("label_smoothing", smoothing if smoothing > 0.0 else 0.0))
    if weight is not None:
        weight_val = val(weight)
        if weight_val is None or weight_val.dim() != 1 or not same(weight_val.shape[0], matcher.vocab):
            raise NoMatch("{} has class weights that are not a [V] tensor", node)
        logits_dtype = val(options["input"]).dtype
        if not soft and weight_val.dtype != logits_dtype and matcher.step(node, None, ()).autocast is None:
            raise NoMatch("{} has {} class weights for {} logits and class indices; eager raises for it "
                          "(left to raise, before any label check)", node, weight_val.dtype,
                          logits_dtype, eager_raises=True)  # fmt: skip
        kwargs.append(("weight", matcher.operand(weight, shape, node)))
    step = matcher.step(node, node.target, (source, target), kwargs)
    if not soft and target.kind is RefKind.TOKEN:
        matcher.index_checks.append((target.index, "Target {} is out of bounds.", options["ignore_index"]))
    after = None
    if reduction == "sum":
        after = AfterTiles(TokenReduction.SUM)
    elif reduction == "mean" and soft:
        after = AfterTiles(TokenReduction.DIV_TOKENS)
    elif reduction == "mean":
        after = AfterTiles(TokenReduction.MEAN_VALID, (target_node, weight, options["ignore_index"]))
    return [Classified(step, Shape(Layout.TOKENS, shape.tokens), after_tiles=after)]


def _kl_div(matcher, node, options: dict, source: Ref, shape: Shape) -> list[Classified]:
    target_shape = matcher.shape_of(options["target"])
    if target_shape is not None and target_shape.layout is not Layout.ROWS:
        raise NoMatch("{} compares the logits with a value that is not [tokens, V]", node)
    target = matcher.operand(options["target"], shape, node)
    log_target = options["log_target"]
    if not isinstance(log_target, bool):
        raise NoMatch("{} has a log_target that is not a constant", node)
    step = matcher.step(node, F.kl_div, (source, target), (("reduction", "none"), ("log_target", log_target)))
    reduction = options["reduction"]
    if reduction == "none":
        return [Classified(step, shape)]
    after = {
        "sum": AfterTiles(TokenReduction.SUM),
        "mean": AfterTiles(TokenReduction.DIV_ELEMENTS, (matcher.vocab,)),
        "batchmean": AfterTiles(TokenReduction.DIV_FIRST_DIM),
    }[reduction]
    row_sum = matcher.step(node, "sum", (PREVIOUS_STEP, -1), op="call_method")
    return [Classified(step, shape), Classified(row_sum, Shape(Layout.TOKENS, shape.tokens), after)]
