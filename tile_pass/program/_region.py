"""The region IR: a row-wise program that runs on one tile of tokens, and its registry.

A region is the LM-head projection plus every node that uses its logits row by row
(:mod:`tile_pass.match._region_match` finds it, by the rules of :mod:`tile_pass.match._rules`). Its
nodes are copied out of the Dynamo graph into a :class:`RowProgram`: a list of
:class:`Step` records, each the node's own torch call with its token-shaped arguments
rewritten to a tile's layout (``[tile, V]`` rows, ``[tile, 1]`` or ``[tile]`` per-token
values). The tiled op (:mod:`tile_pass.tiles.tiled_region`) runs the program on each tile and
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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tile_pass._caches import BoundedCache
from tile_pass.program._op_facts import RuleKind, facts_for


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
        facts = facts_for(self.target)
        name = facts.shown if facts is not None else target_name(self.target)
        if facts is not None and facts.kind is RuleKind.LOSS:
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
        if (facts is not None and not facts.shows_numbers) or not numbers:
            return f".{name}()" if self.op == "call_method" else name
        shown = f"{name}({', '.join(numbers)})"
        return f".{shown}" if self.op == "call_method" else shown


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
        if t.dim() != 1:
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


def zero_where(step: Step, zeros_of: dict[int, Zeros | None], per_token: frozenset[int]) -> Zeros | None:
    """Where a step's value is zero whatever the logits (``None``: nowhere known), by its op's
    ``zeros`` fact (``tile_pass.match._zero_rules``), from its operands' (``zeros_of``, by value index) and
    the per-token inputs (``per_token``)."""
    facts = facts_for(step.target)
    if facts is None or facts.zeros is None:
        return None

    def of(arg):
        return zeros_of.get(arg.index) if isinstance(arg, Ref) and arg.kind is RefKind.VALUE else None

    def token(arg) -> bool:
        return isinstance(arg, Ref) and arg.kind is RefKind.TOKEN and arg.index in per_token

    return facts.zeros(step, of, token)


@dataclass(frozen=True)
class ReductionProgram:
    """The token reductions from the region's per-token outputs to one scalar loss. When they
    are ``linear`` in those outputs (sums, means, products with tensors that need no gradient),
    the loss's gradient with respect to each output does not depend on the outputs: the tiles
    form the whole gradient in forward from token weights derived once. Otherwise that gradient
    is evaluated at the outputs (:mod:`tile_pass.program._token_groups` says which tokens a tile
    must hold together for it to be known in the tile)."""

    steps: tuple[Step, ...]  # its inputs: the region's outputs, flat, and its own ("reduce")
    result: int  # the value index of the scalar loss
    dtype: torch.dtype  # the loss's
    linear: bool = True


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
    #: the bias is added after the matmul (``x @ W.t() + b``), not inside ``F.linear``: the
    #: product is rounded to the logits' dtype before the add, as eager rounds it (in half
    #: precision one rounding less moves every soft-capped loss off eager's, issue 48)
    bias_added: bool = False


# ---------------------------------------------------------------------------- interpreter


def _resolve(arg, env: dict):
    if isinstance(arg, Ref):
        return env[arg]
    if isinstance(arg, (tuple, list)):
        resolved = (_resolve(a, env) for a in arg)
        return (
            type(arg)(*resolved) if hasattr(arg, "_fields") else type(arg)(resolved)
        )  # a named tuple's fields
    return arg


def _autocast(state: tuple[str, torch.dtype] | None, device_type: str):
    """The autocast state a step ran under, or autocast off (tiles run outside it). Where it is
    off already no context is entered: the reduction runs each call, and entering one costs
    about as much as a small op."""
    if state is not None:
        return torch.autocast(state[0], dtype=state[1])
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        return _NO_CONTEXT
    return torch.autocast(device_type, enabled=False) if enabled else _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()


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
    if program.bias_added and bias is not None:
        product = F.linear(hidden, weight)
        # a half-precision bias comes upcast (tiled_region): the sum rounds as eager's add does
        # (exactly, in float32, then to the product's dtype), and its gradient is summed over the
        # tile's tokens in float32, as eager's is over all tokens, not rounded once per tile
        logits = (product + bias).to(product.dtype)
    else:
        logits = F.linear(hidden, weight, bias)
    env: dict = {Ref(RefKind.VALUE, 0): logits}
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

#: Programs kept at once beyond those a compiled graph holds: a program is found by its key as
#: long as a graph that calls it is alive (it holds the program, see :func:`hold`), so only a
#: program no live graph calls can be evicted, and the first of its region's calls is far behind.
PROGRAM_CACHE_SIZE = 1024
_programs = BoundedCache("row programs", PROGRAM_CACHE_SIZE, find_while_referenced=True)


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
    return _programs.setdefault(key, RowProgram(**{**program.__dict__, "key": key}))


def lookup(key: str) -> RowProgram:
    """The program registered under ``key``."""
    if key in _programs:  # a plain read first: Dynamo traces it where the functional API is compiled
        return _programs[key]
    program = _programs.get(key)  # evicted, or still held by a graph
    if program is None:
        raise RuntimeError(
            f"tile_pass: row program {key!r} is not registered in this process. It is registered when "
            "tile_pass rewrites the graph; a compiled artifact loaded without that rewrite (an AOT "
            "package) cannot run it. Compile with backend='tile_pass' in this process."
        )
    return program
