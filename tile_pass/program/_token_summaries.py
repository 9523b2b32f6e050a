"""Summaries linear in the tokens' outputs: the gradient of a coupled group that spans tiles.

DPO reads the tokens' log-probabilities only through sums per sequence, combined linearly into
one margin per pair, before its nonlinearity (``logsigmoid``). Where a loss has that shape, its
gradient at a token is ``g_s * u_t``: ``u_t`` the derivative of the token's summary ``s`` in the
token's output (a constant: the summary is linear in the outputs) and ``g_s`` the loss's
derivative in the summary, known only once every token of the summary has its output. So a
tile can run its vector-Jacobian product with the tangent ``u`` and leave its weight-gradient
share in a sum that ``g_s`` scales once the group's last tile has run: three GEMMs per token
for a group of any length (:mod:`tile_pass.tiles._summary_tiles`).

:func:`token_summaries` proves that shape on the reduction's own aten graph, the one
:mod:`tile_pass.program._token_groups` reads:

* the summaries are the values linear in the outputs (built from them by ops with constant
  derivatives only) that an op nonlinear in them reads;
* the loss reads no value linear in the outputs directly (a term such as an added NLL would
  give its tokens a second direction, which one scale per group cannot carry);
* each group of coupled tokens holds exactly one summary element (its tokens are joined with
  the element they feed, so a token feeds no other), and no element has tokens untracked.

``u`` and ``g`` are derived by autograd on that graph: ``u`` is the vector-Jacobian product of
the summaries with ones, ``g`` the loss's gradient in the summaries, cut out of the graph as
leaves. Nothing here is a formula.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from tile_pass._caches import BoundedCache, shapes_of
from tile_pass._logging import log
from tile_pass.program import _region
from tile_pass.program._operands import RegionOperands
from tile_pass.program._token_groups import _interpreted, _Interpreter, _traced, _Unknown

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class TokenSummaries:
    """A reduction whose outputs reach the loss only through linear summaries, one per group."""

    graph: torch.fx.GraphModule  # the reduction in aten, at the sizes analysed
    summaries: tuple[str, ...]  # the graph's nodes that are the summaries
    groups: torch.Tensor  # [N] int64: each token's group (a token id, its class's root)
    element_groups: tuple[torch.Tensor, ...]  # per summary: each element's group (-1: no token)
    num_outputs: int

    @property
    def summed_groups(self) -> torch.Tensor:
        """The groups that hold a summary element (the others have no gradient)."""
        return torch.cat([g[g >= 0] for g in self.element_groups])

    def unit_tangents(self, outputs, operands: RegionOperands, diff: list[int]) -> dict[int, torch.Tensor]:
        """``u``: each token's derivative of its group's summary, by differentiable output (the
        outputs' values do not matter: the summaries are linear in them)."""
        with _region.dispatch_as_caller(), torch.enable_grad():
            outputs = list(outputs)
            for i in diff:
                outputs[i] = outputs[i].detach().requires_grad_()
            values = _CutSummaries(self, leaves=False).values_of(outputs, operands)[1]
            grads = torch.autograd.grad(
                values, [outputs[i] for i in diff], [torch.ones_like(v) for v in values], allow_unused=True
            )
        return {
            i: (torch.zeros_like(outputs[i]) if g is None else g.detach()).contiguous()
            for i, g in zip(diff, grads, strict=True)
        }

    def group_gradients(self, outputs, operands: RegionOperands) -> torch.Tensor:
        """``[N + 1]``: at each group's id, ``g``, the loss's derivative in its summary element
        at these outputs (exact for a group whose tokens all have their outputs: ``g`` of one
        group reads no other group's values)."""
        num_tokens = self.groups.shape[0]
        with _region.dispatch_as_caller(), torch.enable_grad():
            loss, values = _CutSummaries(self, leaves=True).values_of(outputs, operands)
            grads = [None] * len(values)
            if loss.requires_grad:
                grads = torch.autograd.grad(loss, values, allow_unused=True)
        by_group = loss.new_zeros((num_tokens + 1,))
        for groups, value, grad in zip(self.element_groups, values, grads, strict=True):
            grad = torch.zeros_like(value) if grad is None else grad
            at = torch.where(groups >= 0, groups, num_tokens).to(by_group.device)
            by_group.index_copy_(0, at, grad.detach().reshape(-1).to(by_group.dtype))
        by_group[num_tokens] = 0
        return by_group


class _CutSummaries(torch.fx.Interpreter):
    """Runs the reduction; with ``leaves``, each summary is replaced by a leaf of its value, so
    the loss's gradient in the leaves is ``g``."""

    def __init__(self, summaries: TokenSummaries, leaves: bool):
        super().__init__(summaries.graph)
        self.cut = summaries.summaries
        self.leaves = leaves
        self.found: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node):
        value = super().run_node(n)
        if n.name in self.cut:
            if self.leaves:
                value = value.detach().requires_grad_()
            self.found[n.name] = value
        return value

    def values_of(self, outputs, operands: RegionOperands):
        loss = self.run(*outputs, *_region.reduction_inputs(operands))
        return loss, [self.found[name] for name in self.cut]


_cache = BoundedCache("token summaries", 256)


def token_summaries(
    program: _region.RowProgram, outputs: list[torch.Tensor], operands: RegionOperands
) -> TokenSummaries | None:
    """The reduction's linear summaries, one per group of coupled tokens, or ``None`` where the
    loss does not have that shape (the reason is logged). ``outputs`` stand for their shapes.
    Decided once per program and sizes."""
    inputs = _region.reduction_inputs(operands)

    def decide() -> TokenSummaries | None:
        try:
            return _analyse(program, outputs, inputs)
        except _Unknown as why:
            log.debug("%s: no linear summary per group (%s): a group longer than a tile runs the tiles "
                      "twice", program.key, why)  # fmt: skip
            return None

    return _cache.decided((program.key, shapes_of([*outputs, *inputs])), decide)


def _analyse(program, outputs, inputs) -> TokenSummaries:
    """The summaries, from the loss traced on ``outputs`` and ``inputs`` (its other inputs, flat)."""
    graph = _traced(program, outputs, inputs)
    interpreter = _interpreted(graph, outputs, inputs)
    tracked = set(interpreter.ids)
    nodes = list(graph.graph.nodes)
    linear = set([n for n in nodes if n.op == "placeholder"][: len(outputs)])
    for node in nodes:
        if node.op != "call_function" or node not in tracked or node.target is aten.detach.default:
            continue
        reads_linear = all(a in linear for a in node.all_input_nodes if a in tracked)
        if reads_linear and _Interpreter._linear(node, tracked):
            linear.add(node)
    summaries: list[torch.fx.Node] = []
    for node in nodes:
        if node.op == "call_function" and node in tracked and node not in linear:
            summaries += [a for a in node.all_input_nodes if a in linear and a not in summaries]
        if node.op == "output" and any(a in linear for a in node.all_input_nodes):
            raise _Unknown("the loss is linear in the outputs along one path (a term added to it)")
    classes = interpreter.classes
    element_groups, seen = [], set()
    for node in summaries:
        ids = interpreter.ids[node]
        if not isinstance(ids, torch.Tensor):
            raise _Unknown(f"summary {node} is not one tensor")
        flat = ids.reshape(-1).tolist()
        if any(i < -1 for i in flat):  # _UNUSED: reaches the loss along a linear path only
            raise _Unknown(f"summary {node} also reaches the loss linearly")
        groups = [classes.find(i) if i >= 0 else -1 for i in flat]
        for group in groups:
            if group >= 0 and group in seen:
                raise _Unknown("a group of coupled tokens holds more than one summary element")
            seen.add(group)
        element_groups.append(torch.tensor(groups, dtype=torch.int64))
    if not summaries:
        raise _Unknown("no summary reaches a nonlinear op")
    return TokenSummaries(
        graph, tuple(n.name for n in summaries), classes.roots(), tuple(element_groups), len(outputs)
    )
