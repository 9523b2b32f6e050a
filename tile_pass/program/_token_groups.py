"""Which tokens a nonlinear scalar loss couples: the groups a tile must hold whole.

A loss that is nonlinear in the region's per-token outputs (DPO's ``logsigmoid`` of a margin of
per-sequence sums) has a gradient at a token that depends on other tokens' outputs, so the
tiles cannot form it in forward from token weights derived in advance. But it usually couples
only a few tokens: DPO couples the tokens of one chosen sequence with those of its rejected
partner, and nothing else. If every tile holds whole groups of coupled tokens, the gradient of
the loss at a tile's tokens depends on that tile's outputs alone (it is ``d loss / d output``
evaluated with any values at the other tokens), so each tile forms its share of the gradient in
forward after all: one logits GEMM per token instead of two.

:func:`token_groups` finds the groups from the reduction itself: it is traced to aten at the
batch's sizes and interpreted on token ids instead of values. A view or slice moves ids as it
moves values; an op whose derivative depends on the values of two or more tokens (a product of
two outputs, ``logsigmoid`` of a sum over a sequence, a ``max``) joins their tokens into one
group; an op whose derivative is constant (a sum, a mean, an add, a product with a constant)
joins nothing, unless its result reaches such a nonlinear op. Any op it has no rule for ends
the analysis (the caller then runs the tiles twice). The rules state which aten ops have
constant derivatives, never what those derivatives are.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from tile_pass._caches import BoundedCache, on_tracing_thread, shapes_of
from tile_pass._logging import log
from tile_pass.program import _region
from tile_pass.program._operands import RegionOperands

aten = torch.ops.aten

#: values that move elements without combining them: ``op(ids, *args)`` moves the ids alike
_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
    aten.select.int, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default,
    aten.expand.default, aten.permute.default, aten.t.default, aten.transpose.int, aten.alias.default,
    aten.clone.default, aten.detach.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.narrow.default, aten.lift_fresh_copy.default, aten.flatten.using_ints,
    aten._to_copy.default, aten.contiguous.default, aten.index_select.default, aten.gather.default,
    aten.index.Tensor, aten.diagonal.default, aten.flip.default, aten.roll.default,
}  # fmt: skip
#: ops with constant derivatives in their first operand (dtype casts included: their derivative
#: is a cast back, whatever the value)
_LINEAR_FIRST = {aten._to_copy.default, aten.neg.default, aten.clone.default, aten.alias.default}
#: sums and differences: constant derivatives in every operand
_TERMS = {
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor, aten.rsub.Scalar,
}  # fmt: skip
#: moves whose later operands pick the elements (an index)
_PICKS = {aten.index_select.default, aten.gather.default, aten.index.Tensor}
#: reductions with constant derivatives
_LINEAR_REDUCTIONS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
#: reductions (or normalizations) along dims whose derivative depends on the values
_NONLINEAR_REDUCTIONS = {
    aten.amax.default, aten.amin.default, aten.logsumexp.default, aten.prod.default, aten.prod.dim_int,
    aten.max.default, aten.min.default, aten.max.dim, aten.min.dim, aten.std.correction, aten.var.correction,
    aten._softmax.default, aten._log_softmax.default, aten.linalg_vector_norm.default, aten.cumsum.default,
    aten.cumprod.default, aten.var_mean.correction, aten.std_mean.correction,
}  # fmt: skip
#: elementwise ops that return a tuple of same-shaped values
_ELEMENTWISE_TUPLES = {aten.log_sigmoid_forward.default}

_PLACEMENT = ("dtype", "layout", "device", "memory_format")  # a cast's: ids stay int64 on the CPU
_UNUSED = -2  # ids of a value nothing nonlinear reads: not tracked
_CONSTANT = -1  # an element that depends on no token


class _Classes:
    """Union-find over the tokens."""

    def __init__(self, size: int):
        self.parent = list(range(size))

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[M, K]``: the tokens of each row joined into one class; each row's class (or
        ``_CONSTANT`` for a row of constants). Raises ``_Unknown`` on an untracked id."""
        if ids.numel() and int(ids.min()) == _UNUSED:
            raise _Unknown("an untracked value reaches a nonlinear op")
        roots = []
        for row in ids.tolist():
            root = _CONSTANT
            for token in row:
                if token < 0:
                    continue
                token = self.find(token)
                if root < 0:
                    root = token
                elif token != root:
                    self.parent[token] = root
            roots.append(root)
        return torch.tensor(roots, dtype=torch.int64)

    def roots(self) -> torch.Tensor:
        return torch.tensor([self.find(i) for i in range(len(self.parent))], dtype=torch.int64)


class _Unknown(Exception):
    """The reduction holds an op the analysis has no rule for."""


_cache = BoundedCache("coupled token groups", 256)


def token_groups(
    program: _region.RowProgram, outputs: list[torch.Tensor], operands: RegionOperands
) -> torch.Tensor | None:
    """``[N]`` int64: tokens with the same value are coupled by the loss (its gradient at one
    depends on the other's outputs), tokens with different values are not; ``None`` when the
    reduction holds an op this analysis has no rule for. ``outputs`` stand for their shapes only.
    Decided once per program and sizes."""
    inputs = _region.reduction_inputs(operands)

    def decide() -> torch.Tensor | None:
        try:
            return _analyse(program, outputs, inputs)
        except _Unknown as why:
            log.debug("the tokens %s's loss couples are unknown (%s): tiles run twice", program.key, why)
            return None

    return _cache.decided((program.key, shapes_of([*outputs, *inputs])), decide)


def _analyse(program, outputs, inputs) -> torch.Tensor:
    """The groups, from the loss traced on ``outputs`` and ``inputs`` (its other inputs, flat)."""
    return _interpreted(_traced(program, outputs, inputs), outputs, inputs).classes.roots()


def _traced(program, outputs, inputs) -> torch.fx.GraphModule:
    """The reduction traced to aten at these sizes (fake tensors: no data-dependent Python)."""
    reduction = program.reduction
    num_outputs = len(outputs)
    device_type = outputs[0].device.type

    def loss(*args):
        operands = _region.reduction_operands(args[num_outputs:])
        return _region.run_reduction(reduction, list(args[:num_outputs]), operands, device_type)

    try:
        # functionalized: a write in place (``margin += ...``) is traced as the op it replays
        pure = torch.func.functionalize(loss, remove="mutations")
        return on_tracing_thread(lambda: make_fx(pure, tracing_mode="fake")(*outputs, *inputs))
    except Exception as why:  # data-dependent Python: no graph to read
        raise _Unknown(f"not traceable: {why}") from None


def _interpreted(graph: torch.fx.GraphModule, outputs, inputs) -> _Interpreter:
    """The traced reduction run on token ids: its classes joined, each value's ids kept."""
    interpreter = _Interpreter(graph.graph, outputs[0].shape[0], outputs, inputs)
    try:
        interpreter.run()
    except _Unknown:
        raise
    except Exception as why:  # an op's ids could not be formed as its values are: no groups
        raise _Unknown(f"{type(why).__name__}: {why}") from None
    return interpreter


class _Interpreter:
    """Runs the traced reduction on token ids (the outputs' elements) and on the constant
    inputs' values (an index a ``gather`` reads must be known)."""

    def __init__(self, graph: torch.fx.Graph, num_tokens: int, outputs, inputs):
        self.graph = graph
        self.classes = _Classes(num_tokens)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.ids: dict[torch.fx.Node, object] = {}
        self.values: dict[torch.fx.Node, object] = {}
        tokens = torch.arange(num_tokens)
        for node, out in zip(placeholders, outputs, strict=False):
            self.ids[node] = tokens.view(-1, *([1] * (out.dim() - 1))).expand(out.shape)
        for node, value in zip(placeholders[len(outputs) :], inputs, strict=True):
            self.values[node] = value
        self.merging = self._merging()

    def _tracked(self, arg) -> bool:
        return isinstance(arg, torch.fx.Node) and arg in self.ids

    def _merging(self) -> set[torch.fx.Node]:
        """The nodes whose ids must be exact: every value a nonlinear op reads, and every value
        those are computed from by ops that combine elements linearly."""
        tracked: set[torch.fx.Node] = set(self.ids)
        for node in self.graph.nodes:
            if node.op == "call_function" and any(a in tracked for a in node.all_input_nodes):
                tracked.add(node)
        merging: set[torch.fx.Node] = set()
        for node in reversed(self.graph.nodes):
            if node not in tracked or node.op != "call_function":
                continue
            if node in merging or not self._linear(node, tracked):
                merging.update(a for a in node.all_input_nodes if a in tracked)
        return merging

    @staticmethod
    def _linear(node: torch.fx.Node, tracked) -> bool:
        target = node.target
        if target is operator.getitem or target in _MOVES or target in _LINEAR_REDUCTIONS or target in _TERMS:
            return target not in _PICKS or not any(a in tracked for a in node.all_input_nodes[1:])
        dependent = [a for a in node.args if isinstance(a, torch.fx.Node) and a in tracked]
        if target in _LINEAR_FIRST:
            return True
        if target in (aten.mul.Tensor, aten.mul.Scalar):
            return len(dependent) == 1
        if target in (aten.div.Tensor, aten.div.Scalar):
            return dependent == [node.args[0]] and "rounding_mode" not in node.kwargs
        if target is aten.where.self:
            return node.args[0] not in tracked
        return False

    def run(self) -> torch.Tensor:
        for node in self.graph.nodes:
            if node.op == "call_function":
                if any(self._tracked(a) for a in node.all_input_nodes):
                    self.ids[node] = self._ids(node)
                else:
                    self.values[node] = self._evaluate(node)
        return self.classes.roots()

    def _evaluate(self, node):
        """A constant node's value (it reads no output)."""
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self.values[a])
        return node.target(*args, **kwargs)

    def _ids(self, node: torch.fx.Node):
        target, shape = node.target, _shape(node)
        if getattr(getattr(target, "_schema", None), "is_mutable", False):  # ids move as values, not in place
            raise _Unknown(f"{target} writes in place")
        if target is operator.getitem:
            return self.ids[node.args[0]][node.args[1]]
        merge = node in self.merging or not self._linear(node, set(self.ids))
        if target in _MOVES:
            if any(self._tracked(a) for a in node.all_input_nodes[1:]):
                raise _Unknown(f"{target} picks elements by an index computed from the outputs")
            args, kwargs = torch.fx.node.map_arg(
                (node.args, node.kwargs), lambda a: self.ids[a] if a in self.ids else _on_cpu(self.values[a])
            )
            kwargs = {k: v for k, v in kwargs.items() if k not in _PLACEMENT}
            if target is aten._to_copy.default:
                return args[0]
            if target in (aten.view.default, aten._unsafe_view.default):  # ids need not share strides
                return aten.reshape.default(*args, **kwargs)
            return target(*args, **kwargs)
        if target in (aten.cat.default, aten.stack.default):
            parts = [self.ids.get(a, torch.full(_shape(a), _CONSTANT)) for a in node.args[0]]
            return target(parts, *node.args[1:])
        if target in _LINEAR_REDUCTIONS or target in _NONLINEAR_REDUCTIONS:
            return self._reduced(node, shape, merge)
        if _elementwise(target):
            if target in _ELEMENTWISE_TUPLES:
                shape = shape[0]
            operands = [a for a in (*node.args, *node.kwargs.values()) if self._tracked(a)]
            if len(operands) == 1 or not merge:
                only = torch.broadcast_to(self.ids[operands[0]], shape) if merge else None
                ids = only if only is not None else torch.full(shape, _UNUSED)
            else:
                stacked = torch.stack([torch.broadcast_to(self.ids[a], shape) for a in operands], -1)
                ids = self.classes.join_rows(stacked.reshape(-1, len(operands))).view(shape)
            return (ids, ids) if target in _ELEMENTWISE_TUPLES else ids
        raise _Unknown(f"no rule for {target}")

    def _reduced(self, node, shape, merge: bool):
        """A reduction's ids: its elements' tokens joined (a linear one's only where a nonlinear op
        reads it); a normalization (softmax) keeps its input's shape, every element the row's."""
        source = self.ids[node.args[0]]
        if not merge:
            return torch.full(shape, _UNUSED)
        dims = node.kwargs.get("dim")
        if len(node.args) > 1 and node.target not in (aten.std.correction, aten.var.correction):
            dims = node.args[1]
        if isinstance(dims, int):
            dims = [dims]
        if not dims:
            dims = list(range(source.dim()))
        dims = sorted(d % max(source.dim(), 1) for d in dims)
        kept = [d for d in range(source.dim()) if d not in dims]
        moved = source.permute(*kept, *dims) if source.dim() else source.reshape(1)
        rows = moved.reshape(-1, max(1, _numel(source.shape, dims)))
        roots = self.classes.join_rows(rows)
        kept_shape = [source.shape[d] for d in kept]
        if node.target in (aten._softmax.default, aten._log_softmax.default, aten.cumsum.default,
                           aten.cumprod.default):  # fmt: skip
            reduced_shape = [source.shape[d] for d in dims]
            full = roots.view(*kept_shape, *[1] * len(dims)).expand(*kept_shape, *reduced_shape)
            inverse = [0] * source.dim()
            for position, d in enumerate([*kept, *dims]):
                inverse[d] = position
            return full.permute(*inverse)
        roots = roots.view(kept_shape) if kept_shape else roots.reshape(())
        if node.target in (aten.max.dim, aten.min.dim, aten.var_mean.correction, aten.std_mean.correction):
            return (roots.view(_shape(node)[0]), roots.view(_shape(node)[0]))
        return roots.view(shape) if isinstance(shape, tuple) else roots


def _elementwise(target) -> bool:
    if target in _ELEMENTWISE_TUPLES or target in _TERMS or target in _LINEAR_FIRST:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _on_cpu(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _numel(shape, dims) -> int:
    count = 1
    for d in dims:
        count *= shape[d]
    return count


def _shape(node: torch.fx.Node):
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return tuple(tuple(v.shape) for v in value)
    if value is None:
        raise _Unknown(f"{node} has no shape")
    return tuple(value.shape)
