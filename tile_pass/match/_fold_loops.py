"""Fold Python loops over the batch rows of the logits back into one op, before matching.

Code that limits the memory of eager logits loops over the batch and stacks the results, e.g.
TRL's ``selective_log_softmax``: ``torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])``.
Dynamo unrolls the loop into ``logits[0]``, ``logits[1]``, ... and one chain of ops per row,
which hides a plain row-wise computation from the matcher. When every chain is the same
computation on ``x[i]`` (and on ``y[i]`` of other tensors with the same batch), using only
elementwise ops and ops over trailing dimensions named by negative ``dim``s, the stack of
the chains is that computation on ``x`` itself: this rewrites it so. The rewrite is exact
(each row is computed by the same ops on the same values) and is kept only when the pass then
tiles a region; otherwise the caller puts the graph back as it was, loop included.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tile_pass.match import _rules
from tile_pass.program._op_facts import Fold, RuleKind, facts_for


def _row_of(node, batch: int):
    """``(x, i)`` if ``node`` is ``x[i]`` for an integer ``i`` over a first dimension of ``batch``."""
    if not (
        isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
    ):
        return None
    source, index = node.args
    value = source.meta.get("example_value") if isinstance(source, torch.fx.Node) else None
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(value, torch.Tensor):
        return None
    return (source, index) if value.dim() > 0 and value.shape[0] == batch else None


def _foldable(node: torch.fx.Node) -> bool:
    """By the op's ``folds`` fact; never an in-place write (its rule's kind is ``INPLACE``)."""
    rule = _rules.rule_for(node)
    if rule is None or rule.kind is RuleKind.INPLACE:
        return False
    folds = facts_for(node.target).folds
    if folds is not Fold.NEGATIVE_DIMS:
        return folds is Fold.ALWAYS
    dims = [a for a in node.args[1:] if isinstance(a, int) and not isinstance(a, bool)]
    dims += [v for k, v in node.kwargs.items() if k == "dim"]
    return all(isinstance(d, int) and d < 0 for d in dims)


def _chain(item: torch.fx.Node, index: int, batch: int):
    """The nodes computing ``item`` from rows ``x[index]``, in graph order, and those rows; None
    unless each node is foldable and read only inside the chain."""
    nodes, rows, todo = [], {}, [item]
    while todo:
        node = todo.pop()
        if node in nodes or node in rows:
            continue
        row = _row_of(node, batch)
        if row is not None:
            if row[1] != index:
                return None
            rows[node] = row[0]
            continue
        if not _foldable(node):
            return None
        nodes.append(node)
        todo += node.all_input_nodes
    order = {n: i for i, n in enumerate(item.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    inside = set(nodes) | {item}
    if any(u not in inside for n in nodes if n is not item for u in n.users):
        return None
    return nodes, rows


def _signature(nodes, rows) -> list:
    """The chain with nodes named by position and rows by their source: equal for equal chains."""
    position = {n: i for i, n in enumerate(nodes)}

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return ("row", rows[a]) if a in rows else ("node", position[a]) if a in position else ("outer", a)
        if isinstance(a, (tuple, list)):
            return tuple(arg(x) for x in a)
        return a

    return [(n.op, n.target, arg(n.args), tuple((k, arg(v)) for k, v in n.kwargs.items())) for n in nodes]


def _fold_stack(graph: torch.fx.Graph, stack: torch.fx.Node) -> bool:
    items = stack.args[0] if stack.args else stack.kwargs.get("tensors")
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    if dim != 0 or not isinstance(items, (list, tuple)) or len(items) < 2:
        return False
    if not all(isinstance(i, torch.fx.Node) and len(i.users) == 1 for i in items):
        return False
    batch = len(items)
    chains = [_chain(item, i, batch) for i, item in enumerate(items)]
    if any(c is None or not c[0] for c in chains):
        return False
    first = _signature(*chains[0])
    if any(_signature(*c) != first for c in chains[1:]):
        return False
    if any(isinstance(a, torch.fx.Node) and a not in chains[0][1] and a not in chains[0][0]
           for n in chains[0][0] for a in n.all_input_nodes):  # fmt: skip
        return False  # a tensor shared by the rows would broadcast differently against the batch
    nodes, rows = chains[0]
    env = dict(rows)
    with graph.inserting_before(stack):
        for node in nodes:
            folded = graph.node_copy(node, lambda a: env[a])
            folded.meta = {k: v for k, v in node.meta.items() if k != "example_value"}
            folded.meta["example_value"] = _fake_value(folded)
            env[node] = folded
    env[items[0]].meta = dict(stack.meta)
    stack.replace_all_uses_with(env[items[0]])
    graph.erase_node(stack)
    for chain_nodes, chain_rows in chains:
        for node in [*reversed(chain_nodes), *chain_rows]:
            if not node.users:
                graph.erase_node(node)
    return True


def _fake_value(node: torch.fx.Node):
    def value(a):
        return a.meta["example_value"] if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    fake = next(v for v in torch.fx.node.map_aggregate(args, lambda v: v) if isinstance(v, torch.Tensor))
    with getattr(fake, "_local_tensor", fake).fake_mode:  # a DTensor's is its local tensor's
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def fold_row_loops(gm: torch.fx.GraphModule) -> int:
    """Fold every stacked per-row loop of ``gm`` that qualifies (see the module docstring)."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.graph is not None and node.op == "call_function" and node.target is torch.stack:
            folded += _fold_stack(gm.graph, node)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded
