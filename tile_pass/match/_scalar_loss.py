"""The scalar loss: when the region's differentiable outputs reach exactly one scalar through
token reductions linear in them (or, failing that, through rule-known ops whose other inputs
need no gradient), those nodes join the op, which then forms the whole gradient in forward
(:mod:`tile_pass.tiles.tiled_region`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from tile_pass.match import _rules
from tile_pass.match._fx import val
from tile_pass.match._matcher import RegionMatcher
from tile_pass.match._records import RegionOutput
from tile_pass.program._op_facts import FACTS, Linear, spelling
from tile_pass.program._region import Layout, Ref, RefKind, Step, target_name
from tile_pass.program._row_selection import selected_tokens
from tile_pass.program._token_layout import after_tiles, restore, select


@dataclass(frozen=True)
class ScalarLoss:
    """The nodes that end the region's differentiable outputs in one scalar, as the op's steps."""

    nodes: list[torch.fx.Node]  # the graph nodes that join the op
    #: the steps that give the outputs as the graph has them (selected back, token reductions
    #: finished), then one per node
    steps: tuple[Step, ...]
    sink: torch.fx.Node  # the scalar loss
    inputs: list[torch.fx.Node]  # what the steps read from outside: the hidden states first
    result: int  # the step whose value is the loss
    linear: bool  # linear in the outputs: its gradient does not depend on them


def scalar_loss(matcher: RegionMatcher, outputs: list[RegionOutput]) -> ScalarLoss | None:
    """The token reductions that end the differentiable outputs in one scalar, or None (the op
    then derives the gradient in backward). Reductions linear in the outputs are taken first
    (their gradient does not depend on the outputs); otherwise any reduction of rule-known ops
    whose other inputs need no gradient (the loop then evaluates that gradient at the outputs)."""
    for linear in (True, False):
        found = _scalar_loss(matcher, outputs, linear)
        if found is not None:
            return found
    return None


class _NotAnOperand(Exception):
    """An argument the loss may not read: a dynamic scalar, a value computed from the logits
    outside it, a tensor that needs a gradient (control flow: the node stays out of the loss)."""


class _LossOperands:
    """What the loss's steps read: a value computed in it (``env``), a constant, or a tensor
    from outside the region that needs no gradient (``inputs``, the hidden states first: for
    their token shape only)."""

    def __init__(self, matcher: RegionMatcher):
        self.depends = matcher.depends
        self.env: dict[torch.fx.Node, Ref] = {}
        self.inputs: list[torch.fx.Node] = [matcher.hidden]

    def __call__(self, arg):
        if isinstance(arg, (list, tuple)):  # torch.cat's tensors
            return type(arg)(self(a) for a in arg)
        if not isinstance(arg, torch.fx.Node):
            if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise _NotAnOperand
            return arg
        if arg in self.env:
            return self.env[arg]
        value = val(arg)
        if arg in self.depends or value is None or value.requires_grad:
            raise _NotAnOperand
        if arg not in self.inputs:
            self.inputs.append(arg)
        return Ref(RefKind.REDUCE, self.inputs.index(arg))


def _scalar_loss(
    matcher: RegionMatcher, outputs: list[RegionOutput], linear_only: bool, only: set | None = None, sink=None
) -> ScalarLoss | None:
    diff = [o for o in outputs if o.differentiable and o.shape.layout is not Layout.ROWS]
    if not diff:
        return None
    operands, steps = _LossOperands(matcher), []
    try:
        for k, out in enumerate(outputs):
            steps.extend(_restored(matcher, out, Ref(RefKind.OUTPUT, k), len(steps), operands))
            operands.env[out.node] = Ref(RefKind.VALUE, len(steps) - 1)
    except _NotAnOperand:  # labels or class weights computed from the logits
        return None
    nodes = _loss_nodes(matcher, outputs, linear_only, only, operands, steps)
    if sink is None:
        sink = _sink(nodes, outputs, diff)
        if sink is None:
            return None
        needed = _ancestors(sink, set(nodes), {o.node for o in outputs})
        if only is None and len(needed) < len(nodes):  # again with the nodes the loss reads only
            return _scalar_loss(matcher, outputs, linear_only, only=needed, sink=sink)
    # (given a sink: the second pass, over the nodes the loss is computed from)
    return ScalarLoss(nodes, tuple(steps), sink, operands.inputs, operands.env[sink].index, linear_only)


def _loss_nodes(
    matcher: RegionMatcher, outputs: list[RegionOutput], linear_only: bool, only: set | None,
    operands: _LossOperands, steps: list[Step],
) -> list[torch.fx.Node]:  # fmt: skip
    """The nodes, in graph order, that depend on a differentiable output (and, when
    ``linear_only``, linearly) and read nothing else from the logits; their steps join ``steps``."""
    env = operands.env
    dependent = {o.node for o in outputs if o.differentiable or not linear_only}
    nodes = []
    for node in matcher.graph.nodes:
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
            args = [operands(a) for a in node.args]
            kwargs = [(k, operands(v)) for k, v in node.kwargs.items()]
        except _NotAnOperand:  # it reads the logits otherwise, or a tensor that needs a gradient
            continue
        steps.append(matcher.step(node, node.target, args, kwargs, node.op))
        env[node] = Ref(RefKind.VALUE, len(steps) - 1)
        dependent.add(node)
        nodes.append(node)
    return nodes


def _sink(
    nodes: list[torch.fx.Node], outputs: list[RegionOutput], diff: list[RegionOutput]
) -> torch.fx.Node | None:
    """The loss: the one reduction node read outside them, or an output itself (a folded mean
    cross entropy); a 0-d value that needs a gradient. Another output may be read outside too (a
    metric of the logits, per-token log-probs returned): it stays differentiable, its gradient a
    re-run of the tiles in backward where one arrives."""
    members = set(nodes) | {o.node for o in outputs}
    read_outside = [n for n in nodes if any(u not in members for u in n.users)]
    # values that need no gradient read outside too (DPO's detached rewards): the graph keeps
    # computing them from the op's outputs
    sinks = [n for n in read_outside if getattr(val(n), "requires_grad", True)]
    sinks = sinks or [o.node for o in diff if any(u not in members for u in o.node.users)]
    sink_val = val(sinks[0]) if len(sinks) == 1 else None
    if sink_val is None or sink_val.dim() != 0 or not sink_val.requires_grad:
        return None
    return sinks[0]


def _restored(
    matcher: RegionMatcher, out: RegionOutput, read: Ref, first: int, operands: _LossOperands
) -> list[Step]:
    """The steps (numbered from ``first``) giving output ``read`` as the graph has it: the
    selection's rows of what the tiles computed on all rows, and its token reduction finished."""
    steps, rows, hidden = [], Ref(RefKind.REDUCE, 0), Ref(RefKind.REDUCE, 0)
    if out.subset is not None:
        steps.append(matcher.step(out.node, select, (read, hidden, out.subset)))
        steps.append(matcher.step(out.node, selected_tokens, (hidden, out.subset)))
        read, rows = Ref(RefKind.VALUE, first), Ref(RefKind.VALUE, first + 1)
    if out.after_tiles is None:
        return [*steps, matcher.step(out.node, restore, (read, rows, out.flat_tokens))]
    args = (
        read,
        out.after_tiles.how,
        rows,
        out.flat_tokens,
        *(operands(a) for a in out.after_tiles.operands),
    )
    return [*steps, matcher.step(out.node, after_tiles, args)]


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
    """Whether ``node`` may join a nonlinear scalar loss: an op with a rule or one that
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
    """Whether ``node`` is linear in the values of ``linear`` it reads, by its op's
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
