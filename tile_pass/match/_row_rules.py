"""The rules of the ops over each row's vocabulary: reductions (``sum``, ``logsumexp``, ``max``, ...),
``softmax``/``log_softmax``, ``gather``, the values or indices of ``max(dim)``, and the losses
(``cross_entropy``, ``nll_loss``, ``kl_div``); each with its vocabulary-sharded form."""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass._distributed import (
    shard_cross_entropy,
    shard_gather,
    shard_kl_div,
    shard_log_softmax,
    shard_logsumexp,
    shard_mean,
    shard_nll_loss,
    shard_softmax,
    shard_sum,
)
from tile_pass.match._fx import NoMatch, same, same_shape, val
from tile_pass.match._rule_base import (
    LOSS_SIGNATURES,
    PREVIOUS_STEP,
    AfterTiles,
    Classified,
    IndexCheck,
    Shape,
    bind,
    is_vocab_dim,
    loss_options,
    rows_operand,
)
from tile_pass.match._zero_rules import ignored_label, keeps_zeros
from tile_pass.program._op_facts import AS_KEY, FACTS, Fold, Linear, RuleKind, Selects, register_ops, spelling
from tile_pass.program._region import Layout, Ref, RefKind
from tile_pass.program._token_layout import TokenReduction

#: the facts every op over the rows shares: it writes nothing in place, makes a new tensor, selects
#: no rows, is no cast nor a bias, and the report shows it by name without its dimensions
_REDUCES_ROWS = {"inplace": False, "aliases": False, "selects": None, "bias_add": False, "dtype_cast": False,
                 "shown": AS_KEY, "shows_numbers": False}  # fmt: skip
#: the signatures the rules bind a node's arguments with (an op's ``signature`` fact)
_SUM_SIGNATURE = inspect.Signature.from_callable(lambda input, dim=None, keepdim=False, *, dtype=None: None)
_AMAX_SIGNATURE = inspect.Signature.from_callable(lambda input, dim=(), keepdim=False: None)
_LOGSUMEXP_SIGNATURE = inspect.Signature.from_callable(lambda input, dim, keepdim=False: None)
_ARGMAX_SIGNATURE = inspect.Signature.from_callable(lambda input, dim=None, keepdim=False: None)
_NORMALIZE_SIGNATURE = inspect.Signature.from_callable(
    lambda input, dim=None, _stacklevel=3, dtype=None: None
)
_GATHER_SIGNATURE = inspect.Signature.from_callable(lambda input, dim, index, *, sparse_grad=False: None)


def _vocab_reduction(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = rows_operand(matcher, node)
    name = spelling(node.target).key
    options = bind(FACTS[name].signature, node)
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
    source, shape = rows_operand(matcher, node)
    options = bind(FACTS[spelling(node.target).key].signature, node)
    if shape.layout is not Layout.ROWS or not is_vocab_dim(options["dim"], val(node).dim()):
        raise NoMatch("{} is not taken over the vocabulary dimension", node)
    kwargs = (("dtype", options["dtype"]),) if options["dtype"] is not None else ()
    target = getattr(F, spelling(node.target).key)  # F.softmax, F.log_softmax
    return [Classified(matcher.step(node, target, (source, -1), kwargs), shape)]


def _over_the_row(
    *keys: str,
    rule,
    signature,
    zeros=None,
    linear: Linear = Linear.NONE,
    sharded=None,
    head_sign: bool = False,
    folds: Fold = Fold.NEGATIVE_DIMS,
) -> None:
    """Register the reductions (``rule=_vocab_reduction``) or normalisations (``_normalize``) over
    the vocabulary ``keys`` by the facts that vary between them, all named: the signature their
    arguments bind by; where they are zero (nowhere known, unless given); what they are linear in
    (nothing, unless given); their sharded form (none: a sharded head declines them); whether
    reading the logits they sign an LM head; how a per-row loop of them folds (over negative
    dims, unless given). :data:`_REDUCES_ROWS` holds the facts they all share."""
    kind = RuleKind.NORMALIZE if rule is _normalize else RuleKind.VOCAB_REDUCTION
    register_ops(
        *keys, kind=kind, zeros=zeros, linear=linear, sharded=sharded, head_sign=head_sign, folds=folds,
        signature=signature, **_REDUCES_ROWS,
    )(rule)  # fmt: skip


_over_the_row(
    "sum", rule=_vocab_reduction, signature=_SUM_SIGNATURE, zeros=keeps_zeros, linear=Linear.FIRST,
    sharded=shard_sum,
)  # fmt: skip
_over_the_row(
    "mean", rule=_vocab_reduction, signature=_SUM_SIGNATURE, linear=Linear.FIRST, sharded=shard_mean
)
_over_the_row(
    "logsumexp", rule=_vocab_reduction, signature=_LOGSUMEXP_SIGNATURE, sharded=shard_logsumexp,
    head_sign=True,
)  # fmt: skip
_over_the_row("amax", "amin", rule=_vocab_reduction, signature=_AMAX_SIGNATURE)
_over_the_row(
    "argmax", "argmin", "max", "min", rule=_vocab_reduction, signature=_ARGMAX_SIGNATURE, folds=Fold.NEVER
)
_over_the_row("softmax", rule=_normalize, signature=_NORMALIZE_SIGNATURE, sharded=shard_softmax)
_over_the_row(
    "log_softmax", rule=_normalize, signature=_NORMALIZE_SIGNATURE, sharded=shard_log_softmax, head_sign=True
)  # fmt: skip


@register_ops(
    "gather", kind=RuleKind.GATHER, zeros=keeps_zeros, linear=Linear.NONE, sharded=shard_gather,
    folds=Fold.NEGATIVE_DIMS, head_sign=True, signature=_GATHER_SIGNATURE, **_REDUCES_ROWS,
)  # fmt: skip
def _gather(matcher, node: torch.fx.Node) -> list[Classified]:
    source, shape = rows_operand(matcher, node)
    options = bind(FACTS["gather"].signature, node)
    ndim = len(shape.tokens) + 1
    if shape.layout is not Layout.ROWS or not is_vocab_dim(options["dim"], ndim):
        raise NoMatch("{} does not gather along the vocabulary dimension", node)
    result = Shape(Layout.TOKENS1, shape.tokens)
    if not same_shape(tuple(val(node).shape), (*shape.tokens, 1)):
        raise NoMatch("{} gathers more than one id per token", node)
    index = matcher.operand(options["index"], result, node)
    check = None
    if index.kind is RefKind.TOKEN:
        bounds = (
            f"index {{}} is out of bounds for dimension {options['dim'] % ndim} with size {matcher.vocab}"
        )
        check = IndexCheck(index.index, bounds, None)
    return [Classified(matcher.step(node, torch.gather, (source, -1, index)), result, index_check=check)]


@register_ops(
    "getitem", kind=RuleKind.GETITEM, zeros=None, linear=Linear.FIRST, sharded=None, folds=Fold.NEVER,
    head_sign=False, shown=AS_KEY, shows_numbers=True, aliases=True, inplace=False, selects=Selects.INDEX,
    bias_add=False, dtype_cast=False, signature=None,
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


# the losses: their rule binds by the node's target (``LOSS_SIGNATURES``: ``torch.kl_div`` is not
# ``F.kl_div``), so they state no signature
@register_ops(
    "cross_entropy", kind=RuleKind.LOSS, zeros=ignored_label, linear=Linear.NONE, sharded=shard_cross_entropy,
    folds=Fold.NEVER, head_sign=True, signature=None, **_REDUCES_ROWS,
)  # fmt: skip
@register_ops(
    "nll_loss", kind=RuleKind.LOSS, zeros=ignored_label, linear=Linear.NONE, sharded=shard_nll_loss,
    folds=Fold.NEVER, head_sign=True, signature=None, **_REDUCES_ROWS,
)  # fmt: skip
@register_ops(
    "kl_div", kind=RuleKind.LOSS, zeros=None, linear=Linear.NONE, sharded=shard_kl_div, folds=Fold.NEVER,
    head_sign=True, signature=None, **_REDUCES_ROWS,
)  # fmt: skip
def _loss(matcher, node: torch.fx.Node) -> list[Classified]:
    if node.target not in LOSS_SIGNATURES:  # torch.kl_div: another signature than F.kl_div's
        raise NoMatch("{} is not torch.nn.functional's loss", node)
    options = loss_options(node)
    source, shape = rows_operand(matcher, node, options["input"])
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
        kwargs.append(("weight", _class_weights(matcher, node, options, soft, shape)))
    step = matcher.step(node, node.target, (source, target), kwargs)
    check = None
    if not soft and target.kind is RefKind.TOKEN:
        check = IndexCheck(target.index, "Target {} is out of bounds.", options["ignore_index"])
    after = None
    if reduction == "sum":
        after = AfterTiles(TokenReduction.SUM)
    elif reduction == "mean" and soft:
        after = AfterTiles(TokenReduction.DIV_TOKENS)
    elif reduction == "mean":
        after = AfterTiles(TokenReduction.MEAN_VALID, (target_node, weight, options["ignore_index"]))
    return [Classified(step, Shape(Layout.TOKENS, shape.tokens), after_tiles=after, index_check=check)]


def _class_weights(matcher, node: torch.fx.Node, options: dict, soft: bool, shape: Shape) -> Ref:
    """The loss's ``[V]`` class weights, an operand shared by every row."""
    weight_val = val(options["weight"])
    if weight_val is None or weight_val.dim() != 1 or not same(weight_val.shape[0], matcher.vocab):
        raise NoMatch("{} has class weights that are not a [V] tensor", node)
    logits_dtype = val(options["input"]).dtype
    if not soft and weight_val.dtype != logits_dtype and matcher.step(node, None, ()).autocast is None:
        raise NoMatch("{} has {} class weights for {} logits and class indices; eager raises for it "
                      "(left to raise, before any label check)", node, weight_val.dtype,
                      logits_dtype, eager_raises=True)  # fmt: skip
    return matcher.operand(options["weight"], shape, node)


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
