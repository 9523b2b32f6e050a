"""The sequence-tiled, token-weighted linear + cross-entropy loss.

Two custom ops carry the tile loop, so the graph that AOTAutograd and Inductor see holds
one opaque node whose sizes are symbolic in ``N``: one compiled graph serves every
sequence length, and no ``[N, V]`` tensor exists anywhere in it.

* ``tile_pass::linear_ce_reduced`` (``reduction`` mean/sum): for each tile it runs the
  derived tile function of :mod:`tile_pass._tile_kernel`, which yields the tile's
  per-token losses *and* the gradient of the loss at unit upstream gradient. Backward is
  the chain rule for a scalar output: those saved gradients times the incoming scalar.
  Mean weights every valid token by ``1 / (global valid count)`` before the gradient is
  derived, so the gradient is token-weighted by construction; an all-ignored batch gives
  NaN loss and zero gradients, as eager does.
* ``tile_pass::linear_ce_tokens`` (``reduction="none"``): forward makes only the
  per-token losses; backward re-runs the tiles with the incoming per-token gradient as the
  token weights (``linear_ce_tokens_backward``), so any vector-Jacobian product is exact.

The count of valid tokens is a tensor, so nothing in here synchronises with the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator

import torch

from tile_pass import _textbook, _tile_buffers, _tiling, _weight_grad
from tile_pass._higher_order import anchors, refuse_higher_order, scaled_by_upstream
from tile_pass._logging import log
from tile_pass._op_results import acc_dtype, empty, fake_grads, grads_or_empty, last_add_if
from tile_pass._tile_kernel import (
    KernelKey,
    LossHead,
    encode_head_spec,
    finish_split,
    onednn_gemms_apply,
    tile_kernel,
)
from tile_pass._tiling import auto_tile, choose_tile_tokens, effective_tile, tile_bytes_per_token

_REDUCTIONS = ("mean", "sum", "none")


@functools.lru_cache(maxsize=256)
def _loss_dtype_cached(
    head_spec: str, dtype: torch.dtype, extras: tuple[tuple[torch.dtype, int], ...]
) -> torch.dtype:
    ops = LossHead.parse_ops(head_spec)
    # the dtype does not depend on the constants' values (Python numbers), only on the ops;
    # each op refers to at most one constant, so len(ops) placeholders cover every index
    head = LossHead(ops, -100, 0.0, (1.0,) * len(ops))
    # 0-d and 1-d extras promote differently: keep their rank
    meta = [torch.empty((1,) * ndim, dtype=d, device="meta") for d, ndim in extras]
    x = torch.empty(1, 1, dtype=dtype, device="meta")
    return head.logits(x, x, None, meta).dtype


def _loss_dtype(hidden: torch.Tensor, head_spec: str, extras) -> torch.dtype:
    """The dtype the logits reach the loss in (so the loss's dtype), as eager would have it."""
    return _loss_dtype_cached(head_spec, hidden.dtype, tuple((e.dtype, e.dim()) for e in extras))


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """What every tile of one loss shares: the head, its parameters and what to differentiate."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    extras: list[torch.Tensor]
    head: LossHead
    tile_tokens: int
    compile_tiles: bool
    need_hidden: bool
    need_weight: bool
    need_bias: bool
    keep_logits_after: int = -1


def _run_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    extras: list[torch.Tensor],
    coef: torch.Tensor,
    head: LossHead,
    tile_tokens: int,
    compile_tiles: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    token_losses_out: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    keep_logits_after: int = -1,
):
    """Run every tile; return (loss sum, grad hidden, grad weight, grad bias).

    Sums are kept in ``coef.dtype`` (the accumulation dtype). Tokens whose label is
    ``ignore_index`` contribute nothing to any of them, so where finding them costs no
    device synchronisation (CPU) they are left out of the tiles altogether: a batch with a
    masked prompt or padding runs only the GEMMs of its labelled tokens. Their per-token
    loss and hidden gradient are zero, as in eager.
    """
    tiles = _Tiles(
        weight, bias, extras, head, tile_tokens, compile_tiles, need_hidden, need_weight, need_bias,
        keep_logits_after,
    )  # fmt: skip
    rows = None if head.soft_targets else _labelled_rows(target, head.ignore_index, keep_logits_after)
    if rows is not None and _plan(tiles, coef.dtype, rows.numel(), target.numel())[0] >= target.numel():
        rows = None  # one tile at least as large as the batch: leaving tokens out saves no GEMM
    if rows is None:
        return _run_tile_loop(tiles, hidden, target, coef, token_losses_out, logits_out)
    losses = None if token_losses_out is None else token_losses_out.new_empty(rows.shape)
    total, grad_hidden, grad_weight, grad_bias = _run_tile_loop(
        tiles, hidden, target.index_select(0, rows), coef.index_select(0, rows), losses, rows=rows
    )
    if token_losses_out is not None:
        token_losses_out.zero_().index_copy_(0, rows, losses)
    return total, grad_hidden, grad_weight, grad_bias


def _labelled_rows(target: torch.Tensor, ignore_index: int, keep_logits_after: int) -> torch.Tensor | None:
    """Indices of the tokens that carry a label, or ``None`` to run every token: on an
    accelerator (finding them would synchronise with the host), when every token is
    labelled, or when the logits of every token are returned."""
    if target.device.type != "cpu" or keep_logits_after >= 0:
        return None
    rows = (target != ignore_index).nonzero().squeeze(1)
    return None if rows.numel() == target.numel() else rows


def _plan(tiles: _Tiles, acc_dtype: torch.dtype, num_tokens: int, batch_tokens: int) -> tuple[int, str]:
    """The tile and the weight-gradient schedule for ``num_tokens`` rows of a batch of
    ``batch_tokens`` tokens."""
    tile = effective_tile(num_tokens, tiles.tile_tokens)
    if not tiles.need_weight:
        return tile, "float32"
    weight = tiles.weight
    upcast = any(op[0] == "cast" for op in tiles.head.ops)
    tile_tokens = tiles.tile_tokens
    return _weight_grad.plan(
        num_tokens, tile, -tile_tokens if tile_tokens < 0 else None, tuple(weight.shape), weight.dtype,
        acc_dtype, tile_bytes_per_token(weight.shape[0], weight.dtype, upcast, tiles.compile_tiles),
        batch_tokens,
    )  # fmt: skip


@_tile_buffers.shared()
def _run_tile_loop(
    tiles: _Tiles,
    hidden: torch.Tensor,
    target: torch.Tensor,
    coef: torch.Tensor,
    token_losses_out: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
):
    """The tile loop over every row of ``hidden``, or over ``rows`` of it (then ``target`` and
    ``coef`` hold those rows only): each tile gathers its rows, and their hidden gradient is
    written into the batch's, zero elsewhere. No compacted copy of the batch is made."""
    weight, bias, extras, head = tiles.weight, tiles.bias, tiles.extras, tiles.head
    need_hidden, need_weight, need_bias = tiles.need_hidden, tiles.need_weight, tiles.need_bias
    compile_tiles, keep_logits_after = tiles.compile_tiles, tiles.keep_logits_after
    batch_tokens, hidden_size = hidden.shape
    num_tokens = batch_tokens if rows is None else rows.numel()
    vocab_size = weight.shape[0]
    tile, schedule = _plan(tiles, coef.dtype, num_tokens, batch_tokens)
    _tiling.last_tiles = (num_tokens, -(-num_tokens // tile), tile, schedule)
    log.debug("tile loop: %d rows, %d tiles of %d, weight gradient %s", *_tiling.last_tiles)
    key = KernelKey(
        head=head,
        tile=tile,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        hidden_dtype=hidden.dtype,
        weight_dtype=weight.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        target_dtype=target.dtype,
        extras=tuple((tuple(e.shape), e.dtype) for e in extras),
        device=hidden.device,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        acc_dtype=coef.dtype,
        keep_logits_after=keep_logits_after,
        compiled=compile_tiles,
        onednn=onednn_gemms_apply(hidden.device),
        weight_grad="sum" if schedule == "float32" else schedule,
    )
    acc = coef.dtype
    total = hidden.new_zeros((), dtype=acc)
    whole = num_tokens == tile and rows is None  # one tile, no padding: its hidden gradient is the result
    if need_hidden and not whole:
        make = _tile_buffers.empty if rows is None else _tile_buffers.zeros
        grad_hidden = make(hidden.shape, hidden.dtype, hidden.device)
    else:
        grad_hidden = None
    if schedule == "split":  # the float32 sum as two 16-bit planes (see _weight_grad)
        weight_acc = _weight_grad.unwritten_planes(weight.shape, weight.device)
    elif schedule == "direct":  # the only tile returns it
        no_tiles = need_weight and not num_tokens
        weight_acc = _tile_buffers.zeros(weight.shape, weight.dtype, weight.device) if no_tiles else None
    else:
        weight_acc = _tile_buffers.zeros(weight.shape, acc, weight.device) if need_weight else None
    bias_acc = weight.new_zeros((vocab_size,), dtype=acc) if need_bias else None

    full_tile = tile_kernel(key) if num_tokens else None
    for start in range(0, num_tokens, tile):
        stop = min(start + tile, num_tokens)
        count = stop - start
        # a short last tile runs the next kernel size above it (_tiling.padded_rows, a bounded
        # set of sizes), padded with ignored tokens of zero weight, rather than a full padded tile
        size = tile if count == tile else effective_tile(count, tile)
        kernel = full_tile if size == tile else tile_kernel(dataclasses.replace(key, tile=size))
        h_t = hidden[start:stop] if rows is None else hidden.index_select(0, rows[start:stop])
        y_t, c_t = target[start:stop], coef[start:stop]
        if count < size:
            h_t = torch.cat([h_t, h_t.new_zeros(size - count, hidden_size)])
            padding = y_t.new_zeros((size - count, vocab_size)) if head.soft_targets else (
                y_t.new_full((size - count,), head.ignore_index)
            )  # fmt: skip
            y_t = torch.cat([y_t, padding])
            c_t = torch.cat([c_t, c_t.new_zeros(size - count)])
        with last_add_if(schedule == "split" and stop == num_tokens, weight_acc):
            losses, grad_h_t, logits_t, grad_w_t = kernel(
                h_t, weight, bias, y_t, extras, c_t, weight_acc, bias_acc
            )
        if grad_w_t is not None:
            weight_acc = grad_w_t
        if logits_t is not None:
            logits_out[start:stop] = logits_t[:count]
        total += losses[:count].sum(dtype=acc)  # padding rows are not tokens (soft targets smooth them)
        if token_losses_out is not None:
            token_losses_out[start:stop] = losses[:count]
        if need_hidden and whole:
            grad_hidden = grad_h_t.to(hidden.dtype)
        elif grad_hidden is not None and rows is None:
            grad_hidden[start:stop] = grad_h_t[:count]
        elif grad_hidden is not None:
            grad_hidden.index_copy_(0, rows[start:stop], grad_h_t[:count].to(hidden.dtype))
    if schedule == "split":  # rounded once into the weight dtype, over the high plane
        weight_acc = finish_split(*_weight_grad.settle(*weight_acc), weight.dtype, compile_tiles)
    return total, grad_hidden, weight_acc, bias_acc


def _check_labels(target: torch.Tensor, vocab_size: int, head: LossHead) -> None:
    """Raise as eager does for a class index outside ``[0, V)``, where that costs no host sync.

    On CPU a compiled tile indexes the logits with the label directly, and an out-of-range
    one aborts the whole process; one pass over ``N`` labels turns that into eager's
    ``IndexError``. On an accelerator the tiles' own device-side checks stand, as eager's do.
    """
    if head.soft_targets or target.device.type != "cpu" or target.numel() == 0:
        return
    bad = (target != head.ignore_index) & ((target < 0) | (target >= vocab_size))
    if bad.any():
        raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")


def _no_grads_for(numbers) -> list | None:
    """The backward's entry for a ``float[]`` input, in the structure autograd compares it with:
    custom ops flatten a list only when every element is a tensor, so an empty list is a list
    (of no gradients) and a list of numbers is one leaf (one ``None``)."""
    return None if len(numbers) else []


def _check_needed(ctx):
    for i, name in enumerate(("hidden", "weight", "bias")):
        if ctx.needs_input_grad[i] and not ctx.need[i]:
            raise RuntimeError(
                f"tile_pass: a gradient for {name} was requested, but {name} did not require "
                "grad when the loss was computed. Compute the loss with requires_grad set."
            )


# --------------------------------------------------------------------------- mean / sum


@torch.library.custom_op("tile_pass::linear_ce_reduced", mutates_args=())
def _linear_ce_reduced(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    extras: list[torch.Tensor],
    head_spec: str,
    constants: list[float],
    ignore_index: int,
    label_smoothing: float,
    mean: bool,
    tile_tokens: int,
    compile_tiles: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    keep_logits_after: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    head = LossHead.from_spec(head_spec, ignore_index, label_smoothing, tuple(constants))
    _check_labels(target, weight.shape[0], head)  # forward only: the backward re-runs checked labels
    logits_out = _logits_buffer(hidden, weight, head_spec, extras, keep_logits_after)
    coef, count = _token_weights(head, target, extras, acc_dtype(hidden), mean)
    total, *grads = _run_tiles(
        hidden, weight, bias, target, extras, coef, head, tile_tokens, compile_tiles,
        need_hidden, need_weight, need_bias, None, logits_out, keep_logits_after,
    )  # fmt: skip
    loss = total / count if mean else total
    loss = loss.to(_loss_dtype(hidden, head_spec, extras))
    return (loss, *grads_or_empty(hidden, weight, bias, *grads), logits_out)


@_linear_ce_reduced.register_fake
def _(hidden, weight, bias, target, extras, head_spec, constants, ignore_index, label_smoothing, mean,
      tile_tokens, compile_tiles, need_hidden, need_weight, need_bias, keep_logits_after):  # fmt: skip
    loss = hidden.new_empty((), dtype=_loss_dtype(hidden, head_spec, extras))
    logits = _logits_buffer(hidden, weight, head_spec, extras, keep_logits_after)
    return (loss, *fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias), logits)


def _token_weights(
    head: LossHead, target: torch.Tensor, extras: list[torch.Tensor], acc: torch.dtype, mean: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's weight in the loss, and the mean's denominator (as eager's ``mean``).

    Class-index targets: valid tokens count 1, or their class weight ``w[y]`` with class
    weights (the per-token losses already carry ``w[y]``, so the weight of a valid token is
    ``1 / sum(w[y] over valid tokens)``); ignored tokens 0 (an all-ignored batch: NaN loss,
    zero gradients). Probability targets have no ignored tokens: the mean is over ``N``.
    """
    if head.soft_targets:
        count = torch.full((), target.shape[0], dtype=acc, device=target.device)
        valid = torch.ones(target.shape[0], dtype=torch.bool, device=target.device)
    else:
        valid = target != head.ignore_index
        if head.class_weight >= 0:
            class_weights = extras[head.class_weight].to(acc)
            count = (class_weights[target.clamp(0, class_weights.shape[0] - 1)] * valid).sum()
        else:
            count = valid.sum()
    if not mean:
        return valid.to(acc), count
    return torch.where(valid, 1 / count.to(acc), 0), count


def _logits_buffer(hidden, weight, head_spec, extras, keep_logits_after: int) -> torch.Tensor:
    """Where the tiles write the logits a graph also returns (empty when it does not)."""
    if keep_logits_after < 0:
        return empty(hidden)
    ops = LossHead.parse_ops(head_spec)[:keep_logits_after]
    dtype = _loss_dtype_cached(json.dumps(ops), hidden.dtype, tuple((e.dtype, e.dim()) for e in extras))
    return _tile_buffers.empty((hidden.shape[0], weight.shape[0]), dtype, hidden.device)


def _reduced_setup_context(ctx, inputs, output):
    ctx.need = inputs[12:15]
    ctx.num_extras, ctx.constants_grad = len(inputs[4]), _no_grads_for(inputs[6])
    ctx.mark_non_differentiable(output[4])  # returned logits: see _returned_logits
    anchored = anchors(*inputs[:3])
    ctx.save_for_backward(*output[1:4], *anchored)


def _reduced_vjp(ctx, grad_loss, _grad_h, _grad_w, _grad_b, _grad_logits):
    # Glue, not a gradient formula: the gradients were derived (see _tile_kernel) in
    # forward at unit upstream gradient; the loss is a scalar, so the chain rule only
    # scales them by the incoming gradient.
    _check_needed(ctx)
    saved = ctx.saved_tensors
    grads = scaled_by_upstream(saved[:3], grad_loss, ctx.need, saved[3:])
    return (*grads, None, [None] * ctx.num_extras, None, ctx.constants_grad, *[None] * 9)


_linear_ce_reduced.register_autograd(_reduced_vjp, setup_context=_reduced_setup_context)


# ------------------------------------------------------------------------------- none


@torch.library.custom_op("tile_pass::linear_ce_tokens", mutates_args=())
def _linear_ce_tokens(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    extras: list[torch.Tensor],
    head_spec: str,
    constants: list[float],
    ignore_index: int,
    label_smoothing: float,
    tile_tokens: int,
    compile_tiles: bool,
) -> torch.Tensor:
    head = LossHead.from_spec(head_spec, ignore_index, label_smoothing, tuple(constants))
    _check_labels(target, weight.shape[0], head)
    out = hidden.new_empty((hidden.shape[0],), dtype=_loss_dtype(hidden, head_spec, extras))
    coef = hidden.new_zeros((hidden.shape[0],), dtype=acc_dtype(hidden))
    _run_tiles(
        hidden, weight, bias, target, extras, coef, head, tile_tokens, compile_tiles, False, False, False, out
    )
    return out


@_linear_ce_tokens.register_fake
def _(
    hidden, weight, bias, target, extras, head_spec, constants, ignore_index, label_smoothing, tile_tokens,
    compile_tiles,
):  # fmt: skip
    return hidden.new_empty((hidden.shape[0],), dtype=_loss_dtype(hidden, head_spec, extras))


@torch.library.custom_op("tile_pass::linear_ce_tokens_backward", mutates_args=())
def _linear_ce_tokens_backward(
    grad_tokens: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    extras: list[torch.Tensor],
    head_spec: str,
    constants: list[float],
    ignore_index: int,
    label_smoothing: float,
    tile_tokens: int,
    compile_tiles: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head = LossHead.from_spec(head_spec, ignore_index, label_smoothing, tuple(constants))
    _, *grads = _run_tiles(
        hidden, weight, bias, target, extras, grad_tokens.to(acc_dtype(hidden)), head, tile_tokens,
        compile_tiles, need_hidden, need_weight, need_bias,
    )  # fmt: skip
    return grads_or_empty(hidden, weight, bias, *grads)


@_linear_ce_tokens_backward.register_fake
def _(grad_tokens, hidden, weight, bias, target, extras, head_spec, constants, ignore_index, label_smoothing,
      tile_tokens, compile_tiles, need_hidden, need_weight, need_bias):  # fmt: skip
    return fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _tokens_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, extras, *options = inputs
    ctx.options = options
    ctx.num_extras, ctx.constants_grad = len(extras), _no_grads_for(options[1])
    ctx.save_for_backward(hidden, weight, bias, target, *extras)


def _tokens_vjp(ctx, grad_tokens):
    # The per-token gradient becomes the token weights of a re-run of the tiles, whose
    # gradient is derived (see _tile_kernel): an exact vector-Jacobian product.
    refuse_higher_order()
    hidden, weight, bias, target, *extras = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    need = (need[0], need[1], need[2] and bias is not None)
    grad_h, grad_w, grad_b = _linear_ce_tokens_backward(
        grad_tokens, hidden, weight, bias, target, extras, *ctx.options, *need
    )
    return (
        grad_h if need[0] else None,
        grad_w if need[1] else None,
        grad_b if need[2] else None,
        None, [None] * ctx.num_extras, None, ctx.constants_grad, *[None] * (len(ctx.options) - 2),
    )  # fmt: skip


_linear_ce_tokens.register_autograd(_tokens_vjp, setup_context=_tokens_setup_context)


def _flatten_tokens(hidden: torch.Tensor) -> torch.Tensor:
    """``[..., H] -> [N, H]``; unlike ``reshape(-1, H)`` also for ``H == 0``."""
    return hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def tiled_region_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    extras: list[torch.Tensor],
    *,
    head_spec: str,
    constants: tuple[float, ...] = (),
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    tile_tokens: int,
    keep_logits_after: int = -1,
    compile_tiles: bool = False,
):
    """The loss of a matched region, tiled: flattens tokens and picks the op for ``reduction``.

    ``head_spec`` is the JSON list of :class:`~tile_pass._tile_kernel.LossHead` ops (names and
    operand indices only) and ``constants`` the numbers they refer to.
    ``compile_tiles`` compiles the elementwise middle of the tile function (softmax, loss,
    logits gradient) with Inductor, once per tile shape; the GEMMs stay library calls. With
    ``keep_logits_after=k`` (mean/sum only) it returns ``(loss, logits)``: the ``[N, V]``
    logits after the first ``k`` ops, written tile by tile, detached (for graphs that return
    them; see :mod:`tile_pass._returned_logits`).
    """
    hidden = _flatten_tokens(hidden)
    # class probabilities (the head spec says so too) are one [V] row per token
    target = target.reshape(-1, weight.shape[0]) if target.is_floating_point() else target.reshape(-1)
    if target.dtype == torch.uint8:  # eager accepts Byte class indices; the tile's gather does not
        target = target.long()
    extras = [e.reshape(()) if e.numel() == 1 else e.reshape(-1) for e in extras]
    for e in extras:
        if e.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                "tile_pass: a tensor between the LM head and the loss requires grad; "
                "learnable logit scales/biases are not supported by the tiled loss yet"
            )
    options = (head_spec, [float(c) for c in constants], int(ignore_index), float(label_smoothing))
    if reduction == "none":
        if keep_logits_after >= 0:
            raise ValueError("keep_logits_after needs reduction mean or sum")
        return _linear_ce_tokens(hidden, weight, bias, target, extras, *options, tile_tokens, compile_tiles)
    grad_on = torch.is_grad_enabled()
    loss, _, _, _, logits = _linear_ce_reduced(
        hidden, weight, bias, target, extras, *options, reduction == "mean", tile_tokens, compile_tiles,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
        keep_logits_after,
    )  # fmt: skip
    return (loss, logits) if keep_logits_after >= 0 else loss


# ------------------------------------------------------------------------- public API


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    tile_tokens: int | None = None,
    tile_bytes: int | None = None,
    upcast: bool = True,
    logit_scale: float | None = None,
    softcap: float | None = None,
    compile_tiles: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias).float(), target, ...)``, tiled.

    A drop-in for torch's ``F.linear_cross_entropy``: the same arguments by the same names
    and meanings (``weight`` is the class weights, ``linear_bias`` the projection's bias,
    ``ignore_index=None`` means -100 for class indices), and the same results. ``input`` is
    ``[..., H]`` (torch's takes 1-D or 2-D) and ``target`` holds one class index per token
    (``[...]``) or class probabilities (``[..., V]``, floating). The ``[N, V]`` logits never
    exist: they are made one tile of ``tile_tokens`` tokens at a time (default: from the
    ``tile_bytes`` budget, see :mod:`tile_pass._tiling`), in forward and backward.

    ``upcast=False`` computes the loss in the logits' own dtype, like ``F.cross_entropy`` on
    half-precision logits; float64 is never downcast. ``logit_scale`` multiplies the logits
    and ``softcap`` caps them (``softcap * tanh(logits / softcap)``, Gemma 2) before the
    upcast, inside each tile. With ``reduction="none"`` the result has the target's token
    shape (``()`` for one unbatched token). ``compile_tiles=True`` compiles each tile's
    softmax/loss/gradient with Inductor (faster steps, a one-off compile per tile shape).
    ``bias`` (positional) is the same as ``linear_bias``, kept for earlier callers.

    Works in eager code and inside ``torch.compile`` (no graph break, no host sync).
    """
    hidden = input
    if _is_dtensor(linear_weight):
        return _vocab_parallel(
            hidden, linear_weight, target, linear_bias if linear_bias is not None else bias, weight,
            reduction, ignore_index, label_smoothing, tile_tokens, tile_bytes, upcast, logit_scale, softcap,
            compile_tiles,
        )  # fmt: skip
    if bias is not None and linear_bias is not None:
        raise TypeError("pass the projection's bias once: as linear_bias= (torch's name) or positionally")
    bias = linear_bias if linear_bias is not None else bias
    if weight is not None and weight.dim() != 1:
        raise TypeError(
            f"weight= is the class weights, a 1-D [V] tensor, as in torch's F.linear_cross_entropy and "
            f"F.cross_entropy; got shape {tuple(weight.shape)}. Pass the LM-head matrix [V, H] as the second "
            "positional argument (linear_weight=)."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be 2-D [V, H], got shape {tuple(linear_weight.shape)}")
    vocab_size, hidden_size = linear_weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"input's last dimension must equal linear_weight.shape[1] = {hidden_size}, "
            f"got input of shape {tuple(hidden.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (vocab_size,):
        raise ValueError(f"linear_bias must have shape ({vocab_size},), got {tuple(bias.shape)}")
    if weight is not None and tuple(weight.shape) != (vocab_size,):
        raise RuntimeError(
            f"weight tensor should be defined either for all {vocab_size} classes or no classes"
        )
    soft_targets = target.is_floating_point() and tuple(target.shape) == (*hidden.shape[:-1], vocab_size)
    if soft_targets:
        if ignore_index is not None:
            raise RuntimeError("ignore_index cannot be specified when target contains probabilities")
        ignore_index = -100
    else:
        ignore_index = -100 if ignore_index is None else ignore_index
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be int, not {type(ignore_index).__name__}")
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise TypeError(
                f"target must hold integer class indices, or class probabilities of shape "
                f"input.shape[:-1] + (V,) = {(*hidden.shape[:-1], vocab_size)}; got dtype {target.dtype} "
                f"and shape {tuple(target.shape)}"
            )
        if target.dim() > 1 and tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(
                f"target must have shape input.shape[:-1] = {tuple(hidden.shape[:-1])} (one class index per "
                f"token) or be 1-D, got {tuple(target.shape)}"
            )
    target_shape = target.shape[:-1] if soft_targets else target.shape
    hidden = _flatten_tokens(hidden)
    target = target.reshape(-1, vocab_size) if soft_targets else target.reshape(-1)
    if target.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"Expected input batch_size ({hidden.shape[0]}) to match target batch_size ({target.shape[0]})"
        )
    dtype = _autocast_dtype(hidden.device.type)
    if dtype is not None:  # autocast's rule for F.linear
        hidden, linear_weight = hidden.to(dtype), linear_weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if not (hidden.dtype == linear_weight.dtype and (bias is None or bias.dtype == hidden.dtype)):
        raise TypeError(
            "input, linear_weight and linear_bias must share one dtype, as F.linear requires; got "
            f"{hidden.dtype}, {linear_weight.dtype}, {None if bias is None else bias.dtype}"
        )
    upcast = bool(upcast) and hidden.dtype in (torch.float16, torch.bfloat16)
    loss_dtype = torch.float32 if upcast else hidden.dtype
    if soft_targets and target.dtype != loss_dtype:
        raise RuntimeError(
            f"class-probability targets must have the loss's dtype {loss_dtype} (the logits' dtype "
            f"after the upcast), got {target.dtype}"
        )
    if weight is not None and weight.dtype != loss_dtype:
        weight = weight.to(loss_dtype)
    if target.dtype == torch.uint8:  # eager accepts Byte class indices; the tile's gather does not
        target = target.long()
    for name, tensor in (("weight (class weights)", weight), ("class-probability target", target)):
        if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                f"tile_pass: the {name} requires grad; the tiled loss differentiates the hidden states, "
                "the projection and its bias only (detach it, or use F.cross_entropy)"
            )
    # Python constants only (Dynamo hands them to an assume_constant_result function): under
    # dynamic=True the head's sizes and the options are specialised (a guard each; the token
    # count stays symbolic)
    options = _textbook.Options(
        vocab_size=operator.index(vocab_size), hidden_size=operator.index(hidden_size), dtype=hidden.dtype,
        device=str(hidden.device),
        has_bias=bias is not None, class_weights=weight is not None, soft_targets=soft_targets,
        upcast=upcast, logit_scale=_constant_float(logit_scale), softcap=_constant_float(softcap),
        ignore_index=operator.index(ignore_index), label_smoothing=_constant_float(label_smoothing),
        reduction=reduction, tile_tokens=_constant_int(tile_tokens), tile_bytes=_constant_int(tile_bytes),
        compile_tiles=bool(compile_tiles),
    )  # fmt: skip
    loss = _textbook.run(options, hidden, linear_weight, bias, target, weight)
    return loss.view(target_shape) if reduction == "none" else loss


def _constant_int(value: int | None) -> int | None:
    """``value`` as a Python int, specialised if Dynamo made it symbolic."""
    return None if value is None else operator.index(value)


def _constant_float(value: float | None) -> float | None:
    """``value`` as a Python float, specialised if Dynamo made it symbolic (``float.hex`` needs
    the number itself; ``float(x)`` and formatting keep it symbolic)."""
    return None if value is None else float.fromhex(float(value).hex())


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return False
    return isinstance(tensor, DTensor)


def _vocab_parallel(
    hidden, linear_weight, target, bias, class_weight, reduction, ignore_index, label_smoothing, tile_tokens,
    tile_bytes, upcast, logit_scale, softcap, compile_tiles,
) -> torch.Tensor:  # fmt: skip
    """A vocabulary-sharded head (see :mod:`tile_pass.vocab_parallel`)."""
    from tile_pass.vocab_parallel import vocab_parallel_cross_entropy

    unsupported = {"linear_bias": bias, "weight (class weights)": class_weight, "logit_scale": logit_scale,
                   "softcap": softcap}  # fmt: skip
    given = [name for name, value in unsupported.items() if value is not None]
    if given or target.is_floating_point():
        what = ", ".join(given) or "class-probability targets"
        raise NotImplementedError(f"tile_pass: a vocabulary-sharded head does not take {what} yet")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    vocab_size, hidden_size = linear_weight.shape
    if hidden.shape[-1] != hidden_size:
        raise ValueError(f"input's last dimension must equal linear_weight.shape[1] = {hidden_size}")
    upcast = bool(upcast) and hidden.dtype in (torch.float16, torch.bfloat16)
    local_vocab = linear_weight.to_local().shape[0]
    tile = choose_tile_tokens(
        max(local_vocab, 1), hidden.dtype, upcast, tile_tokens=tile_tokens, tile_bytes=tile_bytes,
        device=hidden.device, fused=compile_tiles,
    )  # fmt: skip
    return vocab_parallel_cross_entropy(
        _flatten_tokens(hidden), linear_weight, target.reshape(-1), reduction=reduction,
        ignore_index=-100 if ignore_index is None else int(ignore_index), label_smoothing=label_smoothing,
        upcast=upcast, tile_tokens=tile if tile_tokens is not None else auto_tile(tile),
        compile_tiles=compile_tiles,
    )  # fmt: skip
