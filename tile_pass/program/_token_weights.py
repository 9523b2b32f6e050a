"""The token weights of a region's scalar loss, derived once per program and run as a graph.

When a region's per-token outputs reach one scalar loss through token reductions that are
linear in them (the matcher admits only those), the tiles form the loss's gradient in forward
and need ``d loss / d output`` for each differentiable output: the token weights. Being linear,
that gradient does not depend on the outputs, only on the reduction's own inputs (labels,
masks, advantages, a ``num_items_in_batch``) and on the sizes. So it is derived once: the
reduction program's ``torch.autograd.grad`` is traced by ``make_fx`` with symbolic sizes, and
each step runs that small aten graph (for a plain mean over labelled tokens: a compare, a sum,
a division) instead of an autograd pass. One graph serves every batch size; the size guards
the trace recorded (a size specialised to 0 or 1, sizes tied by a reshape) are checked on each
call, and sizes that fail them get a graph of their own. An output the loss does not read gets
no weight at all, so the tiles take no tangent for it (a returned ``[N, V]`` logits output
would otherwise cost an ``[N, V]`` zero tangent a step).

Nothing here is a formula: the graph is what autograd computed. A reduction that cannot be
traced symbolically (data-dependent Python in it) is differentiated eagerly each call instead.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from tile_pass._caches import BoundedCache, on_tracing_thread
from tile_pass._logging import log
from tile_pass.program import _region


@dataclasses.dataclass(frozen=True)
class _Derived:
    """A traced reduction gradient and the sizes it holds for."""

    graph: torch.fx.GraphModule
    reached: tuple[int, ...]  # the outputs the loss reads, in the graph's output order
    shape_env: object | None  # the trace's ShapeEnv, or None when it recorded no guard
    guards: str | None

    def admits(self, args: list[torch.Tensor]) -> bool:
        return self.guards is None or bool(self.shape_env.evaluate_guards_expression(self.guards, args))


#: per program and input dtypes: the graphs traced for it (a few size classes each)
_derived = BoundedCache("token-weight graphs", 64)
#: per program, input dtypes and sizes: the graph whose guards those sizes pass
_by_sizes = BoundedCache("token-weight graphs by sizes", 1024)
_lock = threading.Lock()
_MAX_SIZE_CLASSES = 8
_UNTRACEABLE = "eager"


def _gradient_fn(program: _region.RowProgram, diff: list[int]):
    """``(outputs..., reduce inputs...) -> d loss / d output`` for the outputs the loss reads."""
    num_outputs = len(program.outputs)

    def gradient(*args):
        outputs, reduce_inputs = list(args[:num_outputs]), args[num_outputs:]
        with torch.enable_grad():
            for i in diff:
                outputs[i] = outputs[i].detach().requires_grad_()
            loss = _region.run_reduction(program.reduction, outputs, reduce_inputs, outputs[0].device.type)
            grads = torch.autograd.grad(loss, [outputs[i] for i in diff], allow_unused=True)
        return {i: g.detach() for i, g in zip(diff, grads, strict=True) if g is not None}

    return gradient


def _trace(program: _region.RowProgram, diff: list[int], args: list[torch.Tensor]) -> _Derived:
    gradient = _gradient_fn(program, diff)
    reached: list[int] = []

    def flat(*inputs):
        grads = gradient(*inputs)
        reached[:] = list(grads)
        return tuple(grads.values())

    graph = _without_the_loss(make_fx(flat, tracing_mode="symbolic")(*args))
    placeholders = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
    shape_env = placeholders[0].fake_mode.shape_env
    # static sizes too: a size specialised to 0 or 1 is a constant of the graph
    guards = shape_env.produce_guards_expression(placeholders, ignore_static=False)
    return _Derived(graph, tuple(reached), shape_env if guards else None, guards or None)


def _without_the_loss(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The traced gradient without the loss's own value, which it computes only for autograd's
    seed ``ones_like(loss)``: that reads the loss's shape and dtype, static for a scalar loss, so
    a ``new_ones`` of them on the first input's device stands for it and the loss's ops go as dead
    code, with the returned values' ``detach`` (the graph runs inside the region ops, where no
    autograd history is recorded). Three or four small ops fewer per call."""
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op == "placeholder")
    for node in list(graph.nodes):
        loss = node.args[0].meta.get("val") if node.target is torch.ops.aten.ones_like.default else None
        if loss is not None and all(isinstance(size, int) for size in loss.shape):
            with graph.inserting_before(node):
                seed = graph.call_function(
                    torch.ops.aten.new_ones.default, (first, list(loss.shape)), {"dtype": loss.dtype}
                )
            seed.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(seed)
            graph.erase_node(node)
        elif node.target is torch.ops.aten.detach.default and node.args[0].op != "placeholder":
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def token_weights(
    program: _region.RowProgram, outputs: list[torch.Tensor], reduce_inputs: list[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """``d loss / d output`` by output index, for the differentiable outputs the loss reads;
    ``outputs`` stand for the outputs' shapes only (any values, broadcast zeros suffice)."""
    diff = [i for i, out in enumerate(program.outputs) if out.differentiable]
    args = [*outputs, *reduce_inputs]
    sizes = (program.key, tuple((a.dtype, a.device.type, a.shape) for a in args))  # the guards read sizes
    with _lock:
        derived = _by_sizes.get(sizes)  # decided once per shape: a step pays this lookup
    if derived is not None:
        return dict(zip(derived.reached, derived.graph.forward(*args), strict=True))
    key = (program.key, tuple((a.dtype, a.dim(), a.device.type) for a in args))
    with _lock:
        known = _derived.get(key) or []
    if known == _UNTRACEABLE:
        with _region.dispatch_as_caller():
            return _gradient_fn(program, diff)(*args)
    derived = next((d for d in known if d.admits(args)), None)
    if derived is not None:
        with _lock:
            _by_sizes.put(sizes, derived)
    else:
        try:
            derived = on_tracing_thread(lambda: _trace(program, diff, args))
        except Exception:  # data-dependent Python in the reduction: differentiate it each call
            log.debug("token weights of %s are not traceable; derived eagerly per call", program.key,
                      exc_info=True)  # fmt: skip
            with _lock:
                _derived.put(key, _UNTRACEABLE)
            return token_weights(program, outputs, reduce_inputs)
        with _lock:
            _derived.put(key, [derived, *known][:_MAX_SIZE_CLASSES])
    return dict(zip(derived.reached, derived.graph.forward(*args), strict=True))
