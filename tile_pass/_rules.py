"""Which ops act on each token's row of logits independently: one rule per op.

A region may contain an op only if a rule here proves that the op, run on a tile of rows,
gives those rows' slice of what it gives on all of them. The table is keyed by the node's
target as Dynamo records it (a torch function, an ``operator`` function, or a method
name), in the spirit of Inductor's per-op lowering tables. Each rule checks the node's
arguments (the reduced dimension is the vocabulary, an index is per-token, ...) and
returns the :class:`~tile_pass._region.Step` to replay on a tile, or raises
:class:`NoMatch` naming what it found. Anything without a rule stops the region.

Kinds of rule:

* ``elementwise``: unary and binary maths, comparisons, ``where``, casts (no device move);
  tensor operands are per-token (sliced per tile) or shared by every row (0-d, ``[V]``);
* ``inplace``: ``x += b``, ``x.mul_(s)``, ...: replayed out of place when nothing else reads ``x``;
* ``view``: ``view``/``reshape``/``flatten``/``contiguous``/``squeeze(-1)``/``unsqueeze(-1)``
  that only regroup the token dimensions;
* ``vocab_reduction``: ``sum``/``mean``/``logsumexp``/``amax``/``amin``/``argmax``/``argmin``/
  ``max``/``min`` over the vocabulary dimension; ``sum``/``mean`` over everything are split
  into a row sum and a token reduction after the tiles;
* ``normalize``: ``softmax``/``log_softmax`` over the vocabulary dimension;
* ``gather``: ``gather(-1, ids)`` with one per-token index;
* ``loss``: ``cross_entropy``/``nll_loss`` on ``[tokens, V]`` (any reduction: a mean is the
  per-token losses summed after the tiles over eager's denominator) and ``kl_div``.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass._region import Step


class NoMatch(Exception):
    """Raised with the plain-language reason a candidate cannot be rewritten exactly."""


@dataclass(frozen=True)
class Layout:
    """A value of the region: ``kind`` in ``_region.LAYOUTS`` (or ``"tuple"`` for ``max(dim)``),
    ``tokens`` the token dimensions it has in the user's graph."""

    kind: str
    tokens: tuple


@dataclass(frozen=True)
class Rule:
    kind: str
    #: the out-of-place op an in-place one is replayed as
    out_of_place: Any = None


@dataclass
class Classified:
    """What a rule made of a node: the step to replay, the value's layout, and for a reduction
    that also sums over tokens, what the tiles leave to do after them (see ``_region_match``)."""

    step: Step
    layout: Layout
    #: ("sum",) | ("mean_valid", target, class_weight, ignore_index) | ("div_tokens",) | ("div_elements",)
    after_tiles: tuple | None = None


_UNARY = ["tanh", "exp", "log", "neg", "abs", "sigmoid", "sqrt", "rsqrt", "square", "log1p", "expm1",
          "exp2", "relu", "clamp", "clip", "nan_to_num", "logical_not", "isnan", "isfinite", "isinf", "sign",
          "reciprocal", "detach", "softplus", "logsigmoid", "float", "double", "half", "bfloat16", "to",
          "type"]  # fmt: skip
_BINARY = ["add", "sub", "mul", "div", "true_divide", "pow", "eq", "ne", "lt", "le", "gt", "ge", "maximum",
           "minimum", "logical_and", "logical_or", "where", "masked_fill", "xlogy", "rsub"]  # fmt: skip
_REDUCTIONS = ["sum", "mean", "logsumexp", "amax", "amin", "argmax", "argmin", "max", "min"]

RULES: dict[Any, Rule] = {}
for _name in _UNARY + _BINARY:
    RULES[_name] = Rule("elementwise")
    for _module in (torch, torch.special, F):
        if hasattr(_module, _name) and _name not in ("float", "double", "half", "bfloat16", "to", "type"):
            RULES.setdefault(getattr(_module, _name), Rule("elementwise"))
for _name in ("add", "sub", "mul", "truediv", "pow", "eq", "ne", "lt", "le", "gt", "ge", "neg", "abs",
              "and_", "or_"):  # fmt: skip
    RULES[getattr(operator, _name)] = Rule("elementwise")
for _dunder in ("add", "sub", "mul", "truediv", "pow", "neg", "radd", "rsub", "rmul", "rtruediv", "eq", "ne",
                "lt", "le", "gt", "ge"):  # fmt: skip
    RULES[f"__{_dunder}__"] = Rule("elementwise")
for _name, _target in (("iadd", operator.add), ("isub", operator.sub), ("imul", operator.mul),
                       ("itruediv", operator.truediv)):  # fmt: skip
    RULES[getattr(operator, _name)] = Rule("inplace", _target)
for _name in ("add", "sub", "mul", "div", "clamp", "tanh", "exp", "neg", "masked_fill", "pow", "clip"):
    RULES[f"{_name}_"] = Rule("inplace", _name)
for _name in ("view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", torch.reshape,
              torch.flatten, torch.squeeze, torch.unsqueeze):  # fmt: skip
    RULES[_name] = Rule("view")
for _name in _REDUCTIONS:
    RULES[_name] = Rule("vocab_reduction")
    RULES[getattr(torch, _name)] = Rule("vocab_reduction")
for _target in ("softmax", "log_softmax", F.softmax, F.log_softmax, torch.softmax, torch.log_softmax):
    RULES[_target] = Rule("normalize")
RULES["gather"] = RULES[torch.gather] = Rule("gather")
RULES[operator.getitem] = Rule("getitem")
for _target in (F.cross_entropy, F.nll_loss, F.kl_div):
    RULES[_target] = Rule("loss")


def rule_for(node: torch.fx.Node) -> Rule | None:
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        return RULES.get(node.target)
    except TypeError:  # an unhashable target
        return None


def describe(node: torch.fx.Node) -> str:
    from tile_pass.report import source_line

    if node.op == "output":
        return "the graph output"
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"`{'.' + name + '()' if node.op == 'call_method' else name}` at {source_line(node)}"


# ------------------------------------------------------------------------ argument binding

_REDUCTION_SIGNATURES = {
    "sum": inspect.Signature.from_callable(lambda input, dim=None, keepdim=False, *, dtype=None: None),
    "mean": inspect.Signature.from_callable(lambda input, dim=None, keepdim=False, *, dtype=None: None),
    "logsumexp": inspect.Signature.from_callable(lambda input, dim, keepdim=False: None),
    "amax": inspect.Signature.from_callable(lambda input, dim=(), keepdim=False: None),
    "amin": inspect.Signature.from_callable(lambda input, dim=(), keepdim=False: None),
    "argmax": inspect.Signature.from_callable(lambda input, dim=None, keepdim=False: None),
    "argmin": inspect.Signature.from_callable(lambda input, dim=None, keepdim=False: None),
    "max": inspect.Signature.from_callable(lambda input, dim=None, keepdim=False: None),
    "min": inspect.Signature.from_callable(lambda input, dim=None, keepdim=False: None),
}
_NORMALIZE_SIGNATURE = inspect.Signature.from_callable(
    lambda input, dim=None, _stacklevel=3, dtype=None: None
)
_GATHER_SIGNATURE = inspect.Signature.from_callable(lambda input, dim, index, *, sparse_grad=False: None)
_LOSS_SIGNATURES = {target: inspect.signature(target) for target in (F.cross_entropy, F.nll_loss, F.kl_div)}


def op_name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else node.target.__name__


def bind(signature: inspect.Signature, node: torch.fx.Node) -> dict:
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError as err:
        raise NoMatch(f"{describe(node)} was called with arguments its signature rejects ({err})") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def is_vocab_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim % ndim == ndim - 1


def reduction_options(node: torch.fx.Node) -> dict:
    return bind(_REDUCTION_SIGNATURES[op_name(node)], node)


def normalize_options(node: torch.fx.Node) -> dict:
    return bind(_NORMALIZE_SIGNATURE, node)


def gather_options(node: torch.fx.Node) -> dict:
    return bind(_GATHER_SIGNATURE, node)


def loss_options(node: torch.fx.Node) -> dict:
    options = bind(_LOSS_SIGNATURES[node.target], node)
    if options.get("size_average") is not None or options.get("reduce") is not None:
        raise NoMatch(f"{describe(node)} uses the deprecated size_average/reduce arguments; pass reduction=")
    return options
