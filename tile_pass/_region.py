"""The region IR: a row-wise program that runs on one tile of tokens, and its registry.

A region is the LM-head projection plus every node that uses its logits row by row
(:mod:`tile_pass._region_match` finds it, by the rules of :mod:`tile_pass._rules`). Its
nodes are copied out of the Dynamo graph into a :class:`RowProgram`: a list of
:class:`Step` records, each the node's own torch call with its token-shaped arguments
rewritten to a tile's layout (``[tile, V]`` rows, ``[tile, 1]`` or ``[tile]`` per-token
values). The tiled op (:mod:`tile_pass.tiled_region`) runs the program on each tile and
derives its gradient with ``make_fx``; no formula for any op is written here.

Custom ops cannot take a program as an argument, so programs are registered under a key
that is a hash of their content (:func:`register`): the same region compiled twice, or in
another process, gets the same key, and the op finds the program by it. This module is the
only one that builds, encodes or interprets programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


class Layout(str, enum.Enum):
    """A per-token value's layout in a tile (a ``str`` enum: code that names one by its text works).
    Programs hold the first three; the matcher also marks values reduced over the tokens and
    ``max(dim)``'s (values, indices) pairs."""

    ROWS = "rows"  # [tile, V]
    TOKENS1 = "tokens1"  # [tile, 1]
    TOKENS = "tokens"  # [tile]
    REDUCED = "reduced"
    TUPLE = "tuple"


def target_name(target) -> str:
    """An op's name whatever Dynamo recorded: a method's name, a function's ``__name__``."""
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def row_part(layout: Layout, vocab_size) -> tuple:
    """The dimensions after the token dimension of a value in ``layout``."""
    return {Layout.ROWS: (vocab_size,), Layout.TOKENS1: (1,), Layout.TOKENS: ()}[Layout(layout)]


class RefKind(enum.Enum):
    """``VALUE``: the output of step ``index - 1`` (0 is the projection); ``TOKEN``: a per-token
    input, sliced per tile; ``ROW``: an input every row shares (0-d or ``[V]``); in a reduction
    program, ``OUTPUT``: a region output, ``REDUCE``: one of its own inputs."""

    VALUE, TOKEN, ROW, OUTPUT, REDUCE = range(5)


@dataclass(frozen=True)
class Ref:
    """An operand of a step: the ``index``-th of its ``kind``."""

    kind: RefKind
    index: int


@dataclass(frozen=True)
class Step:
    """One node of the region, as the call to make on a tile."""

    op: str  # "call_function" or "call_method"
    target: Any
    args: tuple
    kwargs: tuple[tuple[str, Any], ...] = ()
    #: the autocast state the node ran under: (device type, dtype), or None
    autocast: tuple[str, torch.dtype] | None = None
    source: str = "?"  # the user's line, for reports

    def describe(self) -> str:
        """The step as the report shows it: its name, the numbers it applies (a soft-cap's
        ``div(30.0)``) and a loss's options, never its token operands."""
        name = _SHOWN_AS.get(target_name(self.target), target_name(self.target))
        if name in _LOSS_NAMES:
            options = dict(self.kwargs)
            shown = [f"ignore_index={options['ignore_index']}"] if "ignore_index" in options else []
            if options.get("label_smoothing"):
                shown.append(f"label_smoothing={options['label_smoothing']}")
            if "weight" in options:
                shown.append("class weights")
            if name != "kl_div" and isinstance(self.args[1], Ref) and self.args[1].kind is RefKind.ROW:
                shown.append("class probabilities")
            return f"{name}({', '.join(shown)})"
        numbers = [repr(a) for a in self.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if name in _VIEWS or not numbers:
            return f".{name}()" if self.op == "call_method" else name
        shown = f"{name}({', '.join(numbers)})"
        return f".{shown}" if self.op == "call_method" else shown


#: how the report names an op whatever way the user's code spelled it
_SHOWN_AS = {
    "truediv": "div", "true_divide": "div", "__truediv__": "div", "__mul__": "mul", "__rmul__": "mul",
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "rsub", "__neg__": "neg",
    "__pow__": "pow", "__rtruediv__": "rdiv",
}  # fmt: skip
_LOSS_NAMES = frozenset({"cross_entropy", "nll_loss", "kl_div"})
#: steps whose numbers are dimensions, not values applied to the logits
_VIEWS = frozenset({
    "reshape", "view", "flatten", "contiguous", "squeeze", "unsqueeze", "sum", "mean", "logsumexp", "amax",
    "amin", "argmax", "argmin", "max", "min", "softmax", "log_softmax", "gather",
})  # fmt: skip


@dataclass(frozen=True)
class Output:
    """A value of the program that leaves the tile loop."""

    value: int  # index of the value (0: the projection)
    layout: Layout  # ROWS, TOKENS1 or TOKENS
    dtype: torch.dtype
    differentiable: bool
    #: where the value is zero whatever the logits (see :func:`zero_where`): a token there
    #: needs no tile when every output is
    zeros: Zeros | None = None
    #: read only by the region's scalar loss: a token whose token weight is zero needs no tile
    only_loss: bool = False


class ZeroKind(enum.Enum):
    """What a per-token input is at a token where it makes a value zero: ``EQUALS`` a value (a cross
    entropy's ``ignore_index``), ``ZERO`` (a multiplying mask), ``FALSE`` (``where(mask, x, 0)``)
    or ``TRUE`` (``masked_fill(mask, 0)``)."""

    EQUALS, ZERO, FALSE, TRUE = range(4)


class Zeros:
    """Where a value is zero whatever the logits (:func:`zero_where`): a fact, or parts combined."""

    def tokens(self, token_inputs) -> tuple[torch.Tensor, bool]:
        """Where it holds, one flag per token, and whether it holds even for non-finite logits."""
        raise NotImplementedError


@dataclass(frozen=True)
class ZeroIf(Zeros):
    """A value is zero at a token where per-token input ``token`` is as ``kind`` says.
    ``exact``: zero even where the logits are not finite (a product with a zero mask is not)."""

    token: int
    kind: ZeroKind
    value: object = None
    exact: bool = True

    def tokens(self, token_inputs) -> tuple[torch.Tensor, bool]:
        t = token_inputs[self.token]
        t = t.reshape(t.shape[0], -1)[:, 0]
        if self.kind is ZeroKind.EQUALS:
            return t == self.value, self.exact
        if self.kind is ZeroKind.ZERO:
            return t == 0, self.exact
        return (~t.bool() if self.kind is ZeroKind.FALSE else t.bool()), self.exact


@dataclass(frozen=True)
class _ZeroParts(Zeros):
    """Parts whose flags ``_combine`` joins; exact where every part is."""

    parts: tuple[Zeros, ...]

    def __post_init__(self):
        if len(self.parts) < 2 or not all(isinstance(p, Zeros) for p in self.parts):
            raise ValueError(f"{type(self).__name__} needs two or more Zeros parts, not {self.parts!r}")

    def tokens(self, token_inputs) -> tuple[torch.Tensor, bool]:
        flags, exact = zip(*(part.tokens(token_inputs) for part in self.parts), strict=True)
        return functools.reduce(self._combine, flags), all(exact)


@dataclass(frozen=True)
class ZeroAny(_ZeroParts):
    """Zero where any part is (a product)."""

    _combine = staticmethod(operator.or_)


@dataclass(frozen=True)
class ZeroAll(_ZeroParts):
    """Zero where every part is (a sum)."""

    _combine = staticmethod(operator.and_)


#: op name (:func:`target_name`) -> ``rule(step, of, token)``: where the step's value is zero, from
#: ``of(arg)`` (an operand's :class:`Zeros` or ``None``) and ``token(arg)`` (a per-token input?)
ZERO_RULES: dict[str, Callable[..., Zeros | None]] = {}


def register_zero_rule(*names: str):
    """Make the decorated function the zero rule of each op in ``names``, as :mod:`_rules` does."""

    def register(rule):
        if taken := ZERO_RULES.keys() & set(names):
            raise ValueError(f"{sorted(taken)} already have a zero rule")
        ZERO_RULES.update(dict.fromkeys(names, rule))
        return rule

    return register


def _number(arg) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _either(*parts) -> Zeros | None:
    parts = tuple(p for p in parts if p is not None)
    return None if not parts else parts[0] if len(parts) == 1 else ZeroAny(parts)


def zero_where(step: Step, zeros_of: dict[int, Zeros | None], per_token: frozenset[int]) -> Zeros | None:
    """Where a step's value is zero whatever the logits (``None``: nowhere known), by its op's rule,
    from its operands' (``zeros_of``, by value index) and the per-token inputs (``per_token``)."""
    rule = ZERO_RULES.get(target_name(step.target))

    def of(arg):
        return zeros_of.get(arg.index) if isinstance(arg, Ref) and arg.kind is RefKind.VALUE else None

    def token(arg) -> bool:
        return isinstance(arg, Ref) and arg.kind is RefKind.TOKEN and arg.index in per_token

    return rule(step, of, token) if rule is not None else None


@register_zero_rule("cross_entropy", "nll_loss")
def _ignored_label(step, of, token):
    """A loss is zero, and its gradient too, at a token whose label is ``ignore_index``."""
    kwargs = dict(step.kwargs)
    target = step.args[1] if len(step.args) > 1 else kwargs.get("target")
    return ZeroIf(target.index, ZeroKind.EQUALS, kwargs.get("ignore_index", -100)) if token(target) else None


@register_zero_rule("mul", "__mul__", "__rmul__", "mul_")
def _product(step, of, token):
    """Zero where a factor is; a per-token factor where it is 0, but not for ``inf`` logits (0 * inf)."""
    factors = [ZeroIf(a.index, ZeroKind.ZERO, exact=False) if token(a) else of(a) for a in step.args]
    return _either(*factors) if len(factors) == 2 else None


@register_zero_rule("truediv", "div", "__truediv__")
def _divide(step, of, token):
    """Zero where the dividend is, divided by a nonzero number."""
    return of(step.args[0]) if len(step.args) == 2 and _number(step.args[1]) and step.args[1] != 0 else None


@register_zero_rule("pow", "__pow__")
def _power(step, of, token):
    """Zero where the base is, to a positive power (``0 ** 0`` is 1)."""
    return of(step.args[0]) if len(step.args) == 2 and _number(step.args[1]) and step.args[1] > 0 else None


@register_zero_rule("add", "sub", "__add__", "__sub__", "__radd__", "__rsub__", "add_", "sub_", "rsub")
def _sum(step, of, token):
    """Zero where both terms are."""
    a, b = (of(arg) for arg in step.args) if len(step.args) == 2 else (None, None)
    return None if a is None or b is None else ZeroAll((a, b))


@register_zero_rule("where")
def _where(step, of, token):
    """``where(mask, x, 0)`` is zero where the mask is false or ``x`` is; ``where(mask, 0, y)``: true."""
    if len(step.args) != 3 or not token(step.args[0]):
        return None
    cond, x, y = step.args
    if _number(y) and y == 0:
        return _either(ZeroIf(cond.index, ZeroKind.FALSE), of(x))
    return _either(ZeroIf(cond.index, ZeroKind.TRUE), of(y)) if _number(x) and x == 0 else None


@register_zero_rule("masked_fill", "masked_fill_")
def _masked_fill(step, of, token):
    """``masked_fill(mask, 0)`` is zero where the mask is true or the input is zero."""
    args = step.args
    if len(args) >= 3 and token(args[1]) and _number(args[2]) and args[2] == 0:
        return _either(ZeroIf(args[1].index, ZeroKind.TRUE), of(args[0]))
    return None


@register_zero_rule("neg", "abs", "detach", "float", "double", "half", "bfloat16", "to", "type", "reshape",
                    "view", "squeeze", "unsqueeze", "contiguous", "flatten", "sum", "gather", "relu", "tanh",
                    "sign", "square", "sqrt")  # fmt: skip
def _keeps_zeros(step, of, token):
    """``f(0) == 0``: zero where the (first) operand is."""
    return of(step.args[0]) if step.args else None


@dataclass(frozen=True)
class ReductionProgram:
    """The token reductions from the region's per-token outputs to one scalar loss, when they
    are linear in those outputs (sums, means, products with tensors that need no gradient):
    then the loss's gradient with respect to each output does not depend on the outputs, so
    the tiles form the whole gradient in forward, at unit upstream gradient."""

    steps: tuple[Step, ...]  # its inputs: the region's outputs, flat, and its own ("reduce")
    result: int  # the value index of the scalar loss
    dtype: torch.dtype  # the loss's


@dataclass(frozen=True)
class RowProgram:
    """A region's row-wise subgraph, ready to run on one tile of tokens."""

    steps: tuple[Step, ...]
    outputs: tuple[Output, ...]
    vocab_size: int
    #: per token input: its layout in the tile (``rows`` for a teacher's logits, ...)
    token_layouts: tuple[Layout, ...]
    has_bias: bool
    #: per token input that indexes the vocabulary: (input, how eager reports a bad index,
    #: ignore_index or None), checked before the tiles on CPU
    index_checks: tuple[tuple[int, str, int | None], ...] = ()
    reduction: ReductionProgram | None = None
    #: a vocabulary-sharded head: (process group name, this rank's first row, the whole
    #: vocabulary); ``vocab_size`` is then this rank's rows
    shard: tuple[str, int, int] | None = None
    form: str = ""
    key: str = field(default="", compare=False)


# ---------------------------------------------------------------------------- interpreter


def _resolve(arg, env: dict):
    if isinstance(arg, Ref):
        return env[arg]
    if isinstance(arg, (tuple, list)):
        return type(arg)(_resolve(a, env) for a in arg)
    return arg


def _autocast(state: tuple[str, torch.dtype] | None, device_type: str):
    """The autocast state a step ran under, or autocast off (tiles run outside it)."""
    if state is None:
        return (
            torch.autocast(device_type, enabled=False)
            if _autocast_known(device_type)
            else contextlib.nullcontext()
        )
    return torch.autocast(state[0], dtype=state[1])


def _autocast_known(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False
    return True


def run_steps(steps, env: dict, first_value: int, device_type: str) -> dict:
    """Run ``steps`` on the values in ``env``; step ``i`` writes value ``first_value + i``."""
    for i, step in enumerate(steps):
        args = _resolve(step.args, env)
        kwargs = {name: _resolve(value, env) for name, value in step.kwargs}
        with _autocast(step.autocast, device_type):
            if step.op == "call_method":
                result = getattr(args[0], step.target)(*args[1:], **kwargs)
            else:
                result = step.target(*args, **kwargs)
        env[Ref(RefKind.VALUE, first_value + i)] = result
    return env


def run_program(
    program: RowProgram,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_inputs,
    row_inputs,
) -> list[torch.Tensor]:
    """The program's outputs for the tokens of ``hidden`` (a tile, or all of them, flat)."""
    env: dict = {Ref(RefKind.VALUE, 0): F.linear(hidden, weight, bias)}
    env.update((Ref(RefKind.TOKEN, i), t) for i, t in enumerate(token_inputs))
    env.update((Ref(RefKind.ROW, i), t) for i, t in enumerate(row_inputs))
    run_steps(program.steps, env, 1, hidden.device.type)
    return [env[Ref(RefKind.VALUE, out.value)] for out in program.outputs]


def run_reduction(reduction: ReductionProgram, outputs, reduce_inputs, device_type: str) -> torch.Tensor:
    """The scalar loss from the region's full per-token outputs (flat, as the tiles give them)."""
    env: dict = {Ref(RefKind.OUTPUT, i): out for i, out in enumerate(outputs)}
    env.update((Ref(RefKind.REDUCE, i), t) for i, t in enumerate(reduce_inputs))
    run_steps(reduction.steps, env, 0, device_type)
    return env[Ref(RefKind.VALUE, reduction.result)]


def dispatch_as_caller():
    """Autograd and autocast as the caller has them, inside a custom op's implementation
    (which runs with both excluded): for the reduction program, which is small, is run eagerly
    on whole per-token tensors, and is differentiated there once per call."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _CALLER_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_CALLER_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.ADInplaceOrView,
    torch._C.DispatchKey.AutocastCPU,
    torch._C.DispatchKey.AutocastCUDA,
)


# ------------------------------------------------------------------------------ registry

_programs: dict[str, RowProgram] = {}
_lock = threading.Lock()


def _canonical(obj) -> str:
    """A text form of a program that is the same in every process (no ids, no addresses): an
    enum member by its class and name (``Layout.ROWS``), never by ``enum.auto()``'s number."""
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__name__}.{obj.name}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f for f in obj.__dataclass_fields__ if f not in ("key", "source", "form")]
        return f"{type(obj).__name__}(" + ",".join(_canonical(getattr(obj, f)) for f in fields) + ")"
    if isinstance(obj, (tuple, list)):
        return "(" + ",".join(_canonical(o) for o in obj) + ")"
    if callable(obj) and not isinstance(obj, torch.dtype):
        return (
            f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', obj))}"
        )
    if isinstance(obj, float):
        return obj.hex()
    return repr(obj)


def register(program: RowProgram) -> RowProgram:
    """Register ``program``; returns it with its key (a hash of its content) filled in."""
    key = "rowprog-" + hashlib.sha256(_canonical(program).encode()).hexdigest()[:24]
    keyed = RowProgram(**{**program.__dict__, "key": key})
    with _lock:
        _programs.setdefault(key, keyed)
    return _programs[key]


def lookup(key: str) -> RowProgram:
    try:
        return _programs[key]
    except KeyError:
        raise RuntimeError(
            f"tile_pass: row program {key!r} is not registered in this process. It is registered when "
            "tile_pass rewrites the graph; a compiled artifact loaded without that rewrite (an AOT "
            "package) cannot run it. Compile with backend='tile_pass' in this process."
        ) from None
