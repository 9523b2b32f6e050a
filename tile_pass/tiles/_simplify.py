"""Exact rewrites of a derived tile middle, applied before Inductor compiles it.

The gradient stays derived: these rules change how a value of the derived graph is computed,
never what it is. Each one is keyed by the op it rewrites (:data:`RULES`), says why its
result is the same to the bit, and is checked by ``tests/test_simplify.py`` against the
unrewritten graph. :func:`split_label_column` also changes what the middle returns, so its
caller applies it (and stores the column it returns).
"""

from __future__ import annotations

import torch
import torch.fx

from tile_pass._logging import log

aten = torch.ops.aten


def _arg(node: torch.fx.Node, position: int, name: str, default=None):
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


#: ops that make the zeros a gather's gradient is scattered into
_ZEROS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}


def _one_hot_labels(graph: torch.fx.Graph, grad: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(label, value)``: the ``[rows, 1]`` column each row of the one-hot gradient ``grad``
    holds its value at, and that value (``[rows, 1]``); ``None`` where ``grad`` is no such
    gradient. Two forms hold one value per row: a 2-D
    ``nll_loss_backward`` (at the row's label, or class 0 for an ignored token, whose row is
    zeros), and the gradient of a ``gather`` of one column per row, ``scatter_add`` of a
    ``[rows, 1]`` value into zeros at its ``[rows, 1]`` index (``log_softmax(...).gather(...)``,
    the per-token log-probabilities of RL losses). Inserted at the graph's current insertion
    point."""
    if not isinstance(grad, torch.fx.Node):
        return None
    val = grad.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    if grad.target is aten.scatter_add.default and len(grad.args) == 4 and not grad.kwargs:
        base, dim, index, src = grad.args
        column = (val.shape[0], 1)
        vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (index, src)]
        if (
            isinstance(base, torch.fx.Node) and base.target in _ZEROS and dim in (1, -1)
            and all(isinstance(v, torch.Tensor) and tuple(v.shape) == column for v in vals)
        ):  # fmt: skip
            return index, src  # 0 + src at the index: src itself (up to the sign of a zero)
        return None
    if grad.target is not aten.nll_loss_backward.default:
        return None
    target, ignore_index = _arg(grad, 2, "target"), _arg(grad, 5, "ignore_index")
    target_val = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
    if not isinstance(target_val, torch.Tensor) or target_val.dim() != 1 or not isinstance(ignore_index, int):
        return None
    valid = graph.call_function(aten.ne.Scalar, (target, ignore_index))
    label = graph.call_function(aten.where.ScalarOther, (valid, target, 0))
    label = graph.call_function(aten.unsqueeze.default, (label, 1))
    return label, graph.call_function(aten.gather.default, (grad, 1, label))


def _gathered_label_row_sum(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """``_log_softmax_backward_data(g, log_probs)`` of a one-hot ``g`` (an NLL gradient, or a
    gather's: :func:`_one_hot_labels`) with the row sum of ``g`` read at the label instead of
    reduced over the vocabulary.

    The log-softmax backward is ``g - exp(log_probs) * g.sum(dim)``, and ``g`` holds one value
    per row, at the row's label (zero for the rest, and for the whole row of an ignored
    token). A sum of zeros and one value is that value, so gathering it is
    the same number, without Inductor's extra reduction loop over ``[tile, V]`` per row block
    (a 32 x 128256 block's middle: 4.7 ms -> 3.85 ms on a 2-core Xeon). The only difference a
    sum could make is the sign of a zero (a zero-weight class), which no loss or gradient
    value depends on.
    """
    grad, log_probs, dim, input_dtype = node.args
    if dim not in (1, -1):
        return False
    val = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
    # as the decomposition: half precision computed in float32 and cast back to the input's
    # dtype, each cast explicit (Inductor computes so anyway; torch 2.11's also lowers a
    # half-precision NLL gradient to float32, which only an explicit cast back stores as it should)
    compute = torch.float32 if val.dtype in (torch.float16, torch.bfloat16) else val.dtype

    def to(value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
        return graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})

    with graph.inserting_before(node):
        found = _one_hot_labels(graph, grad)
        if found is None:
            return False
        _, row_sum = found
        if compute != val.dtype:
            grad, log_probs, row_sum = to(grad, compute), to(log_probs, compute), to(row_sum, compute)
        softmax = graph.call_function(aten.exp.default, (log_probs,))
        scaled = graph.call_function(aten.mul.Tensor, (softmax, row_sum))
        result = graph.call_function(aten.sub.Tensor, (grad, scaled))
        if compute != input_dtype:
            result = to(result, input_dtype)
    result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True


#: the row functions :func:`_shared_row_statistics` computes from one row maximum and sum
_ROW_FUNCTIONS = (aten._log_softmax.default, aten._softmax.default, aten.logsumexp.default)


def _row_function_dim(node: torch.fx.Node, x: torch.fx.Node) -> int | None:
    """The dimension (``0 <= dim < x.dim()``) ``node`` reduces ``x`` over, where ``node`` is one
    of :data:`_ROW_FUNCTIONS` of ``x`` whose decomposition is the float arithmetic
    :func:`_shared_row_statistics` writes out; else ``None``."""
    if node.op != "call_function" or node.target not in _ROW_FUNCTIONS or node.args[:1] != (x,):
        return None
    ndim = x.meta["val"].dim()
    if node.target is aten.logsumexp.default:
        dims = _arg(node, 1, "dim")
        dims = [dims] if isinstance(dims, int) else dims
        if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
            return None
        dim = dims[0]
    else:
        dim, half_to_float = _arg(node, 1, "dim"), _arg(node, 2, "half_to_float")
        if not isinstance(dim, int) or half_to_float is not False:
            return None
    return dim % ndim if -ndim <= dim < ndim else None


def _shared_row_statistics(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """``_log_softmax``, ``_softmax`` and ``logsumexp`` of one float32/float64 input over one
    dimension (two or more of them, ``node`` among them) computed from one row maximum ``m``
    and one sum ``S = sum(exp(x - m))``, so Inductor makes one pass over a row for them instead
    of one each: for CE + z-loss one pass and one ``exp`` per logit fewer (a 64 x 32000 float32
    block's middle: 4.9 ms -> 4.0 ms, median, on a noisy 2-core machine).

    Each is written as the decomposition Inductor lowers it by, op for op: the log-softmax is
    ``(x - m) - log(S)``, the softmax ``exp(x - m) / S``, sharing ``x - m``, its ``exp``
    and ``S``. The ``logsumexp`` decomposition shifts by ``m0``, ``m`` with an infinite
    maximum masked to 0, and is ``log(sum(exp(x - m0))) + m0``; here it is
    ``where(isinf(m), m, log(S) + m)``. For a finite ``m``, ``m0`` is ``m``: the same ops on
    the same numbers. For ``m = -inf`` the row is all ``-inf`` and the decomposition gives
    ``log(0) + 0 = -inf``; for ``m = +inf`` (no NaN in the row) its sum is ``+inf`` and it
    gives ``+inf``: ``m`` both times. A NaN in the row makes ``m`` NaN, and both NaN (not
    always with the same payload bits, which no value depends on).

    Only on the CPU: there Inductor reduces every row of a shape in the same order, so ``S``
    has the bits of the ``logsumexp``'s own sum; on a GPU it may fold the max and sum into one
    online-softmax reduction (and pick a kernel's reduction order by autotuning).
    """
    x = node.args[0] if node.args else None
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) and x.graph is graph else None
    if (
        not isinstance(val, torch.Tensor)
        or val.dtype not in (torch.float32, torch.float64)
        or val.device.type != "cpu"
        or val.dim() == 0
        or not all(isinstance(size, int) and size > 0 for size in val.shape)
    ):  # fmt: skip
        return False
    dim = _row_function_dim(node, x)
    if dim is None:
        return False
    group = [user for user in x.users if _row_function_dim(user, x) == dim]
    if len(group) < 2:  # nothing to share
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    group.sort(key=order.__getitem__)
    first, last = order[group[0]], order[group[-1]]
    # the shared nodes read ``x`` before the first of them: nothing may write to it before the last
    if any(
        getattr(getattr(n.target, "_schema", None), "is_mutable", False)
        for n in graph.nodes if first < order[n] < last
    ):  # fmt: skip
        return False

    def call(target, *args):
        return graph.call_function(target, args)

    with graph.inserting_before(group[0]):
        row_max = call(aten.amax.default, x, [dim], True)
        shifted = call(aten.sub.Tensor, x, row_max)
        exps = call(aten.exp.default, shifted)
        row_sum = call(aten.sum.dim_IntList, exps, [dim], True)
        log_sum = call(aten.log.default, row_sum)
        made = {}  # one node for the members that compute the same value
        for member in group:
            keepdim = member.target is aten.logsumexp.default and bool(_arg(member, 2, "keepdim", False))
            key = (member.target, keepdim)
            if key not in made:
                if member.target is aten._log_softmax.default:
                    value = call(aten.sub.Tensor, shifted, log_sum)
                elif member.target is aten._softmax.default:
                    value = call(aten.div.Tensor, exps, row_sum)
                else:
                    finite = call(aten.add.Tensor, log_sum, row_max)
                    value = call(aten.where.self, call(aten.isinf.default, row_max), row_max, finite)
                    value = value if keepdim else call(aten.squeeze.dims, value, [dim])
                value.meta = dict(member.meta)
                made[key] = value
            member.replace_all_uses_with(made[key])
    for member in group:
        graph.erase_node(member)
    return True


#: rewrite rules by the op they apply to: ``rule(graph, node) -> bool`` (applied or not)
RULES = {
    aten._log_softmax_backward_data.default: _gathered_label_row_sum,
    **dict.fromkeys(_ROW_FUNCTIONS, _shared_row_statistics),
}


def simplify(gm: torch.fx.GraphModule) -> int:
    """Apply :data:`RULES` to ``gm`` in place; the number of rewrites."""
    applied = 0
    for node in list(gm.graph.nodes):
        rule = RULES.get(node.target) if node.op == "call_function" else None
        if rule is not None and rule(gm.graph, node):
            applied += 1
    if applied:
        gm.graph.lint()
        gm.recompile()
        _propagate_vals(gm)
        log.debug("simplified %d node(s) of a tile middle", applied)
    return applied


def _propagate_vals(gm: torch.fx.GraphModule) -> None:
    """Give the rules' new nodes their ``meta["val"]`` (later rules read shapes from it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return
    mode = FakeTensorMode()
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


#: elementwise ops a gather along the vocabulary commutes with: gathering their result at a
#: column is applying them to their operands gathered there (per-row and scalar operands as
#: they are), the same float operations on the same values
_ELEMENTWISE = {
    aten.exp.default,
    aten.neg.default,
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.div.Tensor,
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
}


def _gathered(graph: torch.fx.Graph, node, label: torch.fx.Node, shape: torch.Size):
    """``node`` (a ``[rows, V]`` value of ``shape``, a per-row ``[rows, 1]`` one or a scalar) at
    the column ``label`` of each row, computed through elementwise ops rather than by gathering
    a whole ``[rows, V]`` value (which Inductor would realize)."""

    def kind(value) -> str:
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or tuple(val.shape) == (shape[0], 1):
            return "row"  # a number, a scalar tensor or one value per row: the same at every column
        return "full" if val.shape == shape else "other"

    if kind(node) == "row":
        return node
    if node.target in _ELEMENTWISE and all(kind(arg) != "other" for arg in node.args):
        operands = tuple(_gathered(graph, arg, label, shape) for arg in node.args)
        return graph.call_function(node.target, operands, dict(node.kwargs))
    return graph.call_function(aten.gather.default, (node, 1, label))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stored_cast_chain(copy: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """The ops between what ``copy`` stores and the value they apply to, each used nowhere
    else: dtype casts, and products or quotients by a number (a sampling temperature's
    ``/ T`` in the gradient). Each maps a row element by element with nothing but that number,
    so applying it to the value off the label and at the label apart is the same float
    operation on the same numbers."""
    casts, value = [], copy.args[1]
    while isinstance(value, torch.fx.Node) and len(value.users) == 1:
        by_number = (
            value.target in (aten.div.Tensor, aten.mul.Tensor)
            and len(value.args) == 2 and _is_number(value.args[1]) and not value.kwargs
        )  # fmt: skip
        if value.target is not aten._to_copy.default and not by_number:
            break
        casts.append(value)
        value = value.args[0]
    return casts, value


def split_label_column(gm: torch.fx.GraphModule, logits_index: int) -> bool:
    """Store the logits gradient over the logits without its label column, and return that
    column: ``(label, value)`` appended to the outputs, ``[rows, 1]`` each, for the caller to
    scatter into the logits input after the compiled middle ran. Whether it applied.

    The log-softmax gradient of an NLL loss is ``g - p * s`` (``g`` the NLL gradient, one value
    per row at its label; ``p * s`` dense), and Inductor builds ``g`` element by element from a
    comparison of a 64-bit column index with the label: a fifth of a 32 x 128256 block's
    middle. Off the label ``g`` is zero, so the stored value is ``0 - p * s``, the same float
    operation on the same numbers; at the label it is ``g - p * s`` read there, the same ops on
    the gathered operands. (Only the sign of a zero can differ, where ``g`` is a negative zero:
    eager's own NLL gradient is a positive one.)
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if logits_index >= len(placeholders):
        return False
    logits = placeholders[logits_index]
    copy = next((n for n in logits.users if n.target is aten.copy_.default and n.args[0] is logits), None)
    if copy is None:
        return False
    casts, value = _stored_cast_chain(copy)
    if not isinstance(value, torch.fx.Node) or value.target is not aten.sub.Tensor or len(value.users) != 1:
        return False
    if value.kwargs.get("alpha", 1) != 1 or len(value.args) != 2:
        return False
    grad, dense = value.args
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (value, grad, dense)]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == vals[0].shape for v in vals):
        return False
    graph, shape = gm.graph, vals[0].shape
    grad_casts, one_hot = [], grad  # a half-precision gradient is upcast (see _gathered_label_row_sum)
    while isinstance(one_hot, torch.fx.Node) and one_hot.target is aten._to_copy.default:
        grad_casts.append(one_hot)
        one_hot = one_hot.args[0]
    with graph.inserting_before(copy):
        found = _one_hot_labels(graph, one_hot)
        if found is None:
            return False
        label, at_label = found
        for cast in reversed(grad_casts):  # the cast's label column: the label column cast
            at_label = graph.call_function(cast.target, (at_label, *cast.args[1:]), dict(cast.kwargs))
        off_label = graph.call_function(aten.rsub.Scalar, (dense, 0.0))  # 0 - p * s
        at_label = graph.call_function(aten.sub.Tensor, (at_label, _gathered(graph, dense, label, shape)))
        for cast in reversed(casts):
            off_label = graph.call_function(cast.target, (off_label, *cast.args[1:]), dict(cast.kwargs))
            at_label = graph.call_function(cast.target, (at_label, *cast.args[1:]), dict(cast.kwargs))
    copy.args = (logits, off_label)
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    output.args = (tuple(results + [label, at_label]),)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    log.debug("the label column of a tile middle's logits gradient is stored apart")
    return True
