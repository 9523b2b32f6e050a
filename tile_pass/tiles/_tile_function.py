"""The function one tile runs: the region's program and the gradient autograd derives for it.

Kept apart from the loop (:mod:`tile_pass.tiles._tile_loop`) because it is traced, not run:
:func:`tile_kernel` builds the joint function of a :class:`TileKernelKey` (the program's
outputs and ``torch.autograd.grad`` of ``sum(tangent * output)``), traces it once by ``make_fx``
on the shapes :func:`_input_spec` gives, and hands the loop the finished graph. No gradient
formula is written here: the graph is what autograd computed.
"""

from __future__ import annotations

import dataclasses

import torch

from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program import _region
from tile_pass.program._operands import GroupKind, RegionOperands
from tile_pass.program._region import RowProgram
from tile_pass.tiles._tile_kernel import (
    TensorSpec,
    TileInputs,
    TileKernelKey,
    differentiable,
    trace_fake,
    traced_once,
)
from tile_pass.tiles._tile_passes import finish_tile_graph


def _input_spec(key: TileKernelKey, program: RowProgram) -> TileInputs:
    """The shapes and dtypes of a tile's inputs, as the tile loop passes them."""
    T, V, operands, need = key.tile, program.vocab_size, key.operands, key.need
    sum_dtypes = {
        WeightGradSchedule.SPLIT: (torch.int16, torch.int16),
        WeightGradSchedule.FLOAT32: (key.acc_dtype,),
    }
    whole = operands.map(lambda part: TensorSpec(*part))  # weight, bias, whole groups: as they are
    whole_need = zip(operands.of_kind(GroupKind.WHOLE), need.of_kind(GroupKind.WHOLE), strict=True)
    return TileInputs(
        operands=whole._replace(hidden=TensorSpec((T, *operands.hidden[0]), operands.hidden[1])).with_kind(
            GroupKind.PER_TOKEN, lambda spec: TensorSpec((T, *spec.shape), spec.dtype)
        ),
        tangents=tuple(
            TensorSpec((T, *_region.row_part(program.outputs[i].layout, V)), program.outputs[i].dtype)
            for i in (key.tangents if not key.coupled else ())
        ),
        weight_grad_sum=tuple(
            TensorSpec(operands.weight[0], d) for d in sum_dtypes.get(key.weight_grad, ()) if need.weight
        ),
        bias_grad_sum=TensorSpec((V,), key.acc_dtype) if need.bias else None,
        whole_grad_sums=tuple(
            TensorSpec(shape, key.acc_dtype)
            for (shape, _), n in whole_need
            if n
        ),
        coupled=(TensorSpec((T,), torch.int64),) if key.coupled else (),
    )  # fmt: skip


def _joint(key: TileKernelKey, program: RowProgram):
    """``TileInputs -> (*outputs, *per-token gradients, grad weight?)``: the program's outputs
    and the gradients of ``sum(tangent * output)``: those of the per-token operands (hidden,
    ``tokens``) returned at the tile's rows in :meth:`RegionOperands.flat` order, the weight's,
    the bias's and the shared inputs' added into their sums (the weight's returned under the
    ``DIRECT`` schedule)."""
    schedule = key.weight_grad if key.need.weight else None

    def joint(inputs: TileInputs):
        with torch.enable_grad():
            leaves, wanted = differentiable(inputs.operands.flat(), key.need.flat())
            operands = RegionOperands.unflatten(leaves, inputs.operands.counts)
            outputs = _region.run_program(program, operands)
            tangents = list(inputs.tangents)
            if key.coupled and key.tangents:  # evaluated at this tile's own outputs
                tangents = torch.ops.tile_pass.tile_tangents(
                    [o.detach() for o in outputs], inputs.coupled[0], list(key.tangents)
                )
            grads = [None] * len(wanted)
            if wanted and key.tangents:
                grads = torch.autograd.grad(
                    [outputs[i] for i in key.tangents], wanted, tangents, allow_unused=True
                )
        grads = key.need.picked(
            torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted, strict=True)
        )
        if schedule is WeightGradSchedule.SPLIT:
            torch.ops.tile_pass.split_accumulate_(*inputs.weight_grad_sum, grads.weight)
        elif schedule is WeightGradSchedule.FLOAT32:
            inputs.weight_grad_sum[0].add_(grads.weight)
        if key.need.bias:
            inputs.bias_grad_sum.add_(grads.bias)
        whole = (g for g in grads.of_kind(GroupKind.WHOLE) if g is not None)
        for whole_sum, grad in zip(inputs.whole_grad_sums, whole, strict=True):
            whole_sum.add_(grad)
        per_token = [g for g in (grads.hidden, *grads.of_kind(GroupKind.PER_TOKEN)) if g is not None]
        result = [*(out.detach() for out in outputs), *per_token]
        return (*result, grads.weight) if schedule is WeightGradSchedule.DIRECT else tuple(result)

    return joint


def _trace_program_kernel(key: TileKernelKey) -> torch.fx.GraphModule:
    program = _region.lookup(key.program)

    def trace(key: TileKernelKey) -> torch.fx.GraphModule:
        return _without_detach(trace_fake(_joint(key, program), _input_spec(key, program), key.device))

    # a coupled tile's tangents read all its rows: its middle cannot run a block of rows at a time
    retrace = None if key.coupled else lambda rows: trace(dataclasses.replace(key, tile=rows))
    return finish_tile_graph(trace(key), key, retrace)


def _without_detach(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The traced tile with the ``detach`` calls of its intermediate values dropped: one dispatch
    each per tile. Those of its inputs stay, so nothing in the tile records autograd history even
    where it runs with grad mode on (its implementation traced by ``make_fx``)."""
    for node in list(gm.graph.nodes):
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten.detach.default
            and node.args[0].op != "placeholder"
        ):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def tile_kernel(key: TileKernelKey):
    """The finished tile function of ``key``, traced once per key."""
    return traced_once(key, _trace_program_kernel)


def per_tile(kernel):
    """What the loop calls once per tile: a traced GraphModule's forward, without nn.Module's
    call machinery (5 us a tile)."""
    return kernel.forward if isinstance(kernel, torch.fx.GraphModule) else kernel
