"""The matcher's state for one projection, and the operations every phase and rule shares: a
step with its autocast state, a step's operands (a region value, a per-token or shared input,
a constant), a step joining the program."""

from __future__ import annotations

import math
import operator
from dataclasses import replace

import torch
import torch.fx

from tile_pass.match import _fx, _rules
from tile_pass.match._fx import NoMatch, same, same_shape, source_line, val
from tile_pass.match._records import ProgramValue, RegionValue, RowInput, SliceMode, TokenInput
from tile_pass.match._rule_base import PREVIOUS_STEP, Classified, IndexCheck, Shape
from tile_pass.program import _region
from tile_pass.program._op_facts import RuleKind, spelling
from tile_pass.program._region import Layout, Ref, RefKind, Step, target_name
from tile_pass.program._row_selection import RowSelection

#: readers that have no rule for a reason the user can act on, and what to do
_CUSTOM_FUNCTION = (
    " (a custom autograd.Function: its backward is its author's, and tile_pass never replaces a "
    "backward by a derived one); fix: where its backward is the derivative of its forward, call the "
    "forward's torch ops directly so the gradient is derived, or apply it outside the compiled function"
)
_ORDERS_THE_ROW = (
    " (a top-k / top-p filter orders each token's whole vocabulary row, which no tile does); fix: a "
    "filter that only repeats the sampler's is skipped when sampling without top-k / top-p (NeMo-RL: "
    "top_k None, top_p 1.0), and the step is then tiled"
)
_NO_RULE_FIXES = {
    "autograd_function_apply": _CUSTOM_FUNCTION,
    **dict.fromkeys(("topk", "sort", "argsort", "kthvalue", "msort"), _ORDERS_THE_ROW),
}


def writes_in_place(node: torch.fx.Node) -> bool:
    """``x[a:b] = v``, ``x.copy_(v)``: a write into the memory of the node's first argument."""
    if (
        node.op not in ("call_function", "call_method")
        or not node.args
        or not isinstance(node.args[0], torch.fx.Node)
    ):
        return False
    spelled = spelling(node.target)
    return node.target is operator.setitem or (spelled is not None and spelled.inplace)


def memory(node: torch.fx.Node) -> int | None:
    """The memory a node's value lives in, from Dynamo's example value (views share it)."""
    try:
        return val(node).untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


class RegionMatcher:
    """What is known of one projection's region while the phases run (:mod:`._region_match`);
    the rules (:mod:`tile_pass.match._rules`) read its values and add its operands through the
    methods below."""

    def __init__(
        self, graph: torch.fx.Graph, projection: torch.fx.Node, linear, autocast_states, drop_rows: bool,
        slice_mode: SliceMode = SliceMode.MOVED, excluded=(), shard: tuple[str, int, int] | None = None,
    ):  # fmt: skip
        self.graph, self.projection, self.autocast_states = graph, projection, autocast_states
        self.hidden, self.weight, self.bias, self.transpose, self.head_form = linear
        self.bias_added = False  # the bias is an add after the matmul (bias_after), not F.linear's
        self.drop_rows = drop_rows
        self.slice_mode = slice_mode
        self.excluded = set(excluded)  # partner heads whose logits no region value combines
        hidden_val, weight_val, out_val = val(self.hidden), val(self.weight), val(projection)
        if hidden_val is None or weight_val is None or out_val is None or weight_val.dim() != 2:
            raise NoMatch("the projection's inputs carry no shape information")
        self.shard = shard  # (group name, first row, rows) of a vocabulary-sharded head
        self.vocab, hidden_size = weight_val.shape
        if not same(hidden_val.shape[-1], hidden_size) or not same(out_val.shape[-1], self.vocab):
            raise NoMatch("the hidden states do not match the LM-head weight")
        if not out_val.is_floating_point():
            raise NoMatch("the logits are not floating point")
        self.device_type = out_val.device.type
        # the autocast state the graph is compiled under (AOTAutograd traces it under this too)
        ambient_dtype = _fx.autocast_dtype(self.device_type)
        self.ambient = None if ambient_dtype is None else (self.device_type, ambient_dtype)
        self.hidden_tokens = tuple(hidden_val.shape[:-1])  # the tokens the tiles run (after the slices)
        self.autocast_dtype = self._autocast_dtype(hidden_val, weight_val, out_val)
        logits = ProgramValue(0, None, Shape(Layout.ROWS, self.hidden_tokens))
        self.program: list[ProgramValue] = [logits]  # value i is program[i]; the steps after it: the program
        self.values: dict[torch.fx.Node, RegionValue] = {projection: RegionValue(logits, logits.shape)}
        self.outside: dict[torch.fx.Node, NoMatch] = {}  # node that depends on the logits -> why not row-wise
        self.token_inputs: list[TokenInput] = []
        self.row_inputs: list[RowInput] = []
        self.index_checks: list[IndexCheck] = []
        self.head_signs = False
        self.slices: list[tuple] = []  # token selections moved onto the hidden states, in order
        self.slice_steps: list[int] = []  # per slice, the first program value after it
        #: other heads' projections whose tiles the region computes -> their transpose, if only theirs
        self.partners: dict[torch.fx.Node, torch.fx.Node | None] = {}
        self.partner_inputs: list = []  # the partner heads' hidden states, weights and biases
        self.selections: list[tuple[RowSelection, tuple]] = []  # (the rows, their token dims)
        self.saw_selection = False  # a chunk/split/narrow of the rows: the second pass may take it
        self.depends: set[torch.fx.Node] = {projection}  # the nodes computed from the logits
        #: memory -> the first in-place write of values computed from the logits into it
        self.written: dict[int, torch.fx.Node] = {}
        self.left_to_graph: set[torch.fx.Node] = set()  # returned views of returned rows (collect_outputs)
        self.last_added = 0  # the program value the last step added (or found) is

    @property
    def num_tokens(self):
        """How many tokens the tiles run (after the token slices)."""
        return math.prod(self.hidden_tokens)

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

    def flat_tokens(self, tokens: tuple, node: torch.fx.Node, selection: int | None) -> bool:
        """Whether the token shape of ``node``'s value, computed on the row selection
        ``selection`` (``None``: all rows), is the flattened [N] (else it must be the hidden
        states', or the selection's)."""
        grid = self.hidden_tokens if selection is None else self.selections[selection][1]
        if same_shape(tokens, grid):
            return False
        if len(tokens) == 1 and same(tokens[0], math.prod(grid)):
            return True
        raise NoMatch("the logits' token dimensions are regrouped into {}", tuple(tokens), node=node)

    def selection_of(self, node: torch.fx.Node) -> int | None:
        """The row selection the region values ``node`` reads were computed on (``None``: all rows)."""
        found = {self.values[a].selection for a in node.all_input_nodes if a in self.values}
        if len(found) > 1:
            raise NoMatch("{} combines values of different selections of the token rows (in the tiles, row i "
                          "of one is not row i of the other); fix: reduce each selection over the vocabulary "
                          "first (a log-sum-exp, a gathered log-prob) and combine those per-token values",
                          node)  # fmt: skip
        return found.pop() if found else None

    def shape_of(self, arg) -> Shape | None:
        """The shape of a region value; None for anything else."""
        return self.values[arg].shape if isinstance(arg, torch.fx.Node) and arg in self.values else None

    def value_ref(self, arg: torch.fx.Node) -> Ref:
        return Ref(RefKind.VALUE, self.values[arg].value.index)

    def join(self, node: torch.fx.Node, value: ProgramValue, shape: Shape, **facts) -> None:
        """``node`` joins the region as ``value`` (its record: see :class:`RegionValue`)."""
        self.values[node] = RegionValue(value, shape, sliced=len(self.slices), **facts)

    def before_slice(self, node: torch.fx.Node) -> bool:
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
        writer = self.written.get(memory(arg)) if memory(arg) is not None else None
        if writer is not None:  # a buffer the region's own values were written into (chunk by chunk)
            raise NoMatch(
                "{} reads {}, which {} wrote values computed from the logits into", node, arg, writer
            )
        value = arg.meta.get("example_value", arg.meta.get("val"))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NoMatch("{} uses a dynamic scalar; keep it a Python constant", node)
        if not isinstance(value, torch.Tensor):
            raise NoMatch("{} takes {}, which is not a tensor", node, arg)
        return self.side_input(arg, value, out, node, self.selection_of(node))

    def side_input(self, arg, value: torch.Tensor, out: Shape, node, selection: int | None) -> Ref:
        """``arg``, a tensor from outside the region that ``node`` (computed on the row selection
        ``selection``) reads: shared by every row, or per token."""
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
            row = RowInput(arg, value.dim() == 0, differentiable=differentiable)  # equal: of the same node
            if row not in self.row_inputs:
                self.row_inputs.append(row)
            return Ref(RefKind.ROW, self.row_inputs.index(row))
        if not all(same(s, 1) or same(s, t) for s, t in zip(tokens, out.tokens, strict=True)):
            raise NoMatch("{} combines the logits with {} of shape {}, which is not one value per token",
                          node, arg, tuple(value.shape))  # fmt: skip
        if not per_token and part and not same(part[0], 1):
            raise NoMatch("{} broadcasts {} over tokens into [N, V] rows", node, arg)
        part = tuple(1 if same(p, 1) else self.vocab for p in part)
        subset = None if selection is None else self.selections[selection][0]
        entry = TokenInput(arg, part, self.flat_tokens(out.tokens, node, selection), subset, differentiable)
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

    def classify(self, node: torch.fx.Node) -> list[Classified]:
        """The node's steps by the rule registered for its op; ``NoMatch`` if it has none."""
        before = [a for a in node.all_input_nodes if self.before_slice(a)]
        if before:
            raise NoMatch("{} reads {}, computed before the logits' token slice, so it would need the rows "
                          "the slice drops", node, before[0])  # fmt: skip
        rule = _rules.rule_for(node)
        if rule is None:
            raise NoMatch("{} has no row-wise rule{}", node, _NO_RULE_FIXES.get(target_name(node.target), ""))
        return rule.classify(self, node)

    # ---------------------------------------------------------------- the program

    def no_gradient_through(self, node: torch.fx.Node) -> None:
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
        self.add(node, Classified(step, record.shape), RuleKind.ELEMENTWISE, record.selection)

    def add(self, node: torch.fx.Node, entry: Classified, kind: RuleKind | None = None, selection=None):
        """A step of ``node`` joins the program; its readers see its value (reduced, if it is). On a
        selection of the rows, a step the program already has (the same op on the same values: each
        chunk of a chunked loop) is not repeated: the tiles compute it once for every row."""
        step = entry.step
        if step.args and step.args[0] == PREVIOUS_STEP:
            step = replace(step, args=(Ref(RefKind.VALUE, self.last_added), *step.args[1:]))
        kind = kind or _rules.rule_for(node).kind
        value = None if selection is None else self._known(step, entry.shape, kind)
        if value is None:
            # a per-token input that is differentiated is no zero condition: d(mask * x)/d mask is x
            per_token = frozenset(
                i for i, t in enumerate(self.token_inputs)
                if t.part in ((), (1,)) and not getattr(val(t.node), "requires_grad", False)
            )  # fmt: skip
            zeros = _region.zero_where(step, dict(enumerate(v.zeros for v in self.program)), per_token)
            value = ProgramValue(len(self.program), step, entry.shape, kind, zeros)
            self.program.append(value)
        self.last_added = value.index
        if entry.index_check is not None:  # a per-token index the tiles check as eager does
            self.index_checks.append(entry.index_check)
        after = entry.after_tiles
        shape = entry.shape if after is None else Shape(Layout.REDUCED, entry.shape.tokens)
        self.join(node, value, shape, selection=selection, after_tiles=after)

    def _known(self, step: Step, shape: Shape, kind: RuleKind) -> ProgramValue | None:
        """A program value computed by the same step (the same op on the same values; its own
        line aside) in the same layout: a tile's value (each node keeps its own token dims)."""
        for value in self.program[1:]:
            if value.kind is not kind or (value.shape.layout, value.shape.item) != (shape.layout, shape.item):
                continue
            try:
                if replace(value.step, source=step.source) == step:
                    return value
            except RuntimeError:  # a tensor constant among the arguments: not compared
                continue
        return None
