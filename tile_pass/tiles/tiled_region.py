"""The region ops: a region's row-wise program, run tile by tile, with its gradient derived.

What a rewritten graph calls (:func:`run_region`) and the custom ops behind it, with their fake
kernels and autograd glue; the tiles themselves run in the one tile loop
(:mod:`tile_pass.tiles._tile_loop`). Every rewritten region and
:func:`tile_pass.linear_cross_entropy` (whose region is the textbook loss,
:mod:`tile_pass._textbook`) come here. The tile function is the user's own row-wise subgraph (a
:class:`~tile_pass.program._region.RowProgram`), with several per-token outputs (losses,
log-probabilities, log-sum-exps, entropies, ``argmax``), and rows returned to the caller. One
pass over the tiles computes every output: one logits GEMM per tile, however many consumers the
logits had. Each op takes the head and its other operands as one flat list, read back by the
program's group sizes into a :class:`~tile_pass.program._operands.RegionOperands`.

Two custom ops, chosen by the matcher:

* ``tile_pass::row_region_loss``, when the outputs reach one scalar loss through token
  reductions that are linear in them (sums, means, masked means, ``/ num_items_in_batch``,
  per-sequence sums times advantages). The gradient of that reduction with respect to each
  output is derived once (``make_fx`` of ``autograd.grad``; it does not depend on the outputs),
  becomes the tiles' token weights, and each tile forms its share of the loss's gradient in
  forward: three GEMMs per token in all, as for the plain cross entropy. Backward scales the
  saved gradients by the incoming scalar, which is the chain rule and nothing else.
* ``tile_pass::row_region``, otherwise: forward makes the outputs; backward re-runs the tiles
  with each output's incoming gradient as its tangent (``row_region_backward``), an exact
  vector-Jacobian product for any tangent.

The tiles' gradient comes from ``torch.autograd.grad`` of the program traced by ``make_fx``
(:mod:`tile_pass.tiles._tile_function`), never from a formula written here.
"""

from __future__ import annotations

import functools

import torch

from tile_pass import _distributed
from tile_pass._caches import BoundedCache
from tile_pass._logging import log
from tile_pass.plan._plan import RegionCall, plan_tiles
from tile_pass.program import _region
from tile_pass.program._operands import GroupKind, RegionOperands, no_gradient
from tile_pass.program._region import RowProgram
from tile_pass.program._token_summaries import token_summaries
from tile_pass.program._token_weights import token_weights
from tile_pass.tiles._coupled_tiles import coupled_tiles
from tile_pass.tiles._higher_order import anchors, refuse_higher_order, scaled_by_upstream
from tile_pass.tiles._summary_tiles import accumulation_pays, refusal, summary_tiles
from tile_pass.tiles._tile_kernel import TILE_KERNEL_CACHE_SIZE
from tile_pass.tiles._tile_loop import cached, check_indices, run_tiles, skipped_rows
from tile_pass.tiles._tile_results import (
    RegionResult,
    fake_grads,
    fake_outputs,
    grads_as_returned,
    unflatten,
    zero_outputs,
)


def _resolved(call: str) -> tuple[RegionCall, RowProgram]:
    """The record an op's ``call`` key stands for, and its region's program: parsed once per key
    (the ops' implementations run here each call; :func:`run_region`, which Dynamo may trace,
    parses its key itself)."""
    return cached(_calls, call, lambda: _parsed(call))


def _parsed(call: str) -> tuple[RegionCall, RowProgram]:
    plan = RegionCall.parse(call)
    return plan, _region.lookup(plan.program)


#: what the per-call path decides once per key (see _resolved; the loop's plans: _tile_loop)
_calls = BoundedCache("region calls", TILE_KERNEL_CACHE_SIZE)


def _given(region: RowProgram, hidden, weight, bias, operands: list) -> RegionOperands:
    """An op's arguments as the record its program's group sizes read them as."""
    return RegionOperands.unflatten([hidden, weight, bias, *operands], region.counts)


def _need(flags: list[bool], region: RowProgram) -> RegionOperands[bool]:
    """An op's ``need`` flags by operand (an empty list: nothing is differentiated)."""
    return RegionOperands.unflatten(flags, region.counts) if flags else no_gradient(region.counts)


def _flat_tokens(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0)


def _tiled(given: RegionOperands) -> RegionOperands:
    """The operands as the tiles take them: the hidden states flat over the tokens (the ops take
    them as the graph shapes them; the scalar loss reads their token dimensions)."""
    return given._replace(hidden=_flat_tokens(given.hidden))


# ------------------------------------------------------------------------- scalar loss


@torch.library.custom_op("tile_pass::row_region_loss", mutates_args=())
def _row_region_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    *,
    call: str,
    need: list[bool],
) -> list[torch.Tensor]:
    """``[loss, *grads, *outputs]`` (see :class:`RegionResult`): the gradients of the loss at
    unit upstream gradient, the needed ones in :meth:`RegionOperands.flat` order, the outputs flat
    over the tokens. ``operands``: the groups after the head, flat."""
    plan, region = _resolved(call)
    given = _given(region, hidden, weight, bias, operands)
    tiled = _tiled(given)
    check_indices(region, tiled.tokens)
    need = _need(need, region)
    if region.reduction.linear:
        # the token weights: d loss / d output, independent of the outputs (a linear reduction)
        tangents = token_weights(region, zero_outputs(region, tiled.hidden.shape[0], hidden.device), given)
        rows = skipped_rows(region, tiled, tangents, values=True)
        outputs, grads = run_tiles(region, plan, tiled, tangents, need, rows=rows)
    else:
        outputs, grads = _nonlinear_loss_tiles(region, plan, given, need)
    with _region.dispatch_as_caller():
        loss = _region.run_reduction(region.reduction, outputs, given, hidden.device.type)
    return RegionResult(loss, grads_as_returned(given, grads, need), outputs).flat()


def _nonlinear_loss_tiles(region: RowProgram, plan: RegionCall, given: RegionOperands, need):
    """The tiles of a loss nonlinear in the outputs: whole coupled groups per tile where their
    sizes allow, each tile evaluating ``d loss / d output`` at its own outputs (three GEMMs per
    token); otherwise the outputs first and the gradient at them in a second pass (four)."""
    tiled, nothing = _tiled(given), no_gradient(region.counts)
    rows = skipped_rows(region, tiled, None, values=True)
    if not need.any():
        return run_tiles(region, plan, tiled, {}, nothing, rows=rows)
    hidden, weight = tiled.hidden, tiled.weight
    num_rows = hidden.shape[0] if rows is None else rows.numel()
    tile_plan = plan_tiles(
        num_rows, hidden.shape[0], plan.tile, weight.shape, weight.dtype, weight.device, plan.compile_tiles,
        need.weight,
    )  # fmt: skip
    shapes = zero_outputs(region, hidden.shape[0], hidden.device)
    tiles = coupled_tiles(region, shapes, given, rows, tile_plan)
    how = "tiles of whole coupled groups" if tiles is not None else "groups no tile holds"
    log.debug("%s: a loss nonlinear in the outputs, %s", region.key, how)
    if tiles is not None:
        result = run_tiles(region, plan, tiled, {}, need, coupled=tiles, loss_operands=given)
        if rows is None or _finite_where_skipped(region, result[0], given, rows):
            return result
        # a token left out reaches the loss with a non-finite weight: in eager its gradient is
        # NaN (zero times NaN), so every token runs
        tiles = coupled_tiles(region, shapes, given, None, tile_plan)
        return run_tiles(region, plan, tiled, {}, need, coupled=tiles, loss_operands=given)
    result = _summed_groups(region, plan, given, shapes, need, rows, tile_plan)
    if result is not None:
        return result
    outputs, _ = run_tiles(region, plan, tiled, {}, nothing, rows=rows)
    tangents = token_weights(region, outputs, given)
    rows = skipped_rows(region, tiled, tangents, values=False)
    _, grads = run_tiles(region, plan, tiled, tangents, need, keep_outputs=False, rows=rows)
    return outputs, grads


def _summed_groups(
    region: RowProgram, plan: RegionCall, given: RegionOperands, shapes, need, rows, tile_plan
):
    """Groups longer than a tile in per-summary sums (:mod:`tile_pass.tiles._summary_tiles`),
    three GEMMs per token, or ``None`` where the loss or the loop does not admit them."""
    tiled = _tiled(given)
    hidden, weight = tiled.hidden, tiled.weight
    summaries = token_summaries(region, shapes, given)
    why = "the loss has no linear summary per group" if summaries is None else refusal(region, weight, need)
    if why is None:
        tokens = torch.arange(hidden.shape[0]) if rows is None else rows.cpu()
        sizes = torch.bincount(summaries.groups[tokens], minlength=hidden.shape[0])[summaries.summed_groups]
        if not accumulation_pays(
            [s for s in sizes.tolist() if s], tile_plan.tile, weight, tile_plan.bytes_per_token
        ):
            why = "its per-group sums would move more bytes than a second pass over the tiles"
    if why is not None:
        log.debug("%s: groups longer than a tile, two passes over the tiles: %s", region.key, why)
        return None
    head = (region, plan, tiled)
    result = summary_tiles(run_tiles, head, summaries, given, need, rows, shapes)
    if rows is None or _finite_where_skipped(region, result[0], given, rows):
        return result
    # a token left out reaches the loss with a non-finite weight (eager's gradient is NaN there)
    return summary_tiles(run_tiles, head, summaries, given, need, None, shapes)


def _finite_where_skipped(region, outputs, given: RegionOperands, rows) -> bool:
    """Whether ``d loss / d output`` is finite at every token the tiles left out."""
    skipped = torch.ones(outputs[0].shape[0], dtype=torch.bool, device=outputs[0].device)
    skipped[rows] = False
    weights = token_weights(region, outputs, given)
    return all(bool(torch.isfinite(w.expand(outputs[i].shape)[skipped]).all()) for i, w in weights.items())


@_row_region_loss.register_fake
def _(hidden, weight, bias, operands, *, call, need):
    region = _resolved(call)[1]
    loss = hidden.new_empty((), dtype=region.reduction.dtype)
    given = _given(region, hidden, weight, bias, operands)
    return RegionResult(
        loss, fake_grads(given, _need(need, region)), fake_outputs(region, _flat_tokens(hidden))
    ).flat()


def _loss_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.call = keyword_only_inputs["call"]
    region = _resolved(ctx.call)[1]
    given = _given(region, *inputs)
    ctx.need = _need(keyword_only_inputs["need"], region)
    result = unflatten(output, ctx.need, loss=True)
    # outputs read outside the loss too (a metric of the logits): differentiable, their gradient
    # the tiles' re-run in backward, only where one arrives
    ctx.diff = [i for i, out in enumerate(region.outputs) if out.differentiable]
    ctx.free = [i for i in ctx.diff if not region.outputs[i].only_loss]
    kept = given.flat() if ctx.free else ()
    ctx.num_kept = len(kept)
    ctx.save_for_backward(*result.grads, *kept, *anchors(*given.flat()))
    ctx.mark_non_differentiable(*(o for i, o in enumerate(result.outputs) if i not in ctx.free))
    ctx.set_materialize_grads(False)


def _loss_vjp(ctx, grads):
    # Glue, not a gradient formula: the gradients were derived in forward at unit upstream
    # gradient; the loss is a scalar, so the chain rule scales them by the incoming gradient.
    saved = ctx.saved_tensors
    num_grads = sum(ctx.need.flat())
    loss_grads, kept = saved[:num_grads], saved[num_grads : num_grads + ctx.num_kept]
    anchored = saved[num_grads + ctx.num_kept :]
    if grads[0] is not None:
        scaled = scaled_by_upstream(loss_grads, grads[0], [True] * num_grads, anchored)
    else:
        refuse_higher_order()
        scaled = [None] * num_grads
    scaled = ctx.need.picked(scaled)
    outputs = grads[1 + num_grads :]
    arrived = [i for i in ctx.free if outputs[i] is not None]
    if arrived:  # the outputs' own gradients: a re-run of the tiles, as the per-token op's backward
        region = _resolved(ctx.call)[1]
        hidden, weight, bias, *rest = kept
        zeros = zero_outputs(region, _flat_tokens(hidden).shape[0], hidden.device)
        tangents = [outputs[i] if i in arrived else zeros[i] for i in ctx.diff]
        more = ctx.need.picked(_row_region_backward(
            tangents, hidden, weight, bias, rest, call=ctx.call, need=ctx.need.flat()
        ))  # fmt: skip
        scaled = RegionOperands.unflatten(
            [
                a if b is None else b if a is None else a + b
                for a, b in zip(scaled.flat(), more.flat(), strict=True)
            ],
            scaled.counts,
        )
    grad_hidden, grad_weight, grad_bias, *rest = scaled.flat()
    return grad_hidden, grad_weight, grad_bias, rest


_row_region_loss.register_autograd(_loss_vjp, setup_context=_loss_setup_context)


# --------------------------------------------------------------------- per-token outputs


@torch.library.custom_op("tile_pass::row_region", mutates_args=())
def _row_region(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    *,
    call: str,
) -> list[torch.Tensor]:
    """The outputs, flat over the tokens; nothing is differentiated in forward."""
    plan, region = _resolved(call)
    tiled = _tiled(_given(region, hidden, weight, bias, operands))
    check_indices(region, tiled.tokens)
    rows = skipped_rows(region, tiled, None, values=True)
    outputs, _ = run_tiles(region, plan, tiled, {}, no_gradient(region.counts), rows=rows)
    return outputs


@_row_region.register_fake
def _(hidden, weight, bias, operands, *, call):
    return fake_outputs(_resolved(call)[1], _flat_tokens(hidden))


@torch.library.custom_op("tile_pass::row_region_backward", mutates_args=())
def _row_region_backward(
    tangents: list[torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    *,
    call: str,
    need: list[bool],
) -> list[torch.Tensor]:
    """The vector-Jacobian product for the differentiable outputs' ``tangents`` (in order): the
    needed gradients in :meth:`RegionOperands.flat` order."""
    plan, region = _resolved(call)
    given = _given(region, hidden, weight, bias, operands)
    tiled, need = _tiled(given), _need(need, region)
    diff = [i for i, out in enumerate(region.outputs) if out.differentiable]
    tangents = dict(zip(diff, tangents, strict=True))
    rows = skipped_rows(region, tiled, tangents, values=False)
    _, grads = run_tiles(region, plan, tiled, tangents, need, keep_outputs=False, rows=rows)
    return grads_as_returned(given, grads, need)


@_row_region_backward.register_fake
def _(tangents, hidden, weight, bias, operands, *, call, need):
    region = _resolved(call)[1]
    return fake_grads(_given(region, hidden, weight, bias, operands), _need(need, region))


def _region_setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, bias, operands = inputs
    ctx.call = keyword_only_inputs["call"]
    ctx.operands_need = tuple(t.requires_grad for t in operands)
    ctx.save_for_backward(hidden, weight, bias, *operands)
    ctx.region = region = _resolved(ctx.call)[1]
    ctx.diff = [i for i, out in enumerate(region.outputs) if out.differentiable]
    ctx.mark_non_differentiable(*[o for i, o in enumerate(output) if i not in ctx.diff])


def _region_vjp(ctx, grads):
    # The incoming per-token gradients become the tangents of a re-run of the tiles, whose
    # gradient is derived (see _tile_function._joint): an exact vector-Jacobian product.
    refuse_higher_order()
    hidden, weight, bias, *operands = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need = _need([need_h, need_w, need_b and bias is not None, *ctx.operands_need], ctx.region)
    zeros = zero_outputs(ctx.region, _flat_tokens(hidden).shape[0], hidden.device)  # for unused outputs
    tangents = [grads[i] if grads[i] is not None else zeros[i] for i in ctx.diff]
    result = _row_region_backward(tangents, hidden, weight, bias, operands, call=ctx.call, need=need.flat())
    grad_hidden, grad_weight, grad_bias, *rest = need.picked(result).flat()
    return grad_hidden, grad_weight, grad_bias, rest


_row_region.register_autograd(_region_vjp, setup_context=_region_setup_context)


def run_region(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    *,
    call: str,
) -> list[torch.Tensor]:
    """What the rewritten graph calls: the region's outputs (flat over the tokens), preceded
    by its scalar loss when the program has one. ``operands``: the groups after the head of a
    :class:`RegionOperands`, flat; ``call``: a :class:`RegionCall`'s key. A vocabulary-sharded
    DTensor head runs the same op on this rank's local pieces."""
    if hasattr(weight, "device_mesh"):  # a DTensor head
        return _distributed.on_local_shards(
            functools.partial(run_region, call=call), hidden, weight, bias, operands
        )
    region = _region.lookup(RegionCall.parse(call).program)
    if region.reduction is None:
        return _row_region(hidden, weight, bias, operands, call=call)
    grad_on = torch.is_grad_enabled()
    given = _given(region, hidden, weight, bias, operands)
    need = RegionOperands.unflatten(
        [grad_on and t is not None and t.requires_grad for t in given.flat()], region.counts
    ).with_kind(GroupKind.LOSS, lambda _: False)  # the loss's own inputs need no gradient
    flags = need.flat() if need.any() else []
    flat = _row_region_loss(hidden, weight, bias, operands, call=call, need=flags)
    result = unflatten(flat, _need(flags, region), loss=True)
    return [result.loss, *result.outputs]
