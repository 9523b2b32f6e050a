"""Every fact about one op, on one key: what a region, the report and the passes ask of it.

Dynamo records one op many ways: ``x + y`` is ``operator.add``, ``torch.add``, the method
``"add"``, ``"__add__"`` or ``"__radd__"``, and ``x += y`` is ``operator.iadd`` or ``"add_"``.
:func:`spelling` normalises any node target to one canonical key (``"add"``), whether the
spelling writes in place, and the out-of-place target it is replayed as; it is computed once
per target. :func:`register_ops` records one frozen :class:`OpFacts` per key, next to the
op's row-wise rule (the rules of ``tile_pass.match``), as Inductor's AutoChunker registers its
per-op rules. Every fact is given at registration (``zeros=None`` says "never known to be
zero") and checked there: a missing or ill-typed one raises at import, rather than leaving a
region silently untiled, a raw name in the report, or a sharded form that is looked up when a
region is matched.

The facts are the IR's vocabulary: this module imports nothing from tile_pass, so every phase
may read it (the matcher registers the facts; the program, the report and the passes read them).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


class RuleKind(enum.Enum):
    """What an op's row-wise rule proves of it; the loop folder (``match._fold_loops``) reads it too.

    * ``ELEMENTWISE``: unary and binary maths, comparisons, ``where``, casts (no device move);
      tensor operands are per-token (sliced per tile) or shared by every row (0-d, ``[V]``);
    * ``INPLACE``: ``x += b``, ``x.mul_(s)``, ... that ``match._functionalize`` kept in place (it replays
      the others out of place before matching): the region stops there, with the pre-pass's reason
      (the kind of an in-place spelling of an op whose facts say ``inplace=True``);
    * ``VIEW``: ``view``/``reshape``/``flatten``/``contiguous``/``squeeze(-1)``/``unsqueeze(-1)``
      that only regroup the token dimensions;
    * ``VOCAB_REDUCTION``: ``sum``/``mean``/``logsumexp``/``amax``/``amin``/``argmax``/``argmin``/
      ``max``/``min`` over the vocabulary dimension; ``sum``/``mean`` over everything are split
      into a row sum and a token reduction after the tiles;
    * ``NORMALIZE``: ``softmax``/``log_softmax`` over the vocabulary dimension;
    * ``GATHER``: ``gather(-1, ids)`` with one per-token index;
    * ``GETITEM``: the values or the indices of ``max(dim)``/``min(dim)``;
    * ``LOSS``: ``cross_entropy``/``nll_loss`` on ``[tokens, V]`` (any reduction: a mean is the
      per-token losses summed after the tiles over eager's denominator) and ``kl_div``.
    """

    ELEMENTWISE, INPLACE, VIEW, VOCAB_REDUCTION, NORMALIZE, GATHER, GETITEM, LOSS = range(8)

    @property
    def over_vocab(self) -> bool:
        """Its steps work across the vocabulary: a sharded head needs their group-wide form."""
        return self in (RuleKind.VOCAB_REDUCTION, RuleKind.NORMALIZE, RuleKind.GATHER, RuleKind.LOSS)


class Linear(enum.Enum):
    """In which operands an op is linear, for the scalar loss joined to the region
    (``tile_pass.match._scalar_loss``): its gradient must not depend on the values it reads."""

    NONE = "none"
    FIRST = "first"  # in its first operand, when no other operand is linear
    CAST = "cast"  # as FIRST, when its other arguments are dtypes (``to``/``type``)
    FACTOR = "factor"  # a product: in whichever one operand is linear
    DIVIDEND = "dividend"  # a quotient: in the dividend, without a rounding mode
    TERMS = "terms"  # a sum or difference: in every operand


class Fold(enum.Enum):
    """Whether a per-row Python loop of the op folds into one op on the batch (``match._fold_loops``)."""

    NEVER = "never"
    ALWAYS = "always"  # elementwise
    NEGATIVE_DIMS = "negative_dims"  # over trailing dimensions, when every dimension is negative


class Selects(enum.Enum):
    """How an op selects token rows of the logits (``match._selections.row_selection``)."""

    PIECES = "pieces"  # ``chunk``/``split``/``tensor_split``: a tuple of pieces
    ONE_PIECE = "one_piece"  # ``narrow``
    INDEX = "index"  # ``getitem``: an index, or one piece of a split


class _AsKey:
    def __repr__(self) -> str:
        return "AS_KEY"


#: ``shown=AS_KEY``: the report names the op by its key
AS_KEY: Any = _AsKey()


@dataclass(frozen=True)
class OpFacts:
    """Everything the package knows of one op; ``kind``/``classify`` are ``None`` for an op with
    no row-wise rule that other facts are still about (a view that aliases, a split)."""

    key: str
    kind: RuleKind | None
    #: the row-wise rule: (the ``match._matcher.RegionMatcher``, the node) -> its steps, or ``NoMatch``
    classify: Callable | None
    #: ``rule(step, of, token)``: where the step's value is zero whatever the logits
    #: (``tile_pass.program._region.zero_where``); ``None``: nowhere known
    zeros: Callable | None
    linear: Linear
    #: its group-wide form for a vocabulary-sharded head (a function of ``tile_pass._distributed``
    #: taking the step's arguments and the shard's ``group_name``, and ``vocab_start``/``vocab_size``
    #: if it names them; only for an op over the vocabulary); ``None``: it has none, and the
    #: region is declined
    sharded: Callable | None
    folds: Fold
    #: reading the logits, it makes their projection an LM head (a loss, a log-softmax)
    head_sign: bool
    #: the report's name for it, however spelled
    shown: str
    #: the report shows its number arguments (a soft-cap's ``div(30.0)``), not only dimensions
    shows_numbers: bool
    #: its result may share memory with its first operand (an in-place write shows through)
    aliases: bool
    #: its in-place spelling (``x.add_(y)``, ``x += y``) is replayed out of place
    inplace: bool
    selects: Selects | None
    #: ``logits + b`` with a ``[V]`` bias joins the projection, as ``F.linear``'s bias
    bias_add: bool
    #: a cast whose arguments say the dtype (``to``/``type``): replayed only for a dtype
    dtype_cast: bool
    #: the signature its rule binds a node's arguments with (a reduction's ``dim``/``keepdim``);
    #: ``None``: its rule binds none, or binds by the node's target (a loss)
    signature: inspect.Signature | None

    def __post_init__(self):
        flags = ("head_sign", "shows_numbers", "aliases", "inplace", "bias_add", "dtype_cast")
        kinds = {
            "linear": Linear, "folds": Fold, "selects": (Selects, type(None)), "shown": str,
            "kind": (RuleKind, type(None)), "signature": (inspect.Signature, type(None)),
            **dict.fromkeys(flags, bool),
        }  # fmt: skip
        for name, kind in kinds.items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"op {self.key!r}: fact {name}={getattr(self, name)!r} is not a {kind}")
        if (self.kind is None) != (self.classify is None) or self.kind is RuleKind.INPLACE:
            raise ValueError(f"op {self.key!r}: a rule kind (not INPLACE) comes with its classify function")
        for name in ("zeros", "sharded"):  # functions, resolved here (never a name looked up later)
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"op {self.key!r}: {name}={getattr(self, name)!r} is not a function")


#: the facts every registration gives, by name
FACT_NAMES = frozenset(f.name for f in dataclasses.fields(OpFacts)) - {"key", "kind", "classify"}

FACTS: dict[str, OpFacts] = {}


def register_ops(*keys: str, kind: RuleKind | None, **facts) -> Callable:
    """Decorate the row-wise rule of ops ``keys`` (canonical keys, see :func:`spelling`) and
    record their facts; every fact of :data:`FACT_NAMES` must be given (``shown=AS_KEY`` names
    each op by its key). Raises on a missing or unknown fact, or a key that has facts already."""
    missing, unknown = FACT_NAMES - facts.keys(), facts.keys() - FACT_NAMES
    if missing or unknown:
        raise TypeError(f"facts of {keys}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    if facts["shown"] is not AS_KEY and len(keys) > 1:
        raise ValueError(f"facts of {keys}: one shown name for several ops; give shown=AS_KEY")
    if taken := sorted(k for k in keys if k in FACTS):
        raise ValueError(f"{taken} already have facts")

    def register(classify: Callable | None) -> Callable | None:
        rows = {}
        for key in keys:
            shown = key if facts["shown"] is AS_KEY else facts["shown"]
            rows[key] = OpFacts(key, kind, classify, **{**facts, "shown": shown})
        FACTS.update(rows)  # all or none
        return classify

    return register


def declare_ops(*keys: str, **facts) -> None:
    """Record the facts of ops that have no row-wise rule (a view other passes must see through)."""
    register_ops(*keys, kind=None, **facts)(None)


# ---------------------------------------------------------------------------- spellings


@dataclass(frozen=True)
class Spelling:
    """One way Dynamo records an op: its key, whether it writes in place, and the target an
    in-place spelling is replayed as (the spelling itself otherwise)."""

    key: str
    inplace: bool
    out_of_place: Any


#: binary operators that have reflected (``__radd__``) and in-place (``__iadd__``) spellings
_BINARY = frozenset({"add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "matmul", "and", "or",
                     "xor", "lshift", "rshift"})  # fmt: skip
_COMMUTATIVE = frozenset({"add", "mul", "and", "or", "xor"})
#: names of one op: Python's operator names, torch's aliases
_SYNONYMS = {"truediv": "div", "true_divide": "div", "rtruediv": "rdiv", "and": "and_", "or": "or_"}
#: where a function target is looked up by identity; the first name found is its key
_NAMESPACES = (F, torch.special, torch)
_index: dict[Any, str] = {}
_spellings: dict[Any, Spelling | None] = {}


def _function_names() -> dict[Any, str]:
    if not _index:
        for module in _NAMESPACES:
            for name, obj in sorted(vars(module).items()):  # not getattr: it would import lazy submodules
                if not name.startswith("_") and callable(obj) and not isinstance(obj, type):
                    try:
                        _index.setdefault(obj, name)
                    except TypeError:  # an unhashable callable
                        pass
    return _index


def _method(name: str) -> Spelling:
    inplace, out_of_place = False, name
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        core = name[2:-2]
        if core[:1] == "i" and core[1:] in _BINARY:
            core, inplace, out_of_place = core[1:], True, f"__{core[1:]}__"
        elif core[:1] == "r" and core[1:] in _BINARY and core[1:] in _COMMUTATIVE:
            core = core[1:]
    elif name.endswith("_"):
        core, inplace, out_of_place = name[:-1], True, name[:-1]
    else:
        core = name
    return Spelling(_SYNONYMS.get(core, core), inplace, out_of_place)


def _function(target) -> Spelling | None:
    name = getattr(target, "__name__", None)
    if isinstance(name, str) and getattr(operator, name, None) is target:
        if name[:1] == "i" and name[1:] in _BINARY:
            base = name[1:] + ("_" if name[1:] in ("and", "or") else "")
            return Spelling(_SYNONYMS.get(name[1:], name[1:]), True, getattr(operator, base))
        return Spelling(_SYNONYMS.get(name, name), False, target)
    try:
        name = _function_names().get(target)
    except TypeError:
        return None
    if name is None:
        return None
    if name.endswith("_") and not name.startswith("_"):
        for module in _NAMESPACES:
            if getattr(module, name, None) is target and callable(getattr(module, name[:-1], None)):
                return Spelling(_SYNONYMS.get(name[:-1], name[:-1]), True, getattr(module, name[:-1]))
    return Spelling(_SYNONYMS.get(name, name), False, target)


def spelling(target) -> Spelling | None:
    """How ``target`` (a node's, as Dynamo records it) spells an op; ``None`` for a target that
    is no torch, ``torch.special``, ``torch.nn.functional`` or ``operator`` function or method."""
    try:
        return _spellings[target]
    except KeyError:
        pass
    except TypeError:  # an unhashable target
        return None
    found = _method(target) if isinstance(target, str) else _function(target)
    _spellings[target] = found
    return found


def op_key(target) -> str | None:
    """The canonical key of the op ``target`` spells (``"add"`` for all of ``add``'s spellings)."""
    found = spelling(target)
    return None if found is None else found.key


def facts_for(target) -> OpFacts | None:
    """The facts of the op ``target`` spells, whichever spelling; ``None`` if it has none."""
    found = spelling(target)
    return None if found is None else FACTS.get(found.key)
