"""Find a row-wise region in a Dynamo graph and rewrite it into one tiled op.

A region is an LM-head projection plus every node that uses its logits row by row, with
as many outputs as the user's code takes from it. The matcher runs in phases:

1. **the projection** (:func:`tile_pass.match._fx.as_linear`): ``F.linear``/``x @ W.T`` with a 2-D
   weight, its autocast dtype;
2. **the row-wise subgraph** (:meth:`RegionMatcher.walk`): every node that depends on the logits
   is classified, in graph order, by the rule registered for its op (:mod:`tile_pass.match._rules`); a
   node joins the region when its rule proves it row-wise and every logits-dependent operand is
   already in the region, and leaves one :class:`RegionValue` of all that was proved about it;
3. **the outputs** (:meth:`RegionMatcher.collect_outputs`): region values read outside it.
   Per-token values (losses, log-probs, log-sum-exps, ``argmax``) leave the tiles flat; a token
   reduction folded into an op (a mean cross entropy) is finished after them; rows (``[N, V]``)
   may only be returned, and are written tile by tile, with a gradient path replayed if the
   caller uses it;
4. **the scalar loss** (:meth:`RegionMatcher.scalar_loss`): when the differentiable outputs
   reach exactly one scalar through token reductions linear in them, those nodes join the op,
   which then forms the whole gradient in forward (:mod:`tile_pass.tiles.tiled_region`);
5. **the rewrite** (:func:`tile_pass.splice._splice.rewrite_row_region`): one call to
   :func:`tile_pass.tiles.tiled_region.run_region`.

Anything unproven raises :class:`~tile_pass.match._fx.NoMatch` with the op and the line that
stopped the region, and the graph is left as it was.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass._logging import log
from tile_pass.match import _fx, _rules
from tile_pass.match._fx import (
    NoMatch,
    as_linear,
    describe,
    leading_index,
    projection_of,
    same,
    same_shape,
    val,
)
from tile_pass.match._op_facts import FACTS, Linear, Selects, facts_for, spelling
from tile_pass.match._rules import PREVIOUS_STEP, AfterTiles, Classified, RuleKind, Shape
from tile_pass.program import _region
from tile_pass.program._operands import RegionOperands
from tile_pass.program._region import (
    Layout,
    Output,
    ReductionProgram,
    Ref,
    RefKind,
    RowProgram,
    Step,
    target_name,
)
from tile_pass.program._token_layout import after_tiles, restore, select
from tile_pass.report import source_line

_PER_TOKEN = (Layout.TOKENS, Layout.TOKENS1)
_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


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
    #: read with a selection of the token rows (``logits[:B]``): the selection's index over the
    #: hidden states' token dims; the input covers those rows only and is spread over all of them
    subset: tuple | None = None
    #: the region differentiates it (it requires grad where a node that needs a gradient reads it)
    differentiable: bool = False


@dataclass
class SharedInput:
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
    subset: tuple | None = None  # computed on a selection of the token rows: its index


@dataclass
class RowRegion:
    """One matched region: the record the rewrite reads (named fields, no positions)."""

    projection: torch.fx.Node
    #: the op's operands: the head's nodes, ``tokens`` (:class:`TokenInput`), ``shared``
    #: (:class:`SharedInput`) and ``reduce`` (the scalar loss's own input nodes)
    operands: RegionOperands
    autocast_dtype: torch.dtype | None
    nodes: list[torch.fx.Node]
    outputs: list[RegionOutput]
    program: RowProgram
    reduction_nodes: list[torch.fx.Node] = field(default_factory=list)  # joined the op (phase 4)
    sink: torch.fx.Node | None = None  # the scalar loss they end in
    steps_text: list[str] = field(default_factory=list)
    dropped: list[torch.fx.Node] = field(default_factory=list)  # returned rows replaced by a placeholder
    kept_whole: list[torch.fx.Node] = field(default_factory=list)  # returned rows before a token slice
    slices: list[tuple] = field(default_factory=list)  # token selections applied to the hidden states
    num_tokens: object = 0  # the tokens the tiles run (after the slices)

    @property
    def hidden(self) -> torch.fx.Node:
        return self.operands.hidden

    @property
    def weight(self) -> torch.fx.Node:
        return self.operands.weight

    @property
    def bias(self) -> torch.fx.Node | None:
        return self.operands.bias


# ------------------------------------------------------------------------------ helpers


def _autocast_states(graph: torch.fx.Graph) -> dict[torch.fx.Node, tuple]:
    """Per node, the autocast contexts Dynamo recorded around it, innermost last."""
    states, stack = {}, []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _ENTER_AUTOCAST:
            stack.append((node, tuple(node.args[:3])))
        elif node.op == "call_function" and node.target is _EXIT_AUTOCAST and stack:
            stack.pop()
        states[node] = tuple(s for _, s in stack)
    return states


def _index_text(index: tuple) -> str:
    """``[:4]``, ``[:, :-1]``: a row selection as the user wrote it."""

    def one(i):
        if not isinstance(i, slice):
            return repr(i)
        text = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
        return text + (f":{i.step}" if i.step is not None else "")

    explicit = list(index[:-1])
    while explicit and explicit[-1] == slice(None):
        explicit.pop()
    return "[" + ", ".join(one(i) for i in explicit) + "]"


def _descendants(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _projection_like(node: torch.fx.Node) -> bool:
    """A linear layer or matmul: where the logits' cone stops (a later layer's inputs)."""
    try:
        return as_linear(node) is not None
    except NoMatch:
        return True


# ------------------------------------------------------------------------------ matcher


def describe_output(output: RegionOutput) -> str:
    """``lse [tokens]`` and the like, for reports."""
    what = "rows" if output.shape.layout is Layout.ROWS else "per token"
    if output.after_tiles is not None:
        what = f"token {output.after_tiles.how.value}"
    return f"{output.node.name} ({what}{', differentiable' if output.differentiable else ''})"


def _vocab_shard(hidden, weight, out) -> tuple[str, int, int]:
    """``(group name, first row, rows)`` of this rank's piece of a vocabulary-sharded head
    (torchtitan's ``ColwiseParallel(output_layouts=Shard(-1))``); ``NoMatch`` otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    from tile_pass._distributed import shard_rows

    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise NoMatch(
            "the DTensor LM head is not sharded over the vocabulary (Shard(0)) on a 1-D tensor-parallel mesh"
        )
    if tuple(getattr(hidden, "placements", ())) != (Replicate(),) or hidden.device_mesh != mesh:
        raise NoMatch("the hidden states of the vocabulary-sharded head are not replicated over its mesh")
    if tuple(getattr(out, "placements", ())) not in ((Shard(out.dim() - 1),), (Shard(-1),)):
        raise NoMatch("the vocabulary-sharded head's logits are not sharded over the vocabulary")
    start, rows = shard_rows(int(weight.shape[0]), mesh.size(), mesh.get_local_rank())
    return mesh.get_group().group_name, start, rows


def _no_op_redistribute(node: torch.fx.Node) -> bool:
    """``x.redistribute(...)`` of a DTensor that keeps its mesh and placements (ColwiseParallel's
    output hook with ``Shard(-1)`` kept)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op not in ("call_method", "call_function") or name not in ("redistribute", "prim_redistribute"):
        return False  # torch 2.11's Dynamo records the call as the function ``prim_redistribute``
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    out, inp = val(node), val(node.args[0])
    placements = [getattr(v, "placements", None) for v in (out, inp)]
    meshes = [getattr(v, "device_mesh", None) for v in (out, inp)]
    return placements[0] is not None and placements[0] == placements[1] and meshes[0] == meshes[1]


def _shard_program_steps(matcher) -> list[Step]:
    """The region's steps on this rank's ``[tile, V_r]`` logits: each step over the vocabulary
    in its group-wide form (``tile_pass._distributed.shard_step``), reshapes of rows to the
    shard's width; ``NoMatch`` naming what has no sharded form."""
    from tile_pass._distributed import shard_elementwise, shard_step

    group_name, start, rows = matcher.shard
    if matcher.autocast_dtype is not None:
        raise NoMatch("autocast around a vocabulary-sharded head is not tiled in tensor-parallel form yet")
    if matcher.bias is not None:
        raise NoMatch("a vocabulary-sharded head with a bias is not tiled in tensor-parallel form yet")
    # a partner head sharded alike projects this rank's rows of its own weight from its hidden states
    theirs = {id(operand) for operand in matcher.partner_inputs}
    for token_input in matcher.token_inputs:
        if token_input.part not in ((), (1,)) and id(token_input) not in theirs:  # a label, an index, a mask
            raise NoMatch("a [tokens, V] operand (a teacher's logits) is not sharded with the head yet")
    if any(not row.zero_dim and id(row) not in theirs for row in matcher.row_inputs):
        raise NoMatch("a [V] operand of the logits is not sharded with the head yet")
    steps = []

    def layout(arg) -> Layout | None:  # of a value the step reads
        is_value = isinstance(arg, Ref) and arg.kind is RefKind.VALUE
        return matcher.program[arg.index].shape.layout if is_value else None

    for value in matcher.program[1:]:
        step = value.step
        reads_rows = bool(step.args) and layout(step.args[0]) is Layout.ROWS
        if reads_rows and value.kind.over_vocab:
            sharded = shard_step(step, group_name, start, int(matcher.vocab))
            if sharded is None:
                raise NoMatch("{} ({}) has no tensor-parallel form yet", step.describe(), step.source)
            step = sharded
        elif reads_rows and step.target == "reshape" and value.shape.layout is Layout.ROWS:
            step = replace(step, args=(*step.args[:-1], rows))
        elif value.shape.layout is Layout.ROWS:  # an elementwise step of the rows
            replicated = tuple(i for i, a in enumerate(step.args) if layout(a) in _PER_TOKEN)
            if any(isinstance(v, Ref) and v.kind is RefKind.VALUE for _, v in step.kwargs):
                raise NoMatch("{} ({}) takes a computed value by keyword", step.describe(), step.source)
            if replicated:
                args = (step.target, step.op, replicated, group_name, *step.args)
                step = replace(step, op="call_function", target=shard_elementwise, args=args)
        steps.append(step)
    return steps


class RegionMatcher:
    """Phases 2-4 for one projection (see the module docstring); the rules
    (:mod:`tile_pass.match._rules`) read its values and add its operands through the methods below."""

    def __init__(
        self, graph: torch.fx.Graph, projection: torch.fx.Node, linear, autocast_states, drop_rows: bool,
        select_rows: bool = False, excluded=(),
    ):  # fmt: skip
        self.graph, self.projection, self.autocast_states = graph, projection, autocast_states
        self.hidden, self.weight, self.bias, self.transpose, self.head_form = linear
        self.bias_added = False  # the bias is an add after the matmul (bias_after), not F.linear's
        self.drop_rows = drop_rows
        self.select_rows = select_rows  # the second pass: row selections stay selections of the tiles' rows
        self.excluded = set(excluded)  # partner heads whose logits no region value combines
        hidden_val, weight_val, out_val = val(self.hidden), val(self.weight), val(projection)
        if hidden_val is None or weight_val is None or out_val is None or weight_val.dim() != 2:
            raise NoMatch("the projection's inputs carry no shape information")
        self.shard = None  # (group name, first row, rows) of a vocabulary-sharded head
        if any(hasattr(v, "placements") for v in (hidden_val, weight_val, out_val)):
            self.shard = _vocab_shard(hidden_val, weight_val, out_val)
        elif isinstance(self.weight, torch.fx.Node):  # given explicitly (the functional API)
            from tile_pass._distributed import VOCAB_SHARD_META

            self.shard = self.weight.meta.get(VOCAB_SHARD_META)
        self.vocab, hidden_size = weight_val.shape
        if not same(hidden_val.shape[-1], hidden_size) or not same(out_val.shape[-1], self.vocab):
            raise NoMatch("the hidden states do not match the LM-head weight")
        if not out_val.is_floating_point():
            raise NoMatch("the logits are not floating point")
        self.device_type = out_val.device.type
        # the autocast state the graph is compiled under (AOTAutograd traces it under this too)
        ambient_dtype = _fx.autocast_dtype(self.device_type)
        self.ambient = None if ambient_dtype is None else (self.device_type, ambient_dtype)
        self.hidden_tokens = tuple(hidden_val.shape[:-1])
        self.num_tokens = math.prod(self.hidden_tokens)
        self.autocast_dtype = self._autocast_dtype(hidden_val, weight_val, out_val)
        logits = ProgramValue(0, None, Shape(Layout.ROWS, self.hidden_tokens))
        self.program: list[ProgramValue] = [logits]  # value i is program[i]; the steps after it: the program
        self.values: dict[torch.fx.Node, RegionValue] = {projection: RegionValue(logits, logits.shape)}
        self.outside: dict[torch.fx.Node, NoMatch] = {}  # node that depends on the logits -> why not row-wise
        self.token_inputs: list[TokenInput] = []
        self.row_inputs: list[SharedInput] = []
        self.index_checks: list[tuple] = []
        self.head_signs = False
        #: returned rows: not computed (drop_logits=True); before a token slice, left to the graph whole
        self.dropped: list[torch.fx.Node] = []
        self.kept_whole: list[torch.fx.Node] = []
        self.slices: list[tuple] = []  # token selections moved onto the hidden states, in order
        self.slice_steps: list[int] = []  # per slice, the first program value after it
        #: other heads' projections whose tiles the region computes -> their transpose, if only theirs
        self.partners: dict[torch.fx.Node, torch.fx.Node | None] = {}
        self.partner_inputs: list = []  # the partner heads' hidden states, weights and biases
        self.selections: list[tuple[tuple, tuple]] = []  # (index, the selected token dims)
        self.selection: int | None = None  # the selection of the node being classified
        self.saw_selection = False  # a chunk/split/narrow of the rows: the second pass may take it

    def _autocast_dtype(self, hidden_val, weight_val, out_val) -> torch.dtype | None:
        """The autocast dtype the projection runs in (``None``: its inputs' own)."""
        dtypes = {v.dtype for v in (hidden_val, weight_val, val(self.bias)) if v is not None}
        if dtypes == {out_val.dtype}:
            return None
        if out_val.dtype not in (torch.bfloat16, torch.float16):
            raise NoMatch("the linear's output dtype {} does not follow from its inputs", out_val.dtype)
        # only autocast makes mixed inputs a half output; without it eager raises ("expected m1 and m2
        # to have the same dtype"), and so does the graph left as it is (the fake run does not check)
        state = self.step(self.projection, None, ()).autocast  # the node's autocast context, as a step's
        if state is None or state[1] != out_val.dtype:
            raise NoMatch("{} mixes dtypes {} outside autocast; eager raises on it (left to raise)",
                          self.projection, sorted(str(d)[6:] for d in dtypes))  # fmt: skip
        return out_val.dtype

    # ---------------------------------------------------------------- operands

    def flat_tokens(self, tokens: tuple) -> bool:
        """Whether a token shape is the flattened [N] (else it must be the hidden states', or
        those of the row selection being classified)."""
        grid = self.hidden_tokens if self.selection is None else self.selections[self.selection][1]
        if same_shape(tokens, grid):
            return False
        if len(tokens) == 1 and same(tokens[0], math.prod(grid)):
            return True
        raise NoMatch("the logits' token dimensions are regrouped into {}", tuple(tokens))

    def shape_of(self, arg) -> Shape | None:
        """The shape of a region value; None for anything else."""
        return self.values[arg].shape if isinstance(arg, torch.fx.Node) and arg in self.values else None

    def value_ref(self, arg: torch.fx.Node) -> Ref:
        return Ref(RefKind.VALUE, self.values[arg].value.index)

    def _join(self, node: torch.fx.Node, value: ProgramValue, shape: Shape, **facts) -> None:
        """``node`` joins the region as ``value`` (its record: see :class:`RegionValue`)."""
        self.values[node] = RegionValue(value, shape, sliced=len(self.slices), **facts)

    def _before_slice(self, node: torch.fx.Node) -> bool:
        """Whether the region value ``node`` was computed before the logits' last token slice."""
        return node in self.values and self.values[node].sliced < len(self.slices)

    def operand(self, arg, out: Shape, node: torch.fx.Node):
        """A step's argument: a region value, a per-token or shared input, or a constant."""
        if isinstance(arg, (tuple, list)):
            return type(arg)(self.operand(a, out, node) for a in arg)
        if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NoMatch("{} uses a dynamic scalar; keep it a Python constant", node)
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg in self.values:
            if self.values[arg].shape.layout is Layout.REDUCED:
                raise NoMatch("{} reads a value reduced over the tokens", node)
            return self.value_ref(arg)
        if arg in self.depends:
            raise NoMatch("{} combines the logits with {}, which is not row-wise", node, arg)
        value = arg.meta.get("example_value", arg.meta.get("val"))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NoMatch("{} uses a dynamic scalar; keep it a Python constant", node)
        if not isinstance(value, torch.Tensor):
            raise NoMatch("{} takes {}, which is not a tensor", node, arg)
        return self.side_input(arg, value, out, node)

    def side_input(self, arg, value: torch.Tensor, out: Shape, node) -> Ref:
        if value.requires_grad and self.shard is not None and getattr(val(node), "requires_grad", True):
            raise NoMatch("{} uses {}, which requires grad; a learnable tensor is not tiled in "
                          "tensor-parallel form yet", node, arg)  # fmt: skip
        out_part = _region.row_part(out.layout, self.vocab)
        out_shape = (*out.tokens, *out_part)
        if value.dim() > len(out_shape):
            raise NoMatch("{} broadcasts the logits up with {}", node, arg)
        padded = (1,) * (len(out_shape) - value.dim()) + tuple(value.shape)
        tokens, part = padded[: len(out.tokens)], padded[len(out.tokens) :]
        per_token = all(same(s, t) for s, t in zip(tokens, out.tokens, strict=True))
        differentiable = value.requires_grad and bool(getattr(val(node), "requires_grad", False))
        # no token dimensions of its own ([V] class weights, a 0-d scale): shared by every row, also
        # when a batch of one token makes its broadcast shape look per-token
        if value.dim() <= len(out_part) or (not per_token and all(same(s, 1) for s in tokens)):
            row = SharedInput(arg, value.dim() == 0, differentiable=differentiable)  # equal: of the same node
            if row not in self.row_inputs:
                self.row_inputs.append(row)
            return Ref(RefKind.SHARED, self.row_inputs.index(row))
        if not all(same(s, 1) or same(s, t) for s, t in zip(tokens, out.tokens, strict=True)):
            raise NoMatch("{} combines the logits with {} of shape {}, which is not one value per token",
                          node, arg, tuple(value.shape))  # fmt: skip
        if not per_token and part and not same(part[0], 1):
            raise NoMatch("{} broadcasts {} over tokens into [N, V] rows", node, arg)
        part = tuple(1 if same(p, 1) else self.vocab for p in part)
        subset = None if self.selection is None else self.selections[self.selection][0]
        entry = TokenInput(arg, part, self.flat_tokens(out.tokens), subset, differentiable)
        if entry not in self.token_inputs:  # dataclass equality: the same node, part and token dims
            self.token_inputs.append(entry)
        return Ref(RefKind.TOKEN, self.token_inputs.index(entry))

    # ---------------------------------------------------------------- rules

    def step(self, node, target, args, kwargs=(), op="call_function") -> Step:
        state = self.ambient  # unless an autocast context around the node sets this device's
        for context_device, dtype, enabled in reversed(self.autocast_states.get(node, ())):
            if context_device == self.device_type:
                state = (self.device_type, dtype) if enabled else None
                break
        return Step(op, target, tuple(args), tuple(kwargs), state, source_line(node))

    def token_slice(self, node: torch.fx.Node) -> bool:
        """``logits[:, :-1, :]``, ``logits[..., -k:, :]``: a selection of token rows of the logits
        before any regrouping, moved onto the hidden states (the tiles then run only those rows,
        and every value before it is computed on them too, being row-wise). Values computed
        before the slice may then be read only on the way to it."""
        source = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
        shape = self.shape_of(source)
        if shape is None or shape.layout is not Layout.ROWS:
            return False
        self.saw_selection = True  # if it cannot move onto the hidden states, a selection (second pass)
        if self._before_slice(source):
            raise NoMatch("{} slices the logits' token rows a second way", node)
        index = leading_index(node, len(shape.tokens) + 1)
        if index is None:
            raise NoMatch("{} indexes the logits by something other than token rows", node)
        if not same_shape(shape.tokens, self.hidden_tokens):
            raise NoMatch("{} slices token rows that were regrouped; slice before reshaping", node)
        if self.token_inputs:
            raise NoMatch("{} slices the token rows after a per-token value was combined with them; slice "
                          "the logits first", node)  # fmt: skip
        tokens = tuple(val(node).shape[:-1])
        self.slices.append(index)
        self.slice_steps.append(len(self.program))  # the first value after it (the report shows it there)
        self.hidden_tokens, self.num_tokens = tokens, math.prod(tokens)
        self._join(node, self.values[source].value, Shape(Layout.ROWS, tokens))
        return True

    def row_selection(self, node: torch.fx.Node) -> bool:
        """``logits[:B]``, ``logits[B:]``, ``logits[:, :-1]`` read beside all rows (the second
        matching pass): the tiles compute every row, and what is computed from the selection is
        a value of its rows alone. Per-token operands of those rows are spread over all rows
        (:func:`_spread`), and outputs are selected back after the tiles (:func:`_select`), so
        a mean over the selection keeps eager's denominator."""
        if node.op not in ("call_function", "call_method") or not node.args:
            return False
        source, facts = node.args[0], facts_for(node.target)
        selects = None if facts is None else facts.selects
        shape = self.shape_of(source)
        splits = selects in (Selects.PIECES, Selects.ONE_PIECE)
        if splits and shape is not None and shape.layout is Layout.ROWS:
            self.saw_selection = True  # the second pass takes it
        if not self.select_rows:
            return False
        split = self.values.get(source) if isinstance(source, torch.fx.Node) else None
        if selects is Selects.INDEX and split is not None and split.pieces and isinstance(node.args[1], int):
            index, source = split.pieces[node.args[1]], split.source
            shape = self.shape_of(source)
        elif splits and shape is not None and shape.layout is Layout.ROWS:
            return self._split(node, selects is Selects.ONE_PIECE, source, shape)
        elif selects is Selects.INDEX and shape is not None and shape.layout is Layout.ROWS:
            index = leading_index(node, len(shape.tokens) + 1)
            if index is None:
                return False
        else:
            return False
        if self.values[source].selection is not None or not same_shape(shape.tokens, self.hidden_tokens):
            raise NoMatch("{} selects token rows of rows already selected or regrouped", node)
        bounds: list[torch.fx.Node] = []
        torch.fx.node.map_arg(index, bounds.append)
        if bounds:
            raise NoMatch("{} selects token rows with a symbolic bound", node)
        return self.row_selection_of(node, source, index)

    def _split(self, node: torch.fx.Node, one_piece: bool, source: torch.fx.Node, shape: Shape) -> bool:
        """``logits.chunk(2)``, ``logits.split(B)``, ``logits.narrow(0, 0, B)`` over a token
        dimension: each piece is a selection of the rows (a ``narrow`` one piece)."""
        ndim = len(shape.tokens) + 1
        default = node.args[1] if one_piece else node.args[2] if len(node.args) > 2 else 0
        dim = node.kwargs.get("dim", default)
        if not isinstance(dim, int) or not 0 <= dim % ndim < ndim - 1:
            raise NoMatch("{} splits the logits along the vocabulary, not the token rows", node)
        dim %= ndim
        if self.values[source].selection is not None or not same_shape(shape.tokens, self.hidden_tokens):
            raise NoMatch("{} selects token rows of rows already selected or regrouped", node)

        def index(start, stop):
            return (*(slice(None),) * dim, slice(start, stop), *(slice(None),) * (ndim - dim - 1))

        if one_piece:  # narrow(dim, start, length)
            start, length = node.args[2:4] if len(node.args) >= 4 else (None, None)
            if not isinstance(start, int) or not isinstance(length, int):
                raise NoMatch("{} selects token rows with a symbolic bound", node)
            return self.row_selection_of(node, source, index(start, start + length))
        pieces = node.meta.get("example_value", node.meta.get("val"))
        if not isinstance(pieces, (list, tuple)) or any(not isinstance(p.shape[dim], int) for p in pieces):
            raise NoMatch("{} splits the token rows into pieces of symbolic sizes", node)
        starts = [sum(p.shape[dim] for p in pieces[:k]) for k in range(len(pieces) + 1)]
        pieces = tuple(index(a, b) for a, b in zip(starts, starts[1:], strict=False))
        tuple_shape = Shape(Layout.TUPLE, shape.tokens, Layout.ROWS)
        self._join(node, self.values[source].value, tuple_shape, pieces=pieces, source=source)
        return True

    def row_selection_of(self, node: torch.fx.Node, source: torch.fx.Node, index: tuple) -> bool:
        """``node`` is the rows ``index`` of the region value ``source`` (all rows)."""
        tokens = tuple(val(node).shape[:-1])
        known = next((k for k, (i, _) in enumerate(self.selections) if repr(i) == repr(index)), None)
        if known is None:
            self.selections.append((index, tokens))
            known = len(self.selections) - 1
        self._join(node, self.values[source].value, Shape(Layout.ROWS, tokens), selection=known)
        return True

    def _selection_read(self, node: torch.fx.Node) -> int | None:
        """The row selection the region values ``node`` reads were computed on (``None``: all rows)."""
        found = {self.values[a].selection for a in node.all_input_nodes if a in self.values}
        if len(found) > 1:
            raise NoMatch("{} combines values of different selections of the token rows", node)
        return found.pop() if found else None

    def bias_after(self, node: torch.fx.Node) -> bool:
        """``x @ W.t() + b`` (or ``logits += b``) with a ``[V]`` bias of the logits' dtype, the
        projection's only reader: the bias joins the projection, so a learnable bias is
        differentiated as a linear's is; the tiles still add it after the matmul, rounding the
        product first as eager does (``F.linear(x, W, b)``'s one rounding less moves half-precision
        soft-capped losses off eager's, issue 48)."""
        facts = facts_for(node.target) if node.op in ("call_function", "call_method") else None
        if facts is None or not facts.bias_add:
            return False
        if self.bias is not None or self.shard is not None or self.autocast_dtype is not None or node.kwargs:
            return False
        if len(node.args) != 2 or list(self.projection.users) != [node] or len(self.program) > 1:
            return False
        logits, bias = node.args if node.args[0] is self.projection else node.args[::-1]
        if logits is not self.projection or not isinstance(bias, torch.fx.Node) or bias in self.depends:
            return False
        logits_val, bias_val, out_val = val(logits), val(bias), val(node)
        if not isinstance(bias_val, torch.Tensor) or out_val is None or bias_val.dim() == 0:
            return False
        if bias_val.dtype != logits_val.dtype or out_val.dtype != logits_val.dtype:
            return False  # a promoting add is not the linear's
        if bias_val.device != logits_val.device or not same(bias_val.shape[-1], self.vocab):
            return False
        if bias_val.dim() > logits_val.dim() or not all(same(d, 1) for d in bias_val.shape[:-1]):
            return False
        self.bias, self.bias_added = bias, True
        self.head_form += " + bias"
        self.values[node] = self.values[self.projection]
        return True

    def classify(self, node: torch.fx.Node) -> list[Classified]:
        """The node's steps by the rule registered for its op; ``NoMatch`` if it has none."""
        before = [a for a in node.all_input_nodes if self._before_slice(a)]
        if before:
            raise NoMatch("{} reads {}, computed before the logits' token slice, so it would need the rows "
                          "the slice drops", node, before[0])  # fmt: skip
        rule = _rules.rule_for(node)
        if rule is None:
            raise NoMatch("{} has no row-wise rule", node)
        return rule.classify(self, node)

    # ---------------------------------------------------------------- phases

    def partner_projections(self) -> set[torch.fx.Node]:
        """Other projections onto the same vocabulary whose logits this region's readers combine
        with row by row (a frozen teacher's head beside the student's, or a second trained head:
        its weight's and hidden states' gradients are derived in the tiles as the first head's):
        each tile computes their logits too, so neither head's ``[N, V]`` logits exist."""
        mine = _descendants(self.projection) | {self.projection}
        partners = set()
        for node in self.graph.nodes:
            if node in mine or node in self.excluded or node.op not in ("call_function", "call_method"):
                continue
            linear = projection_of(node)
            out = val(node)
            if linear is None or out is None or not same(out.shape[-1], self.vocab):
                continue
            if out.requires_grad and not self._trained_partners_allowed():
                continue
            weight = val(linear[1])
            if (
                linear[1] in mine
                or weight is None
                or weight.dim() != 2
                or not self._sharded_alike(linear, out)
            ):
                continue
            if any(u in mine for u in _descendants(node)):
                partners.add(node)
        return partners

    def _trained_partners_allowed(self) -> bool:
        """A trained second head joins a trained first one (a frozen head never leads a trained one:
        the trained head's own region takes the frozen one as its partner), on whole heads only
        (the tensor-parallel tiles' group-wide steps are proven for frozen partners alone)."""
        return self.shard is None and bool(getattr(val(self.projection), "requires_grad", False))

    def _sharded_alike(self, linear, out) -> bool:
        """Whether a partner head is split over the vocabulary as this head is: neither sharded,
        or both ``Shard(0)`` on one mesh with the same rows on this rank (its logits then meet
        this head's column for column, and the tiles compute this rank's piece of both)."""
        weight = val(linear[1])
        if self.shard is None or not hasattr(weight, "placements"):
            return self.shard is None and not hasattr(weight, "placements")
        try:
            return _vocab_shard(val(linear[0]), weight, out) == self.shard
        except NoMatch:
            return False

    def add_partner(self, node: torch.fx.Node) -> None:
        """The partner projection ``node`` as a step: ``F.linear`` of its hidden states (sliced
        per tile, a per-token input) and its weight and bias (shared by every row)."""
        hidden, weight, bias, transpose, _ = as_linear(node)
        hidden_val, out_val = val(hidden), val(node)
        tokens = tuple(out_val.shape[:-1])
        if hidden_val is None or not same(hidden_val.shape[-1], val(weight).shape[1]):
            raise NoMatch("{} projects hidden states that do not match its weight", node)
        if self.slices:
            raise NoMatch("{} is a second head after the logits' token rows were sliced", node)
        trained = out_val.requires_grad  # a trained second head: its gradients are derived in the tiles too
        entry = TokenInput(hidden, (hidden_val.shape[-1],), self.flat_tokens(tokens),
                           differentiable=trained and hidden_val.requires_grad)  # fmt: skip
        self.token_inputs.append(entry)
        self.partner_inputs.append(entry)
        args = [Ref(RefKind.TOKEN, len(self.token_inputs) - 1)]
        for operand in (weight, bias):
            if operand is not None:
                grad = trained and bool(getattr(val(operand), "requires_grad", False))
                self.row_inputs.append(SharedInput(operand, False, whole=True, differentiable=grad))
                self.partner_inputs.append(self.row_inputs[-1])
                args.append(Ref(RefKind.SHARED, len(self.row_inputs) - 1))
        classified = Classified(self.step(node, F.linear, args), Shape(Layout.ROWS, tokens))
        self._add(node, classified, RuleKind.ELEMENTWISE)
        self._no_gradient_through(node)
        self.partners[node] = transpose if transpose is not None and list(transpose.users) == [node] else None

    def unused_partners(self) -> set[torch.fx.Node]:
        """The partner heads no region value combines with this head's logits (their readers
        meet only outside the region, as two losses added together do)."""
        origin: dict[torch.fx.Node, frozenset] = {self.projection: frozenset({self.projection})}
        origin.update((p, frozenset({p})) for p in self.partners)
        met: set[torch.fx.Node] = set()
        for node in self.values:
            if node not in origin:
                origin[node] = frozenset().union(*(origin.get(a, ()) for a in node.all_input_nodes))
            if self.projection in origin[node]:
                met |= origin[node]
        return set(self.partners) - met

    def walk(self) -> None:
        """Phase 2: every node that depends on the logits, in graph order."""
        self.depends = {self.projection}
        cone = {self.projection}  # reached from the logits without another projection between
        partners = self.partner_projections()
        for node in self.graph.nodes:
            if node in partners:
                try:
                    self.add_partner(node)
                    self.depends.add(node)
                except NoMatch as why:
                    why.node = why.node or node
                    self.outside[node] = why
                continue
            if node is self.projection or not any(a in self.depends for a in node.all_input_nodes):
                continue
            self.depends.add(node)
            if any(a in cone for a in node.all_input_nodes) and not _projection_like(node):
                cone.add(node)
                # a loss-like op reading the logits, however far: this projection is a head
                facts = facts_for(node.target) if node.op in ("call_function", "call_method") else None
                sign = facts is not None and facts.head_sign
                read = val(node.args[0] if node.args else node.kwargs.get("input"))  # over this vocabulary
                self.head_signs |= sign and read is not None and same(read.shape[-1], self.vocab)
            if any(a in self.depends and a not in self.values for a in node.all_input_nodes):
                self.outside[node] = NoMatch(
                    "{} reads a value computed from the logits outside the region", node
                )
                continue
            if self.shard is not None and _no_op_redistribute(node):
                self.values[node] = self.values[node.args[0]]  # ColwiseParallel's output hook
                continue
            try:
                if self.row_selection(node) or self.token_slice(node) or self.bias_after(node):
                    continue
                selection = self.selection = self._selection_read(node)
                classified = self.classify(node)
            except NoMatch as why:
                why.node = why.node or node
                self.outside[node] = why
                continue
            finally:
                self.selection = None
            for entry in classified:
                self._add(node, entry, selection=selection)
            self._no_gradient_through(node)

    def _no_gradient_through(self, node: torch.fx.Node) -> None:
        """A floating value computed without a gradient from values that have one (under
        ``no_grad``, or a frozen head's logits) is detached in the program too: the tiles'
        derived gradient must not flow through what eager's autograd never recorded."""
        out = val(node)
        if not isinstance(out, torch.Tensor) or out.requires_grad or not out.is_floating_point():
            return
        record = self.values.get(node)
        if record is None or record.shape.layout in (Layout.TUPLE, Layout.REDUCED):
            return
        if not any(getattr(val(a), "requires_grad", False) for a in node.all_input_nodes):
            return
        step = self.step(node, "detach", (Ref(RefKind.VALUE, record.value.index),), op="call_method")
        self._add(node, Classified(step, record.shape), RuleKind.ELEMENTWISE, record.selection)

    def _add(self, node: torch.fx.Node, entry: Classified, kind: RuleKind | None = None, selection=None):
        """A step of ``node`` joins the program; its readers see its value (reduced, if it is)."""
        index, step = len(self.program), entry.step
        if step.args and step.args[0] == PREVIOUS_STEP:
            step = replace(step, args=(Ref(RefKind.VALUE, index - 1), *step.args[1:]))
        # a per-token input that is differentiated is no zero condition: d(mask * x)/d mask is x
        per_token = frozenset(
            i for i, t in enumerate(self.token_inputs)
            if t.part in ((), (1,)) and not getattr(val(t.node), "requires_grad", False)
        )  # fmt: skip
        zeros = _region.zero_where(step, dict(enumerate(v.zeros for v in self.program)), per_token)
        value = ProgramValue(index, step, entry.shape, kind or _rules.rule_for(node).kind, zeros)
        self.program.append(value)
        after = entry.after_tiles
        shape = entry.shape if after is None else Shape(Layout.REDUCED, entry.shape.tokens)
        self._join(node, value, shape, selection=selection, after_tiles=after)

    def collect_outputs(self) -> list[RegionOutput] | None:
        """Phase 3: the region values read outside the region; None if it holds no head."""
        if not self.head_signs:
            return None
        outputs = []
        for node, record in self.values.items():
            users = [u for u in node.users if u not in self.values]
            if not users:
                continue
            index, shape = record.value.index, record.shape
            if record.after_tiles is not None:  # the output is the tiles' per-token value
                grad = bool(val(node).requires_grad)
                outputs.append(RegionOutput(node, index, record.value.shape, grad, record.after_tiles))
                continue
            if shape.layout is Layout.TUPLE:
                raise NoMatch("{} is used whole; take its values and indices apart first", node)
            if shape.layout is Layout.ROWS and record.selection is not None:
                raise NoMatch("{} selects token rows that {} reads as [tokens, V] rows, so they must exist "
                              "whole", node, users[0], node=users[0])  # fmt: skip
            if shape.layout is Layout.ROWS:
                if self._before_slice(node):  # before the token slice: returned whole, or dropped
                    if all(u.op == "output" for u in users):
                        if self.drop_rows and len(self.slices) == 1:
                            self.dropped.append(node)
                        else:  # the graph keeps computing them; the tiles run the sliced rows
                            self.kept_whole.append(node)
                        continue
                    first = next(n for n, r in self.values.items() if r.sliced)  # the first slice
                    raise NoMatch("{} slices the logits' token rows while {} reads them whole, so they must "
                                  "exist whole", first, users[0])  # fmt: skip
                if self.drop_rows and all(u.op == "output" for u in users) and not self.slices:
                    self.dropped.append(node)
                    continue
                user = next((u for u in users if u.op != "output"), None)
                if user is not None:  # it must exist whole for a reader that is not the output
                    why = self.outside.get(user)
                    detail = str(why).removeprefix(describe(user)).strip(" ,:") if why else "is not row-wise"
                    raise NoMatch("the logits ({}) are also consumed by {}, which {}; so they must exist "
                                  "whole", node, user, detail, node=user,
                                  eager_raises=getattr(why, "eager_raises", False))  # fmt: skip
            value = val(node)
            outputs.append(
                RegionOutput(node, index, shape, bool(value.requires_grad) and value.is_floating_point())
            )
        if outputs and all(o.shape.layout is Layout.ROWS for o in outputs):
            raise NoMatch("{} gives [tokens, V] rows that the graph returns whole, and nothing per token "
                          "reads them; tiling would save nothing", outputs[-1].node)  # fmt: skip
        if not outputs:
            return None
        for out in outputs:
            self.selection = self.values[out.node].selection
            out.flat_tokens = self.flat_tokens(out.shape.tokens)
            out.subset = None if self.selection is None else self.selections[self.selection][0]
        self.selection = None
        return outputs

    def scalar_loss(self, outputs: list[RegionOutput]):
        """Phase 4: the token reductions that end the differentiable outputs in one scalar;
        ``(nodes, steps, sink, inputs, result, linear)`` or None (the op then derives the
        gradient in backward). Reductions linear in the outputs are taken first (their gradient
        does not depend on the outputs); otherwise any reduction of rule-known ops whose other
        inputs need no gradient (the loop then evaluates that gradient at the outputs)."""
        for linear in (True, False):
            found = self._scalar_loss(outputs, linear)
            if found is not None:
                return (*found, linear)
        return None

    def _scalar_loss(
        self, outputs: list[RegionOutput], linear_only: bool, only: set | None = None, sink=None
    ):
        diff = [o for o in outputs if o.differentiable and o.shape.layout is not Layout.ROWS]
        if not diff:
            return None
        env: dict[torch.fx.Node, Ref] = {}
        steps: list[Step] = []
        inputs: list[torch.fx.Node] = []  # the loss's own: the operands' reduce group

        def external(arg):
            if isinstance(arg, (list, tuple)):  # torch.cat's tensors
                return type(arg)(external(a) for a in arg)
            if not isinstance(arg, torch.fx.Node):
                if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    raise NoMatch("dynamic scalar")
                return arg
            if arg in env:
                return env[arg]
            value = val(arg)
            if arg in self.depends or value is None or value.requires_grad:
                raise NoMatch("not linear")
            if arg not in inputs:
                inputs.append(arg)
            return Ref(RefKind.REDUCE, inputs.index(arg))

        try:
            for k, out in enumerate(outputs):
                steps.extend(self._restored(out, Ref(RefKind.OUTPUT, k), len(steps), external))
                env[out.node] = Ref(RefKind.VALUE, len(steps) - 1)
        except NoMatch:  # labels or class weights computed from the logits
            return None
        # depends on a differentiable output (and, when linear_only, linearly)
        dependent = {o.node for o in outputs if o.differentiable or not linear_only}
        nodes = []
        for node in self.graph.nodes:
            if node in env or (only is not None and node not in only):
                continue
            if linear_only:
                if not _linear_in(node, dependent):
                    continue
                if any(a in env and a not in dependent for a in node.all_input_nodes):
                    # a factor computed from the logits (argmax, a count of correct tokens): the
                    # token weights, derived before the tiles run, would not know its value
                    continue
            elif not _nonlinear_in(node, dependent):
                continue
            try:
                args = [external(a) for a in node.args]
                kwargs = [(k, external(v)) for k, v in node.kwargs.items()]
            except NoMatch:  # it reads the logits otherwise, or a tensor that needs a gradient
                continue
            steps.append(self.step(node, node.target, args, kwargs, node.op))
            env[node] = Ref(RefKind.VALUE, len(steps) - 1)
            dependent.add(node)
            nodes.append(node)
        # the loss: the one reduction node read outside them, or an output itself (a folded mean
        # cross entropy). Another output may be read outside too (a metric of the logits,
        # per-token log-probs returned): it stays differentiable, its gradient a re-run of the
        # tiles in backward where one arrives
        if sink is not None:  # the second pass, over the nodes the loss is computed from
            return nodes, steps, sink, inputs, env[sink].index
        members = set(nodes) | {o.node for o in outputs}
        read_outside = [n for n in nodes if any(u not in members for u in n.users)]
        # values that need no gradient read outside too (DPO's detached rewards): the graph keeps
        # computing them from the op's outputs
        sinks = [n for n in read_outside if getattr(val(n), "requires_grad", True)]
        sinks = sinks or [o.node for o in diff if any(u not in members for u in o.node.users)]
        sink_val = val(sinks[0]) if len(sinks) == 1 else None
        if sink_val is None or sink_val.dim() != 0 or not sink_val.requires_grad:
            return None
        needed = _ancestors(sinks[0], set(nodes), {o.node for o in outputs})
        if only is None and len(needed) < len(nodes):  # again with the nodes the loss reads only
            return self._scalar_loss(outputs, linear_only, only=needed, sink=sinks[0])
        return nodes, steps, sinks[0], inputs, env[sinks[0]].index

    def _restored(self, out: RegionOutput, read: Ref, first: int, external) -> list[Step]:
        """Phase 4's steps (numbered from ``first``) giving output ``read`` as the graph has it: the
        selection's rows of what the tiles computed on all rows, and its token reduction finished."""
        steps, rows, hidden = [], Ref(RefKind.HIDDEN, 0), Ref(RefKind.HIDDEN, 0)
        if out.subset is not None:
            steps.append(self.step(out.node, select, (read, hidden, out.subset)))
            steps.append(self.step(out.node, operator.getitem, (hidden, out.subset)))
            read, rows = Ref(RefKind.VALUE, first), Ref(RefKind.VALUE, first + 1)
        if out.after_tiles is None:
            return [*steps, self.step(out.node, restore, (read, rows, out.flat_tokens))]
        operands = [external(a) for a in out.after_tiles.operands]
        args = (read, out.after_tiles.how, rows, out.flat_tokens, *operands)
        return [*steps, self.step(out.node, after_tiles, args)]


#: ops that only take a tensor apart or put parts together: pure, so a nonlinear scalar loss may
#: hold them even where a region may not (the loss is run once per tile)
_LOSS_STRUCTURE = frozenset({
    "chunk", "split", "tensor_split", "unbind", "cat", "concat", "concatenate", "stack", "flatten",
    "unflatten", "movedim", "select", "index_select", "take_along_dim", "squeeze", "unsqueeze", "transpose",
    "permute", "reshape", "view", "contiguous", "clone", "expand", "t", "narrow", "getitem",
})  # fmt: skip


def _ancestors(
    node: torch.fx.Node, within: set[torch.fx.Node], leaves: set[torch.fx.Node]
) -> set[torch.fx.Node]:
    """``node`` and the nodes of ``within`` it is computed from, through ``within`` only and not
    past ``leaves`` (the region's outputs: the op gives them, whatever computed them)."""
    found, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in found or (n is not node and n not in within):
            continue
        found.add(n)
        if n not in leaves:
            todo.extend(n.all_input_nodes)
    return found & (within | {node})


def _nonlinear_in(node: torch.fx.Node, dependent: set[torch.fx.Node]) -> bool:
    """Whether ``node`` may join a nonlinear scalar loss (phase 4): an op with a rule or one that
    takes tensors apart or together, not an in-place method, reading a value that depends on
    the outputs."""
    if node.op not in ("call_function", "call_method") or not any(
        a in dependent for a in node.all_input_nodes
    ):
        return False
    if _rules.rule_for(node) is None:
        return target_name(node.target) in _LOSS_STRUCTURE
    spelled = spelling(node.target)
    return not (spelled.inplace and isinstance(node.target, str))


def _linear_in(node: torch.fx.Node, linear: set[torch.fx.Node]) -> bool:
    """Whether ``node`` is linear in the values of ``linear`` it reads (phase 4), by its op's
    ``linear`` fact: a token reduction, a regrouping, a dtype cast, a sum, or a product or
    quotient by something else; not an in-place method."""
    if not any(a in linear for a in node.all_input_nodes) or _rules.rule_for(node) is None:
        return False
    spelled = spelling(node.target)
    if spelled.inplace and isinstance(node.target, str):
        return False
    how = FACTS[spelled.key].linear
    dependent = [a for a in node.args if isinstance(a, torch.fx.Node) and a in linear]
    first = bool(node.args) and node.args[0] in linear
    if any(isinstance(v, torch.fx.Node) and v in linear for v in node.kwargs.values()):
        return False
    if how is Linear.CAST and any(not isinstance(a, torch.dtype) for a in node.args[1:]):
        return False
    if how in (Linear.FIRST, Linear.CAST):
        return first and len(dependent) == 1
    if how is Linear.FACTOR:
        return len(dependent) == 1
    if how is Linear.DIVIDEND:
        return first and len(dependent) == 1 and node.kwargs.get("rounding_mode") is None
    return how is Linear.TERMS


def match_row_region(
    graph: torch.fx.Graph, projection: torch.fx.Node, autocast_states=None, drop_rows: bool = False
) -> RowRegion | None:
    """The row-wise region of ``projection``; None if it is not an LM head's; raises ``NoMatch``."""
    linear = projection_of(projection)
    if linear is None:
        return None
    states = autocast_states or _autocast_states(graph)
    matcher = None
    try:
        return _build_region(matcher := _walked(graph, projection, linear, states, drop_rows))
    except NoMatch as why:
        if matcher is None:
            raise
        why.depends = matcher.depends  # the skip replaces the reports of the losses it holds
        if not matcher.slices and not matcher.saw_selection:
            raise
        # a token slice read beside all rows (DPO's NLL on the chosen half): the second pass keeps
        # every slice a selection of the tiles' rows; if that fails too, the first reason stands
        try:
            return _build_region(_walked(graph, projection, linear, states, drop_rows, select_rows=True))
        except NoMatch as second:
            log.debug("the second matching pass (row selections) stopped too: %s", second)
            raise why from None


def _walked(graph, projection, linear, states, drop_rows, select_rows=False) -> RegionMatcher:
    """A matcher after phase 2; walked again without the partner heads it did not combine with."""
    excluded: set[torch.fx.Node] = set()
    while True:
        matcher = RegionMatcher(graph, projection, linear, states, drop_rows, select_rows, excluded)
        matcher.walk()
        unused = matcher.unused_partners()
        if not unused:
            return matcher
        excluded = excluded | unused


def first_stop(
    graph: torch.fx.Graph, projection: torch.fx.Node, readers: list[torch.fx.Node]
) -> NoMatch | None:
    """Why the region of ``projection`` does not reach through ``readers`` (a path from its
    logits, in graph order): the reason of the first reader outside it, or the region's own."""
    try:
        matcher = _walked(graph, projection, as_linear(projection), _autocast_states(graph), False)
        stopped = next((matcher.outside[r] for r in readers if r in matcher.outside), None)
        if stopped is None:
            matcher.collect_outputs()  # raises the region's own reason, if it has one
        return stopped
    except NoMatch as why:
        return why


def _build_region(matcher: RegionMatcher) -> RowRegion | None:
    """Phases 3 to 5: the outputs, the scalar loss, then the program registered and the region's
    record; None if the region holds no head."""
    outputs = matcher.collect_outputs()
    if outputs is None:
        return None
    reduction = matcher.scalar_loss(outputs)
    nothing = ([], (), None, [], None, True)
    reduction_nodes, reduction_steps, sink, reduce_inputs, result, linear = reduction or nothing
    in_loss = set(reduction_nodes)
    steps_text = [matcher.head_form if matcher.autocast_dtype is None
                  else f"autocast({str(matcher.autocast_dtype)[6:]}) {matcher.head_form}"]  # fmt: skip
    partner_of = {matcher.values[p].value.index: p for p in matcher.partners}
    head_number = {index: k for k, index in enumerate(sorted(partner_of), start=2)}
    for value in matcher.program[1:]:
        shown = value.step.describe()
        if value.index in partner_of:  # another head's logits, computed in the same tiles
            trained = val(partner_of[value.index]).requires_grad
            shown = (f"head {head_number[value.index]} ({as_linear(partner_of[value.index])[4]}, "
                     f"{value.step.source}, {'trained' if trained else 'no gradient'})")  # fmt: skip
        steps_text += ["slice tokens"] * matcher.slice_steps.count(value.index) + [shown]
    if matcher.selections:
        steps_text.append(f"row selections {', '.join(_index_text(i) for i, _ in matcher.selections)}")
    steps = tuple(value.step for value in matcher.program[1:])

    def zeros(o):  # where the output is zero whatever the logits: tokens the tiles may skip
        return matcher.program[o.value].zeros if o.shape.layout is not Layout.ROWS else None

    program_outputs = tuple(
        Output(o.value, o.shape.layout, val(o.node).dtype,
               o.differentiable and o.shape.layout is not Layout.ROWS, zeros=zeros(o),
               only_loss=o.node is sink or bool(in_loss) and all(u in in_loss for u in o.node.users))
        for o in outputs
    )  # fmt: skip
    finish = ReductionProgram(tuple(reduction_steps), result, val(sink).dtype, linear,
                              num_inputs=len(reduce_inputs)) if reduction else None  # fmt: skip
    vocab_size, shard = int(matcher.vocab), None
    if matcher.shard is not None:
        if any(o.shape.layout is Layout.ROWS for o in outputs):
            raise NoMatch("logits returned from a vocabulary-sharded head are not tiled in tensor-parallel "
                          "form yet")  # fmt: skip
        steps = tuple(_shard_program_steps(matcher))
        vocab_size, shard = matcher.shard[2], (*matcher.shard[:2], int(matcher.vocab))

    def token_layout(part: tuple) -> Layout:  # (a partner head's hidden size may be symbolic: no hashing)
        if not part:
            return Layout.TOKENS
        return Layout.TOKENS1 if len(part) == 1 and type(part[0]) is int and part[0] == 1 else Layout.ROWS

    program = _region.register(RowProgram(
        steps=steps, outputs=program_outputs, vocab_size=vocab_size, shard=shard,
        token_layouts=tuple(token_layout(t.part) for t in matcher.token_inputs),
        has_bias=matcher.bias is not None, bias_added=matcher.bias_added, num_shared=len(matcher.row_inputs),
        index_checks=tuple(matcher.index_checks), reduction=finish, form=" -> ".join(steps_text),
    ))  # fmt: skip
    operands = RegionOperands(matcher.hidden, matcher.weight, matcher.bias, tuple(matcher.token_inputs),
                              tuple(matcher.row_inputs), tuple(reduce_inputs))  # fmt: skip
    return RowRegion(
        projection=matcher.projection, operands=operands, autocast_dtype=matcher.autocast_dtype,
        nodes=[*matcher.values, *(n for n in (matcher.transpose, *matcher.partners.values()) if n)],
        outputs=outputs, program=program,
        reduction_nodes=reduction_nodes, sink=sink, steps_text=steps_text,
        dropped=matcher.dropped, kept_whole=matcher.kept_whole, slices=matcher.slices,
        num_tokens=matcher.num_tokens,
    )  # fmt: skip
