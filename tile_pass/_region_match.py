"""Find a row-wise region in a Dynamo graph and rewrite it into one tiled op.

A region is an LM-head projection plus every node that uses its logits row by row, with
as many outputs as the user's code takes from it. The matcher runs in phases:

1. **the projection** (:func:`tile_pass._fx.as_linear`): ``F.linear``/``x @ W.T`` with a 2-D
   weight, its autocast dtype;
2. **the row-wise subgraph**: every node that depends on the logits is classified, in graph
   order, by the rules table (:mod:`tile_pass._rules`); a node joins the region when a rule
   proves it row-wise and every logits-dependent operand is already in the region;
3. **the outputs**: region values read outside it. Per-token values (losses, log-probs,
   log-sum-exps, ``argmax``) leave the tiles flat; a token reduction folded into an op
   (a mean cross entropy) is finished after them; rows (``[N, V]``) may only be returned,
   and are written tile by tile, with a gradient path replayed if the caller uses it;
4. **the scalar loss**: when the differentiable outputs reach exactly one scalar through
   token reductions linear in them, those nodes join the op, which then forms the whole
   gradient in forward (:mod:`tile_pass.tiled_region`);
5. **the rewrite**: one call to :func:`tile_pass.tiled_region.run_region`.

Anything unproven raises :class:`~tile_pass._rules.NoMatch` with the op and the line that
stopped the region, and the graph is left as it was.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F

from tile_pass import _region, _rules
from tile_pass._fx import as_linear, leading_index, same, val
from tile_pass._region import Output, ReductionProgram, Ref, RowProgram, Step
from tile_pass._returned_logits import ReturnedLogits
from tile_pass._rules import Classified, Layout, NoMatch, describe
from tile_pass.report import source_line

_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast
#: ops that make a projection an LM-head candidate worth reporting (a norm's mean or a
#: router's softmax are row-wise too, but their projections are not heads)
_HEAD_SIGNS = {"logsumexp", "log_softmax", "gather", F.cross_entropy, F.nll_loss, F.kl_div, F.log_softmax,
               torch.log_softmax, torch.logsumexp, torch.gather}  # fmt: skip


@dataclass
class TokenInput:
    """A tensor from outside the region with one value (or row) per token, sliced per tile."""

    node: torch.fx.Node
    part: tuple  # its shape after the token dims: (), (1,) or (V,)
    flat_tokens: bool  # its site's token dims are the flattened [N] (else the hidden states')


@dataclass
class RowInput:
    """A tensor from outside the region that every row shares (0-d, ``[V]``, ``[1]``)."""

    node: torch.fx.Node
    zero_dim: bool


@dataclass
class RegionOutput:
    node: torch.fx.Node  # the FX node whose value leaves the region
    value: int  # the program value
    layout: Layout
    differentiable: bool
    after_tiles: tuple | None = None  # the token reduction left to do (see _rules.Classified)
    flat_tokens: bool = False  # its token dims are the flattened [N] (else the hidden states')


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
    reduction_nodes: list[torch.fx.Node] = field(default_factory=list)  # joined the op (phase 4)
    sink: torch.fx.Node | None = None  # the scalar loss they end in
    reduce_inputs: list[torch.fx.Node] = field(default_factory=list)
    steps_text: list[str] = field(default_factory=list)
    dropped: list[torch.fx.Node] = field(default_factory=list)  # returned rows replaced by a placeholder
    kept_whole: list[torch.fx.Node] = field(default_factory=list)  # returned rows before a token slice
    slices: list[tuple] = field(default_factory=list)  # token selections applied to the hidden states
    num_tokens: object = 0  # the tokens the tiles run (after the slices)


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


def _ambient_autocast(device_type: str) -> tuple[str, torch.dtype] | None:
    """The autocast state the graph is compiled under (AOTAutograd traces it under this too)."""
    try:
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    except RuntimeError:
        pass
    return None


def _state_for(contexts: tuple, ambient, device_type: str):
    for context_device, dtype, enabled in reversed(contexts):
        if context_device == device_type:
            return (device_type, dtype) if enabled else None
    return ambient


def _numel(shape) -> object:
    total = 1
    for size in shape:
        total = total * size
    return total


def _projection_like(node: torch.fx.Node) -> bool:
    """A linear layer or matmul: where the logits' cone stops (a later layer's inputs)."""
    try:
        return as_linear(node) is not None
    except NoMatch:
        return True


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


def _after_tiles(flat: torch.Tensor, how: str, hidden: torch.Tensor, flat_tokens: bool, *operands):
    """The token reduction an op folded in (``F.cross_entropy(reduction="mean")``, a full
    ``sum()``/``mean()``, ``kl_div(reduction="batchmean")``), finished on the tiles'
    per-token values exactly as eager defines it."""
    total = flat.sum()
    if how == "sum":
        return total
    if how == "div_elements":  # a mean over tokens and the vocabulary
        return total / (flat.shape[0] * operands[0])
    if how == "div_tokens":
        return total / flat.shape[0]
    if how == "div_first_dim":  # batchmean: input.size(0), as the user's graph shaped the input
        return total / (flat.shape[0] if flat_tokens else hidden.shape[0])
    if how == "mean_valid":  # eager's denominator: the labelled tokens (class-weighted)
        target, class_weight, ignore_index = operands
        valid = target != ignore_index
        if class_weight is None:
            return total / valid.sum()
        safe = torch.where(valid, target, 0).clamp(0, class_weight.shape[0] - 1)
        return total / torch.where(valid, class_weight[safe], 0).sum()
    raise ValueError(f"unknown token reduction {how!r}")


def _per_token(x: torch.Tensor, hidden: torch.Tensor, flat_tokens: bool, part_dims: int) -> torch.Tensor:
    """A per-token operand as the tiles take it: ``[N, *part]``, broadcast token dims expanded."""
    part = tuple(x.shape[x.dim() - part_dims :]) if part_dims else ()
    tokens = (_numel(hidden.shape[:-1]),) if flat_tokens else tuple(hidden.shape[:-1])
    return x.expand(*tokens, *part).reshape(-1, *part)


def _restore(flat: torch.Tensor, hidden: torch.Tensor, flat_tokens: bool) -> torch.Tensor:
    """A flat output of the tiles in the shape the user's graph gave it."""
    return flat if flat_tokens else flat.view(*hidden.shape[:-1], *flat.shape[1:])


class _ProgramPrefix(torch.nn.Module):
    """The returned rows of a region, computed whole, for the gradient path of logits that are
    also returned (see :mod:`tile_pass._returned_logits`): the same program, on all tokens."""

    def __init__(self, program: RowProgram, output: int, flat_tokens: bool, has_bias: bool):
        super().__init__()
        self.program, self.output, self.flat_tokens, self.has_bias = program, output, flat_tokens, has_bias

    def forward(self, hidden, weight, *rest):
        bias = rest[0] if self.has_bias else None
        rest = rest[1:] if self.has_bias else rest
        count = len(self.program.token_layouts)
        flat = hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0)
        outputs = _region.run_program(
            self.program, flat, weight, bias, list(rest[:count]), list(rest[count:])
        )
        return _restore(outputs[self.output], hidden, self.flat_tokens)


# ------------------------------------------------------------------------------ matcher


def describe_output(output: RegionOutput) -> str:
    """``lse [tokens]`` and the like, for reports."""
    what = {"rows": "rows", "tokens1": "per token", "tokens": "per token"}[output.layout.kind]
    if output.after_tiles is not None:
        what = f"token {output.after_tiles[0]}"
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


#: the steps over the vocabulary a sharded region must replace by their group-wide form
_VOCAB_METHODS = frozenset({"sum", "mean", "logsumexp", "amax", "amin", "max", "min", "argmax", "argmin"})
_VOCAB_FUNCTIONS = (F.log_softmax, F.softmax, torch.gather, F.cross_entropy, F.nll_loss, F.kl_div)


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
    for token_input in matcher.token_inputs:
        if token_input.part not in ((), (1,)):  # per token: a label, a gather index, a mask
            raise NoMatch("a [tokens, V] operand (a teacher's logits) is not sharded with the head yet")
    if any(not row.zero_dim for row in matcher.row_inputs):
        raise NoMatch("a [V] operand of the logits is not sharded with the head yet")
    steps = []
    for step, layout in zip(matcher.steps, matcher.step_layouts, strict=True):
        source = step.args[0] if step.args else None
        reads_rows = (
            isinstance(source, Ref) and source.kind == "value"
            and (source.index == 0 or matcher.step_layouts[source.index - 1].kind == "rows")
        )  # fmt: skip
        over_vocab = (step.op == "call_method" and step.target in _VOCAB_METHODS) or (
            step.op == "call_function" and step.target in _VOCAB_FUNCTIONS
        )
        if reads_rows and over_vocab:
            sharded = shard_step(step, group_name, start, int(matcher.vocab))
            if sharded is None:
                raise NoMatch(f"{step.describe()} ({step.source}) has no tensor-parallel form yet")
            step = sharded
        elif reads_rows and step.target == "reshape" and layout.kind == "rows":
            args = (*step.args[:-1], rows)
            step = Step(step.op, step.target, args, step.kwargs, step.autocast, step.source)
        elif layout.kind == "rows":  # an elementwise step of the rows
            replicated = tuple(
                i for i, a in enumerate(step.args)
                if isinstance(a, Ref) and a.kind == "value" and a.index > 0
                and matcher.step_layouts[a.index - 1].kind in ("tokens", "tokens1")
            )  # fmt: skip
            if any(isinstance(v, Ref) and v.kind == "value" for _, v in step.kwargs):
                raise NoMatch(f"{step.describe()} ({step.source}) takes a computed value by keyword")
            if replicated:
                step = Step("call_function", shard_elementwise,
                            (step.target, step.op, replicated, group_name, *step.args), step.kwargs,
                            step.autocast, step.source)  # fmt: skip
        steps.append(step)
    return steps


class _Matcher:
    """Phases 2-4 for one projection (see the module docstring)."""

    def __init__(self, graph: torch.fx.Graph, projection: torch.fx.Node, linear, autocast_states, drop_rows):
        self.graph = graph
        self.projection = projection
        self.hidden, self.weight, self.bias, self.transpose, self.head_form = linear
        self.autocast_states = autocast_states
        self.drop_rows = drop_rows
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
        self.ambient = _ambient_autocast(self.device_type)
        self.hidden_tokens = tuple(hidden_val.shape[:-1])
        self.num_tokens = _numel(self.hidden_tokens)
        dtypes = {hidden_val.dtype, weight_val.dtype} | (
            {val(self.bias).dtype} if self.bias is not None else set()
        )
        self.autocast_dtype = None
        if dtypes != {out_val.dtype}:
            if out_val.dtype not in (torch.bfloat16, torch.float16):
                raise NoMatch(f"the linear's output dtype {out_val.dtype} does not follow from its inputs")
            self.autocast_dtype = out_val.dtype
        self.values: dict[torch.fx.Node, tuple[int, Layout]] = {
            projection: (0, Layout("rows", self.hidden_tokens))
        }
        self.steps: list[Step] = []
        self.step_layouts: list[Layout] = []  # the layout of each step's value
        self.nodes: list[torch.fx.Node] = []
        self.token_inputs: list[TokenInput] = []
        self.row_inputs: list[RowInput] = []
        self.after: dict[torch.fx.Node, tuple] = {}
        self.index_checks: list[tuple] = []
        self.outside: dict[torch.fx.Node, str] = {}  # node that depends on the logits -> why not row-wise
        self.head_signs = False
        self.dropped: list[torch.fx.Node] = []  # returned rows not computed (drop_logits=True)
        #: rows before a token slice that the graph returns: left to the graph, computed whole
        self.kept_whole: list[torch.fx.Node] = []
        self.zeros: dict[int, tuple] = {}  # per value: where it is zero (_region.zero_where)
        self.slices: list[tuple] = []  # token selections moved onto the hidden states, in order
        self.slice_steps: list[int] = []
        self.slice_nodes: list[torch.fx.Node] = []
        self.pre_slice: set[torch.fx.Node] = set()  # values computed before the last of them

    # ---------------------------------------------------------------- operands

    def _flat(self, tokens: tuple) -> bool:
        """Whether a token shape is the flattened [N] (else it must be the hidden states')."""
        if _same_shape(tokens, self.hidden_tokens):
            return False
        if len(tokens) == 1 and same(tokens[0], self.num_tokens):
            return True
        raise NoMatch(f"the logits' token dimensions are regrouped into {tuple(tokens)}")

    def operand(self, arg, out: Layout, node: torch.fx.Node):
        """A step's argument: a region value, a per-token or shared input, or a constant."""
        if isinstance(arg, (tuple, list)):
            return type(arg)(self.operand(a, out, node) for a in arg)
        if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NoMatch(f"{describe(node)} uses a dynamic scalar; keep it a Python constant")
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg in self.values:
            index, layout = self.values[arg]
            if layout.kind == "reduced":
                raise NoMatch(f"{describe(node)} reads a value reduced over the tokens")
            return Ref("value", index)
        if arg in self.depends:
            raise NoMatch(f"{describe(node)} combines the logits with {describe(arg)}, which is not row-wise")
        value = arg.meta.get("example_value", arg.meta.get("val"))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NoMatch(f"{describe(node)} uses a dynamic scalar; keep it a Python constant")
        if not isinstance(value, torch.Tensor):
            raise NoMatch(f"{describe(node)} takes {describe(arg)}, which is not a tensor")
        return self.side_input(arg, value, out, node)

    def side_input(self, arg, value: torch.Tensor, out: Layout, node) -> Ref:
        if value.requires_grad:
            raise NoMatch(
                f"{describe(node)} uses {describe(arg)}, which requires grad; a learnable tensor "
                "inside the region is not tiled yet"
            )
        out_part = _region.row_part(out.kind, self.vocab)
        out_shape = (*out.tokens, *out_part)
        if value.dim() > len(out_shape):
            raise NoMatch(f"{describe(node)} broadcasts the logits up with {describe(arg)}")
        padded = (1,) * (len(out_shape) - value.dim()) + tuple(value.shape)
        tokens, part = padded[: len(out.tokens)], padded[len(out.tokens) :]
        per_token = all(same(s, t) for s, t in zip(tokens, out.tokens, strict=True))
        if not per_token and all(same(s, 1) for s in tokens):
            for i, entry in enumerate(self.row_inputs):
                if entry.node is arg:
                    return Ref("row", i)
            self.row_inputs.append(RowInput(arg, value.dim() == 0))
            return Ref("row", len(self.row_inputs) - 1)
        if not all(same(s, 1) or same(s, t) for s, t in zip(tokens, out.tokens, strict=True)):
            raise NoMatch(f"{describe(node)} combines the logits with {describe(arg)} of shape "
                          f"{tuple(value.shape)}, which is not one value per token")  # fmt: skip
        if not per_token and part and not same(part[0], 1):
            raise NoMatch(f"{describe(node)} broadcasts {describe(arg)} over tokens into [N, V] rows")
        part = tuple(1 if same(p, 1) else self.vocab for p in part)
        entry = TokenInput(arg, part, self._flat(out.tokens))
        for i, known in enumerate(self.token_inputs):
            if known.node is arg and known.part == part and known.flat_tokens == entry.flat_tokens:
                return Ref("token", i)
        self.token_inputs.append(entry)
        return Ref("token", len(self.token_inputs) - 1)

    # ---------------------------------------------------------------- rules

    def layout_of(self, arg) -> Layout | None:
        return self.values[arg][1] if isinstance(arg, torch.fx.Node) and arg in self.values else None

    def step(self, node, target, args, kwargs=(), op="call_function") -> Step:
        contexts = self.autocast_states.get(node, ())
        state = _state_for(contexts, self.ambient, self.device_type)
        return Step(op, target, tuple(args), tuple(kwargs), state,
                    source_line(node))  # fmt: skip

    def token_slice(self, node: torch.fx.Node) -> bool:
        """``logits[:, :-1, :]``, ``logits[..., -k:, :]``: a selection of token rows of the logits
        before any regrouping, moved onto the hidden states (the tiles then run only those rows,
        and every value before it is computed on them too, being row-wise). Values computed
        before the slice may then be read only on the way to it."""
        source = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
        layout = self.layout_of(source)
        if layout is None or layout.kind != "rows":
            return False
        if source in self.pre_slice:
            raise NoMatch(f"{describe(node)} slices the logits' token rows a second way")
        index = leading_index(node, len(layout.tokens) + 1)
        if index is None:
            raise NoMatch(f"{describe(node)} indexes the logits by something other than token rows")
        if not _same_shape(layout.tokens, self.hidden_tokens):
            raise NoMatch(f"{describe(node)} slices token rows that were regrouped; slice before reshaping")
        if self.token_inputs:
            raise NoMatch(f"{describe(node)} slices the token rows after a per-token value was combined "
                          "with them; slice the logits first")  # fmt: skip
        tokens = tuple(val(node).shape[:-1])
        self.pre_slice |= set(self.values)
        self.slices.append(index)
        self.slice_nodes.append(node)
        self.slice_steps.append(len(self.steps))  # where "slice tokens" reads in the report
        self.hidden_tokens, self.num_tokens = tokens, _numel(tokens)
        self.values[node] = (self.values[source][0], Layout("rows", tokens))
        return True

    def classify(self, node: torch.fx.Node) -> list[Classified]:
        before = [a for a in node.all_input_nodes if a in self.pre_slice]
        if before:
            raise NoMatch(f"{describe(node)} reads {describe(before[0])}, computed before the logits' token "
                          "slice, so it would need the rows the slice drops")  # fmt: skip
        rule = _rules.rule_for(node)
        if rule is None:
            raise NoMatch(f"{describe(node)} has no row-wise rule")
        out = val(node)
        kind = rule.kind
        if kind == "inplace":
            mutated = node.args[0]
            if not isinstance(mutated, torch.fx.Node) or mutated not in self.values:
                raise NoMatch(f"{describe(node)} writes into a tensor from outside the region")
            if len(mutated.users) != 1:
                raise NoMatch(
                    f"{describe(node)} changes the logits in place while other code also reads them"
                )
            return [self.elementwise(node, rule.out_of_place, out)]
        if kind == "elementwise":
            return [self.elementwise(node, node.target, out)]
        source = node.args[0] if node.args else None
        layout = self.layout_of(source)
        if layout is None or layout.kind in ("reduced", "tuple") and kind != "getitem":
            raise NoMatch(f"{describe(node)} does not take the logits as its first operand")
        if kind == "view":
            return [self.view(node, layout, out)]
        if kind == "vocab_reduction":
            return self.vocab_reduction(node, layout, out)
        if kind == "normalize":
            options = _rules.normalize_options(node)
            if layout.kind != "rows" or not _rules.is_vocab_dim(options["dim"], out.dim()):
                raise NoMatch(f"{describe(node)} is not taken over the vocabulary dimension")
            kwargs = (("dtype", options["dtype"]),) if options["dtype"] is not None else ()
            target = F.log_softmax if "log" in _rules.op_name(node) else F.softmax
            return [Classified(self.step(node, target, (Ref("value", self.values[source][0]), -1), kwargs),
                               layout)]  # fmt: skip
        if kind == "gather":
            return [self.gather(node, layout, out)]
        if kind == "getitem":
            if layout.kind != "tuple" or not isinstance(node.args[1], int):
                raise NoMatch(f"{describe(node)} slices the logits' token rows; that is not tiled in a "
                              "multi-output region yet")  # fmt: skip
            inner = Layout(layout.tokens[0], layout.tokens[1])
            step = self.step(node, operator.getitem, (Ref("value", self.values[source][0]), node.args[1]))
            return [Classified(step, inner)]
        if kind == "loss":
            return self.loss(node, layout)
        raise NoMatch(f"{describe(node)} has no row-wise rule")

    def elementwise(self, node, target, out) -> Classified:
        if not isinstance(out, torch.Tensor):
            raise NoMatch(f"{describe(node)} does not give a tensor")
        inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        layouts = [self.layout_of(a) for a in inputs if self.layout_of(a) is not None]
        kinds = {layout.kind for layout in layouts}
        if "reduced" in kinds or "tuple" in kinds or not layouts:
            raise NoMatch(f"{describe(node)} reads a value reduced over the tokens")
        if len(kinds) > 1 and kinds != {"rows", "tokens1"}:
            raise NoMatch(f"{describe(node)} combines per-token values of different layouts")
        kind = "rows" if "rows" in kinds else kinds.pop()
        tokens = layouts[0].tokens
        if any(not _same_shape(layout.tokens, tokens) for layout in layouts):
            raise NoMatch(f"{describe(node)} combines values with different token dimensions")
        layout = Layout(kind, tokens)
        part = _region.row_part(kind, self.vocab)
        if not _same_shape(tuple(out.shape), (*tokens, *part)):
            raise NoMatch(f"{describe(node)} changes the shape of the logits' rows")
        if out.device.type != self.device_type:
            raise NoMatch(f"{describe(node)} moves the logits to another device")
        if _rules.op_name(node) in ("to", "type") and any(
            isinstance(a, (torch.fx.Node, torch.device, str)) for a in node.args[1:]
        ):
            raise NoMatch(f"{describe(node)} casts with a device or a tensor; only a dtype cast is replayed")
        args = [self.operand(a, layout, node) for a in node.args]
        kwargs = [(k, self.operand(v, layout, node)) for k, v in node.kwargs.items()]
        return Classified(self.step(node, target, args, kwargs, node.op), layout)

    def view(self, node, layout: Layout, out) -> Classified:
        source = Ref("value", self.values[node.args[0]][0])
        if _rules.op_name(node) == "contiguous":
            return Classified(self.step(node, "contiguous", (source,), op="call_method"), layout)
        shape = tuple(out.shape)
        count = _numel(layout.tokens)
        if layout.kind == "rows":
            if not (shape and same(shape[-1], self.vocab) and same(_numel(shape[:-1]), count)):
                raise NoMatch(f"{describe(node)} reshapes across the vocabulary dimension")
            new = Layout("rows", shape[:-1])
        elif shape and same(shape[-1], 1) and same(_numel(shape[:-1]), count) and len(shape) > 1:
            new = Layout("tokens1", shape[:-1])
        elif same(_numel(shape), count):
            new = Layout("tokens", shape)
        else:
            raise NoMatch(f"{describe(node)} reshapes across the tokens")
        self._flat(new.tokens)
        part = _region.row_part(new.kind, self.vocab)
        return Classified(self.step(node, "reshape", (source, -1, *part), op="call_method"), new)

    def vocab_reduction(self, node, layout: Layout, out) -> list[Classified]:
        options = _rules.reduction_options(node)
        name = _rules.op_name(node)
        source = Ref("value", self.values[node.args[0]][0])
        dim = options["dim"]
        ndim = len(layout.tokens) + 1
        if layout.kind != "rows":
            raise NoMatch(f"{describe(node)} reduces over the tokens")
        if dim is None or dim == () or dim == []:
            if name not in ("sum", "mean") or options.get("dtype") is not None:
                raise NoMatch(f"{describe(node)} reduces over the tokens and the vocabulary at once")
            if val(node.args[0]).dtype not in (torch.float32, torch.float64):
                raise NoMatch(f"{describe(node)} sums half-precision logits over all tokens")
            step = self.step(node, "sum", (source, -1), op="call_method")
            how = ("sum",) if name == "sum" else ("div_elements", self.vocab)
            return [Classified(step, Layout("tokens", layout.tokens), after_tiles=how)]
        if not _rules.is_vocab_dim(dim, ndim):
            raise NoMatch(f"{describe(node)} reduces over the token dimensions")
        keepdim = bool(options["keepdim"])
        kwargs = (("dtype", options["dtype"]),) if options.get("dtype") is not None else ()
        inner = "tokens1" if keepdim else "tokens"
        result = (
            Layout("tuple", (inner, layout.tokens))
            if name in ("max", "min")
            else Layout(inner, layout.tokens)
        )
        return [Classified(self.step(node, name, (source, -1, keepdim), kwargs, op="call_method"), result)]

    def gather(self, node, layout: Layout, out) -> Classified:
        options = _rules.gather_options(node)
        if layout.kind != "rows" or not _rules.is_vocab_dim(options["dim"], len(layout.tokens) + 1):
            raise NoMatch(f"{describe(node)} does not gather along the vocabulary dimension")
        result = Layout("tokens1", layout.tokens)
        if not _same_shape(tuple(out.shape), (*layout.tokens, 1)):
            raise NoMatch(f"{describe(node)} gathers more than one id per token")
        index = self.operand(options["index"], result, node)
        if index.kind == "token":
            dim = options["dim"] % (len(layout.tokens) + 1)
            self.index_checks.append(
                (index.index, f"index {{}} is out of bounds for dimension {dim} with size {self.vocab}", None)
            )
        source = Ref("value", self.values[node.args[0]][0])
        return Classified(self.step(node, torch.gather, (source, -1, index)), result)

    def loss(self, node, layout: Layout) -> list[Classified]:
        options = _rules.loss_options(node)
        source = Ref("value", self.values[options["input"]][0])
        reduction = options["reduction"]
        if not isinstance(reduction, str) or reduction not in ("none", "sum", "mean", "batchmean"):
            raise NoMatch(f"{describe(node)} has reduction={reduction!r}")
        if layout.kind != "rows":
            raise NoMatch(f"{describe(node)} does not take [tokens, V] logits")
        if node.target is F.kl_div:
            target_layout = self.layout_of(options["target"])
            if target_layout is not None and target_layout.kind != "rows":
                raise NoMatch(f"{describe(node)} compares the logits with a value that is not [tokens, V]")
            target = self.operand(options["target"], layout, node)
            log_target = options["log_target"]
            if not isinstance(log_target, bool):
                raise NoMatch(f"{describe(node)} has a log_target that is not a constant")
            step = self.step(
                node, F.kl_div, (source, target), (("reduction", "none"), ("log_target", log_target))
            )
            if reduction == "none":
                return [Classified(step, layout)]
            how = {"sum": ("sum",), "mean": ("div_elements", self.vocab), "batchmean": ("div_first_dim",)}
            row_sum = self.step(node, "sum", (Ref("value", -1), -1), op="call_method")  # -1: the step before
            return [Classified(step, layout), Classified(row_sum, Layout("tokens", layout.tokens),
                                                         after_tiles=how[reduction])]  # fmt: skip
        if reduction == "batchmean":
            raise NoMatch(f"{describe(node)} has reduction='batchmean'")
        if len(layout.tokens) != 1:
            raise NoMatch(f"{describe(node)} takes [B, T, V] logits, whose class dimension is not the last")
        for name, kinds in (("ignore_index", int), ("label_smoothing", (int, float))):
            value = options.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise NoMatch(
                    f"{describe(node)} has a {name} that is not a compile-time constant ({value!r})"
                )
        target_node = options["target"]
        target_val = val(target_node)
        if target_val is None or self.layout_of(target_node) is not None:
            raise NoMatch(f"{describe(node)} takes a target computed from the logits")
        soft = target_val.is_floating_point()
        if soft and node.target is F.nll_loss:
            raise NoMatch("nll_loss takes class indices, not class probabilities")
        if not soft and target_val.dtype != torch.int64:
            raise NoMatch(f"{describe(node)} has a {target_val.dtype} target; eager expects int64")
        target = self.operand(target_node, Layout("rows" if soft else "tokens", layout.tokens), node)
        weight = options.get("weight")
        kwargs = [("ignore_index", options["ignore_index"]), ("reduction", "none")]
        if node.target is F.cross_entropy:
            kwargs.append(("label_smoothing", float(options["label_smoothing"])))
            if not 0.0 <= options["label_smoothing"] <= 1.0:
                raise NoMatch("label_smoothing is outside [0, 1]; eager raises for it")
        if weight is not None:
            weight_val = val(weight)
            if weight_val is None or weight_val.dim() != 1 or not same(weight_val.shape[0], self.vocab):
                raise NoMatch(f"{describe(node)} has class weights that are not a [V] tensor")
            kwargs.append(("weight", self.operand(weight, layout, node)))
        step = self.step(node, node.target, (source, target), kwargs)
        if not soft and target.kind == "token":
            self.index_checks.append((target.index, "Target {} is out of bounds.", options["ignore_index"]))
        how = None
        if reduction == "sum":
            how = ("sum",)
        elif reduction == "mean":
            how = ("div_tokens",) if soft else ("mean_valid", target_node, weight, options["ignore_index"])
        return [Classified(step, Layout("tokens", layout.tokens), after_tiles=how)]

    # ---------------------------------------------------------------- phases

    def walk(self) -> None:
        """Phase 2: every node that depends on the logits, in graph order."""
        self.depends = {self.projection}
        cone = {self.projection}  # reached from the logits without another projection between
        for node in self.graph.nodes:
            if node is self.projection or not any(a in self.depends for a in node.all_input_nodes):
                continue
            self.depends.add(node)
            if any(a in cone for a in node.all_input_nodes) and not _projection_like(node):
                cone.add(node)
                try:  # a loss-like op reading the logits, however far: this projection is a head
                    sign = node.target in _HEAD_SIGNS
                except TypeError:  # an unhashable target
                    sign = False
                read = val(node.args[0]) if node.args else None  # over this head's vocabulary
                self.head_signs |= sign and read is not None and same(read.shape[-1], self.vocab)
            if any(a in self.depends and a not in self.values for a in node.all_input_nodes):
                self.outside[node] = (
                    f"{describe(node)} reads a value computed from the logits outside the region"
                )
                continue
            if self.shard is not None and _no_op_redistribute(node):
                self.values[node] = self.values[node.args[0]]  # ColwiseParallel's output hook
                self.nodes.append(node)
                continue
            try:
                if self.token_slice(node):
                    self.nodes.append(node)
                    continue
                classified = self.classify(node)
            except NoMatch as why:
                self.outside[node] = str(why)
                continue
            for entry in classified:
                index = len(self.steps) + 1
                step = entry.step
                if step.args and step.args[0] == Ref("value", -1):  # a rule's second step reads its first
                    step = Step(step.op, step.target, (Ref("value", index - 1), *step.args[1:]), step.kwargs,
                                step.autocast, step.source)  # fmt: skip
                self.steps.append(step)
                self.step_layouts.append(entry.layout)
                self.values[node] = (index, entry.layout)
                per_token = frozenset(i for i, t in enumerate(self.token_inputs) if t.part in ((), (1,)))
                self.zeros[index] = _region.zero_where(step, self.zeros, per_token)
                if entry.after_tiles is not None:  # its readers see the reduced value
                    self.after[node] = (entry.after_tiles, entry.layout)
                    self.values[node] = (index, Layout("reduced", entry.layout.tokens))
            self.nodes.append(node)

    def collect_outputs(self) -> list[RegionOutput] | None:
        """Phase 3: the region values read outside the region; None if it holds no head."""
        if not self.head_signs:
            return None
        outputs = []
        for node, (index, layout) in self.values.items():
            users = [u for u in node.users if u not in self.values]
            if node in self.after:
                if users:
                    how, tile_layout = self.after[node]
                    outputs.append(RegionOutput(node, index, tile_layout, bool(val(node).requires_grad), how))
                continue
            if not users:
                continue
            if layout.kind == "tuple":
                raise NoMatch(f"{describe(node)} is used whole; take its values and indices apart first")
            if layout.kind == "rows":
                if node in self.pre_slice:  # before the token slice: returned whole, or dropped
                    if all(u.op == "output" for u in users):
                        if self.drop_rows and len(self.slices) == 1:
                            self.dropped.append(node)
                        else:  # the graph keeps computing them; the tiles run the sliced rows
                            self.kept_whole.append(node)
                        continue
                    raise NoMatch(
                        f"{describe(self.slice_nodes[0])} slices the logits' token rows while "
                        f"{describe(users[0])} reads them whole, so they must exist whole"
                    )
                if self.drop_rows and all(u.op == "output" for u in users) and not self.slices:
                    self.dropped.append(node)
                    continue
                blocking = [u for u in users if u.op != "output"]
                if blocking:
                    user = blocking[0]
                    detail = (
                        self.outside.get(user, "is not row-wise").removeprefix(describe(user)).strip(" ,:")
                    )
                    raise NoMatch(
                        f"the logits ({describe(node)}) are also consumed by {describe(user)}, "
                        f"which {detail}; "
                        "so they must exist whole"
                    )
            value = val(node)
            outputs.append(
                RegionOutput(node, index, layout, bool(value.requires_grad) and value.is_floating_point())
            )
        if not any(o.layout.kind != "rows" for o in outputs):
            return None
        for out in outputs:
            out.flat_tokens = self._flat(out.layout.tokens)
        return outputs

    def scalar_loss(self, outputs: list[RegionOutput]):
        """Phase 4: the token reductions that end the differentiable outputs in one scalar, if
        they are linear in them; ``(nodes, steps, sink, inputs)`` or None."""
        diff = [o for o in outputs if o.differentiable and o.layout.kind != "rows"]
        if not diff:
            return None
        env: dict[torch.fx.Node, Ref] = {}
        steps: list[Step] = []
        linear: set[torch.fx.Node] = set()  # depends on a differentiable output
        inputs: list[torch.fx.Node] = []
        hidden_ref = None

        def external(arg):
            nonlocal hidden_ref
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
            return Ref("reduce", inputs.index(arg))

        def hidden_input():  # for its token shape only
            nonlocal hidden_ref
            if hidden_ref is None:
                inputs.append(self.hidden)
                hidden_ref = Ref("reduce", len(inputs) - 1)
            return hidden_ref

        for k, out in enumerate(outputs):
            flat = out.flat_tokens
            if out.after_tiles is not None:
                how, *operands = out.after_tiles
                operands = [external(a) if isinstance(a, torch.fx.Node) else a for a in operands]
                steps.append(
                    self.step(
                        out.node, _after_tiles, (Ref("output", k), how, hidden_input(), flat, *operands)
                    )
                )
            else:
                steps.append(self.step(out.node, _restore, (Ref("output", k), hidden_input(), flat)))
            env[out.node] = Ref("value", len(steps) - 1)
            if out.differentiable:
                linear.add(out.node)
        nodes = []
        for node in self.graph.nodes:
            if node in env or not any(a in linear for a in node.all_input_nodes):
                continue
            try:
                step = self._linear_step(node, env, linear, external)
            except NoMatch:
                continue
            steps.append(step)
            env[node] = Ref("value", len(steps) - 1)
            linear.add(node)
            nodes.append(node)
        members = set(nodes) | {o.node for o in diff}
        sinks = [n for n in [o.node for o in diff] + nodes if any(u not in members for u in n.users)]
        if len(sinks) != 1:
            return None
        sink = sinks[0]
        sink_val = val(sink)
        if sink_val is None or sink_val.dim() != 0 or not sink_val.requires_grad:
            return None
        return nodes, steps, sink, inputs, env[sink].index

    def _linear_step(self, node, env, linear, external) -> Step:
        """A token reduction or combination linear in the differentiable outputs, as a step."""
        if _rules.rule_for(node) is None or node.op not in ("call_function", "call_method"):
            raise NoMatch("no rule")
        name = _rules.op_name(node).strip("_").removeprefix("i")
        dependent = [a for a in node.args if isinstance(a, torch.fx.Node) and a in linear]
        if any(isinstance(v, torch.fx.Node) and v in linear for v in node.kwargs.values()):
            raise NoMatch("keyword operand")
        if name in ("sum", "mean", "view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "neg",
                    "float", "double", "to", "type", "getitem"):  # fmt: skip
            if node.args[0] not in linear or len(dependent) != 1:
                raise NoMatch("not linear")
            if name in ("to", "type") and any(not isinstance(a, torch.dtype) for a in node.args[1:]):
                raise NoMatch("not a dtype cast")
        elif name in ("mul", "rmul"):
            if len(dependent) != 1:
                raise NoMatch("a product of two outputs")
        elif name in ("truediv", "div"):
            if (
                len(dependent) != 1
                or node.args[0] not in linear
                or node.kwargs.get("rounding_mode") is not None
            ):
                raise NoMatch("not linear")
        elif name not in ("add", "sub", "radd", "rsub"):
            raise NoMatch("not linear")
        if name.startswith("i") or (isinstance(node.target, str) and node.target.endswith("_")):
            raise NoMatch("in place")
        if any(isinstance(a, torch.fx.Node) and a in env and a not in linear for a in node.args):
            # a factor computed from the logits (argmax, a count of correct tokens): the token
            # weights, derived before the tiles run, would not know its value
            raise NoMatch("reads a non-differentiable output")
        args = [env[a] if isinstance(a, torch.fx.Node) and a in env else external(a) for a in node.args]
        kwargs = [(k, external(v)) for k, v in node.kwargs.items()]
        return self.step(node, node.target, args, kwargs, node.op)


def match_row_region(
    graph: torch.fx.Graph, projection: torch.fx.Node, autocast_states=None, drop_rows: bool = False
) -> RowRegion | None:
    """The row-wise region of ``projection``; None if it is not an LM head's; raises ``NoMatch``."""
    try:
        linear = as_linear(projection)
    except NoMatch:
        return None
    if linear is None:
        return None
    matcher = _Matcher(graph, projection, linear, autocast_states or _autocast_states(graph), drop_rows)
    try:
        matcher.walk()
        outputs = matcher.collect_outputs()
    except NoMatch as why:
        why.depends = matcher.depends  # the skip replaces the reports of the losses it holds
        raise
    if outputs is None:
        return None
    reduction = matcher.scalar_loss(outputs)
    steps_text = [matcher.head_form if matcher.autocast_dtype is None
                  else f"autocast({str(matcher.autocast_dtype)[6:]}) {matcher.head_form}"]  # fmt: skip
    for position, step in enumerate(matcher.steps):
        steps_text += ["slice tokens"] * matcher.slice_steps.count(position) + [step.describe()]
    in_loss, sink = (set(reduction[0]), reduction[2]) if reduction is not None else (set(), None)

    def zeros(o):  # where the output is zero whatever the logits: tokens the tiles may skip
        return matcher.zeros.get(o.value) if o.layout.kind != "rows" else None

    program_outputs = tuple(
        Output(o.value, o.layout.kind, val(o.node).dtype, o.differentiable and o.layout.kind != "rows",
               zeros=zeros(o),
               only_loss=o.node is sink or bool(in_loss) and all(u in in_loss for u in o.node.users))
        for o in outputs
    )  # fmt: skip
    reduction_program = None
    if reduction is not None:
        nodes, steps, sink, inputs, result = reduction
        reduction_program = ReductionProgram(tuple(steps), result, val(sink).dtype)
    steps, vocab_size, shard = tuple(matcher.steps), int(matcher.vocab), None
    if matcher.shard is not None:
        if any(o.layout.kind == "rows" for o in outputs):
            raise NoMatch("logits returned from a vocabulary-sharded head are not tiled in tensor-parallel "
                          "form yet")  # fmt: skip
        steps = tuple(_shard_program_steps(matcher))
        vocab_size = matcher.shard[2]
        shard = (matcher.shard[0], matcher.shard[1], int(matcher.vocab))
    program = _region.register(RowProgram(
        steps=steps,
        outputs=program_outputs,
        vocab_size=vocab_size,
        shard=shard,
        token_layouts=tuple(
            {(): "tokens", (1,): "tokens1"}.get(t.part, "rows") for t in matcher.token_inputs
        ),
        num_row_inputs=len(matcher.row_inputs),
        has_bias=matcher.bias is not None,
        index_checks=tuple(matcher.index_checks),
        reduction=reduction_program,
        form=" -> ".join(steps_text),
    ))  # fmt: skip
    region = RowRegion(
        projection=projection,
        hidden=matcher.hidden,
        weight=matcher.weight,
        bias=matcher.bias,
        autocast_dtype=matcher.autocast_dtype,
        nodes=[matcher.transpose, projection, *matcher.nodes] if matcher.transpose is not None
        else [projection, *matcher.nodes],
        token_inputs=matcher.token_inputs,
        row_inputs=matcher.row_inputs,
        outputs=outputs,
        program=program,
        steps_text=steps_text,
    )  # fmt: skip
    region.dropped = matcher.dropped
    region.kept_whole = matcher.kept_whole
    region.slices = matcher.slices
    region.num_tokens = matcher.num_tokens
    if reduction is not None:
        region.reduction_nodes, _, region.sink, region.reduce_inputs, _ = reduction
    return region


# ------------------------------------------------------------------------------ rewrite


def _to_hoist(graph: torch.fx.Graph, nodes, point: torch.fx.Node, autocast_states) -> list[torch.fx.Node]:
    """The op's inputs defined after ``point`` (its insertion point), in an order they can be
    moved before it: pure torch ops only, in the same autocast context as ``point``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moving: list[torch.fx.Node] = []

    def need(node):
        if not isinstance(node, torch.fx.Node) or order[node] < order[point] or node in moving:
            return
        if _rules.rule_for(node) is None and node.target != "expand":
            raise NoMatch(
                f"{describe(node)} is computed after the logits are first read and cannot be moved before "
                "the tiled region; compute it before the LM head"
            )
        if autocast_states.get(node, ()) != autocast_states.get(point, ()):
            raise NoMatch(
                f"{describe(node)} is computed in another autocast context than the region's first reader"
            )
        for arg in node.all_input_nodes:
            need(arg)
        moving.append(node)

    for node in nodes:
        need(node)
    return moving


def rewrite_row_region(
    graph: torch.fx.Graph,
    region: RowRegion,
    *,
    tile_tokens: int,
    compile_tiles: bool,
    result,
    autocast_states,
) -> str:
    """Replace the region by one call of :func:`tile_pass.tiled_region.run_region`; returns how
    returned rows were handled. Raises ``NoMatch`` before changing anything."""
    from tile_pass.tiled_region import run_region

    members = set(region.nodes) | set(region.reduction_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for n in members for u in n.users if u not in members]
    point = min(readers, key=order.__getitem__)
    inputs = [region.hidden, region.weight, region.bias, *[t.node for t in region.token_inputs],
              *[r.node for r in region.row_inputs], *region.reduce_inputs]  # fmt: skip
    torch.fx.node.map_arg(region.slices, inputs.append)  # symbolic slice bounds
    for node in _to_hoist(graph, inputs, point, autocast_states):
        point.prepend(node)

    economy = region.program.reduction is not None
    existing = set(graph.nodes)
    with graph.inserting_before(point):
        tokens = region.hidden  # the rows the tiles run: the hidden states after the token slices
        for index in region.slices:
            tokens = graph.call_function(operator.getitem, (tokens, index))
        hidden, weight, bias = tokens, region.weight, region.bias
        if region.autocast_dtype is not None:  # what autocast does to F.linear's inputs
            hidden, weight = (graph.call_method("to", (t, region.autocast_dtype)) for t in (hidden, weight))
            if bias is not None:
                bias = graph.call_method("to", (bias, region.autocast_dtype))
        token_nodes = [
            graph.call_function(_per_token, (t.node, tokens, t.flat_tokens, len(t.part)))
            for t in region.token_inputs
        ]
        row_nodes = [
            graph.call_method("reshape", (r.node, () if r.zero_dim else (-1,))) for r in region.row_inputs
        ]
        if region.program.shard is not None and hasattr(val(region.weight), "device_mesh"):  # DTensors
            from tile_pass._distributed import run_sharded_region as run_region
        call = graph.call_function(
            run_region,
            (
                hidden,
                weight,
                bias,
                token_nodes,
                row_nodes,
                [tokens if n is region.hidden else n for n in region.reduce_inputs],
            ),  # fmt: skip
            {"program": region.program.key, "tile_tokens": tile_tokens, "compile_tiles": compile_tiles},
        )
        offset = 1 if economy else 0
        restored = {}
        for k, out in enumerate(region.outputs):
            if economy and out.node is region.sink:  # the op's loss (below) replaces it
                continue
            flat = graph.call_function(operator.getitem, (call, k + offset))
            if out.after_tiles is not None:
                how, *operands = out.after_tiles
                value = graph.call_function(_after_tiles, (flat, how, tokens, out.flat_tokens, *operands))
            else:
                value = graph.call_function(_restore, (flat, tokens, out.flat_tokens))
            restored[out.node] = value
            out.node.replace_all_uses_with(value, delete_user_cb=lambda user: user not in members)
        if economy:
            loss = graph.call_function(operator.getitem, (call, 0))
            loss.meta.update(region.sink.meta)
            region.sink.replace_all_uses_with(loss)

    anchor = (region.sink or region.outputs[0].node).meta.get("stack_trace")
    for node in graph.nodes:  # the inserted nodes show the loss's line in dumps and traces
        if node not in existing and anchor and not node.meta.get("stack_trace"):
            node.meta["stack_trace"] = anchor
    handled = "not returned"
    if region.kept_whole:
        handled = (
            "returned whole, as the graph computes them (the caller asked for all of them); the loss "
            "tiles the sliced hidden states, so the loss's own float32 copy and gradient of the logits "
            "are not formed"
        )
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    returned = [o for o in region.outputs if o.layout.kind == "rows"]
    if returned or region.dropped:
        if result.num_outputs == 0:
            result.num_outputs = len(outputs)
        extra_base = len(outputs) - result.num_outputs
        extras: list[torch.fx.Node] = []
        for node in region.dropped:
            for position in [i for i, n in enumerate(outputs) if n is node]:
                outputs[position] = None
                result.returned_logits.append(ReturnedLogits(
                    position, [extra_base + len(extras)], None, val(region.weight).shape[0], val(node).dtype
                ))  # fmt: skip
                extras.append(region.hidden)
            handled = "dropped (drop_logits=True): a zero-byte NaN placeholder is returned"
        prefix_inputs = [hidden, weight, *([bias] if bias is not None else []), *token_nodes, *row_nodes]
        for out in returned:
            k = region.outputs.index(out)
            for position in [i for i, n in enumerate(outputs) if n is restored[out.node]]:
                if out.differentiable:
                    prefix = _ProgramPrefix(region.program, k, out.flat_tokens, region.bias is not None)
                    first = extra_base + len(extras)
                    result.returned_logits.append(
                        ReturnedLogits(position, list(range(first, first + len(prefix_inputs))), prefix)
                    )
                    extras += prefix_inputs
            handled = (
                "returned exactly, written by the tiles (no extra GEMM) in the dtype the graph returns, and "
                "its gradient is computed only if the caller uses it"
            )
        output.args = ((*outputs, *extras),)
    kept: set[torch.fx.Node] = set()  # the returned rows before a slice, and what they are computed from
    stack = list(region.kept_whole)
    while stack:
        node = stack.pop()
        if node in members and node not in kept:
            kept.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(members - kept, key=order.__getitem__, reverse=True):
        if node.users:
            raise RuntimeError(f"tile_pass: internal error, {describe(node)} is still read after the rewrite")
        graph.erase_node(node)
    return handled
