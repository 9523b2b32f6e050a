"""The tiled cross entropy of a vocabulary-sharded (tensor-parallel) LM head.

Each rank of the tensor-parallel group holds rows ``[start, start + V_r)`` of the head and
computes its own ``[tile, V_r]`` logits, one tile of tokens at a time. Per tile, three
reductions cross the group: the max of the logits, the sum of their exponentials and the
target's logit (plus the sum of the logits under label smoothing), each one ``[tile]``
float32 all-reduce. No rank ever holds more than a tile of its shard's logits.

The gradient is derived, not written: the tile function is traced by ``make_fx`` with the
collectives in it (functional collectives), and differentiated by ``autograd.grad``. A
group-wide sum enters the function as ``local + stop_gradient(global - local)``: its value
is the global sum and its derivative with respect to this rank's logits is the derivative of
this rank's share, which is the exact derivative of the global loss with respect to them.
Each rank's hidden-state gradient is its shard's share; one all-reduce over ``[N, H]`` after
the tiles sums the shares, as the replicated hidden states require.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from tile_pass import _tile_buffers
from tile_pass._higher_order import anchors, scaled_by_upstream
from tile_pass._tile_kernel import TensorSpec, differentiable, trace_fake, traced_once
from tile_pass._tile_passes import finish_tile_graph
from tile_pass._tile_passes.onednn_gemms import onednn_gemms_apply
from tile_pass._tiling import TileSize, effective_tile
from tile_pass._weight_grad import WeightGradSchedule


@dataclasses.dataclass(frozen=True)
class _ShardKey:
    tile: int
    hidden_size: int
    local_vocab: int
    vocab_start: int
    vocab_size: int
    dtype: torch.dtype
    upcast: bool
    ignore_index: int
    label_smoothing: float
    group_name: str
    device: torch.device
    need_hidden: bool
    need_weight: bool
    acc_dtype: torch.dtype
    compiled: bool = False
    onednn: bool = False
    weight_grad: WeightGradSchedule = WeightGradSchedule.FLOAT32


def shard_rows(vocab_size: int, degree: int, rank: int) -> tuple[int, int]:
    """``(first row, rows)`` of ``rank``'s ``Shard(0)`` piece of ``vocab_size`` rows: DTensor
    shards as ``torch.chunk`` does, ``ceil(V / degree)`` rows a rank, the last ones fewer (or
    none). Plain arithmetic, so Dynamo traces it (torch 2.11 cannot trace DTensor's helper)."""
    per_rank = -(-vocab_size // degree)
    first = min(rank * per_rank, vocab_size)
    return first, min(per_rank, vocab_size - first)


def _group_sum(local: torch.Tensor, group_name: str) -> torch.Tensor:
    """The group-wide sum, differentiable as this rank's share (see the module docstring)."""
    share = local.detach()
    return local + (funcol.all_reduce(share, "sum", group_name) - share)


def _token_losses(key: _ShardKey, hidden, weight, target):
    """Per-token cross entropy over the whole vocabulary, from this rank's shard of it."""
    logits = F.linear(hidden, weight)
    if key.upcast:
        logits = logits.float()
    peak = funcol.all_reduce(logits.detach().amax(-1), "max", key.group_name)  # a shift only
    sum_exp = _group_sum((logits - peak.unsqueeze(-1)).exp().sum(-1), key.group_name)
    lse = sum_exp.log() + peak
    owned = (target >= key.vocab_start) & (target < key.vocab_start + key.local_vocab)
    local_index = (target - key.vocab_start).clamp(0, key.local_vocab - 1).unsqueeze(-1)
    target_logit = torch.where(owned, logits.gather(-1, local_index).squeeze(-1), 0.0)
    losses = lse - _group_sum(target_logit, key.group_name)
    if key.label_smoothing:
        mean_logit = _group_sum(logits.sum(-1), key.group_name) / key.vocab_size
        losses = (1 - key.label_smoothing) * losses + key.label_smoothing * (lse - mean_logit)
    return torch.where(target != key.ignore_index, losses, 0.0)


def _joint(key: _ShardKey):
    def joint(hidden, weight, target, coef, *accumulators):
        with torch.enable_grad():
            (hidden, weight), wanted = differentiable((hidden, weight), (key.need_hidden, key.need_weight))
            losses = _token_losses(key, hidden, weight, target)
            grads = list(torch.autograd.grad((losses * coef).sum(), wanted)) if wanted else []
        grad_hidden = grads.pop(0) if key.need_hidden else None
        if key.need_weight:
            accumulators[0].add_(grads.pop(0))
        return (losses.detach(), grad_hidden) if grad_hidden is not None else (losses.detach(),)

    return joint


def _trace(key: _ShardKey):
    T, H = key.tile, key.hidden_size
    inputs = [
        ((T, H), key.dtype),
        ((key.local_vocab, H), key.dtype),
        ((T,), torch.int64),
        ((T,), key.acc_dtype),
    ]
    if key.need_weight:
        inputs.append(((key.local_vocab, H), key.acc_dtype))
    spec = [TensorSpec(*i) for i in inputs]
    return finish_tile_graph(trace_fake(lambda args: _joint(key)(*args), spec, key.device), key)


@torch.library.custom_op("tile_pass::vocab_parallel_ce", mutates_args=())
def _vocab_parallel_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group_name: str,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int,
    label_smoothing: float,
    mean: bool,
    upcast: bool,
    tile_tokens: int,
    auto_tile: bool,
    compile_tiles: bool,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad hidden, grad of this rank's weight shard)`` at unit upstream gradient."""
    num_tokens, hidden_size = hidden.shape
    if target.device.type == "cpu":  # on an accelerator the tiles' device-side checks stand
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
        if bad.any():
            raise IndexError(f"Target {int(target[bad][0])} is out of bounds.")
    acc = torch.promote_types(torch.float32, hidden.dtype)
    valid = (target != ignore_index).to(acc)
    count = valid.sum()
    coef = valid / count if mean else valid
    tile = effective_tile(num_tokens, TileSize(tile_tokens, auto_tile))
    key = _ShardKey(
        tile, hidden_size, weight.shape[0], vocab_start, vocab_size, hidden.dtype, upcast, ignore_index,
        float(label_smoothing), group_name, hidden.device, need_hidden, need_weight, acc, compile_tiles,
        onednn_gemms_apply(hidden.device),
    )  # fmt: skip
    total = hidden.new_zeros((), dtype=acc)
    grad_hidden = hidden.new_empty((0,))
    if need_hidden:
        grad_hidden = _tile_buffers.empty(hidden.shape, hidden.dtype, hidden.device)
    weight_acc = _tile_buffers.zeros(weight.shape, acc, weight.device) if need_weight else None
    # every rank runs the same tiles in the same order: the collectives pair up
    for start in range(0, num_tokens, tile):
        stop = min(start + tile, num_tokens)
        size = tile if stop - start == tile else effective_tile(stop - start, TileSize(tile))
        kernel = traced_once(key if size == tile else dataclasses.replace(key, tile=size), _trace)
        h_t, y_t, c_t = hidden[start:stop], target[start:stop], coef[start:stop]
        if size != stop - start:  # padding: ignored tokens of zero weight
            pad = size - (stop - start)
            h_t = torch.cat([h_t, h_t.new_zeros(pad, hidden_size)])
            y_t = torch.cat([y_t, y_t.new_full((pad,), ignore_index)])
            c_t = torch.cat([c_t, c_t.new_zeros(pad)])
        out = kernel(h_t, weight, y_t, c_t, *([weight_acc] if need_weight else []))
        total += out[0][: stop - start].sum(dtype=acc)
        if need_hidden:
            grad_hidden[start:stop] = out[1][: stop - start]
    if need_hidden:  # each rank holds its shard's share of d loss / d hidden
        dist.all_reduce(grad_hidden, group=dist.distributed_c10d._resolve_process_group(group_name))
    loss = (total / count if mean else total).to(torch.float32 if upcast else hidden.dtype)
    grad_weight = weight_acc.to(weight.dtype) if need_weight else hidden.new_empty((0,))
    return loss, grad_hidden, grad_weight


@_vocab_parallel_ce.register_fake
def _(hidden, weight, target, *, group_name, vocab_start, vocab_size, ignore_index, label_smoothing, mean,
      upcast, tile_tokens, auto_tile, compile_tiles, need_hidden, need_weight):  # fmt: skip
    return (
        hidden.new_empty((), dtype=torch.float32 if upcast else hidden.dtype),
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty((0,)),
        weight.new_empty(weight.shape) if need_weight else hidden.new_empty((0,)),
    )


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.need = (keyword_only_inputs["need_hidden"], keyword_only_inputs["need_weight"])
    ctx.save_for_backward(output[1], output[2], *anchors(*inputs[:2]))


def _vjp(ctx, grad_loss, _grad_hidden, _grad_weight):
    # Glue, not a gradient formula: the gradients were derived in forward at unit upstream
    # gradient; the loss is a scalar, so the chain rule scales them by the incoming gradient.
    saved = ctx.saved_tensors
    return (*scaled_by_upstream(saved[:2], grad_loss, ctx.need, saved[2:]), None)


_vocab_parallel_ce.register_autograd(_vjp, setup_context=_setup_context)


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight,
    target: torch.Tensor,
    *,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    upcast: bool,
    tile_tokens: TileSize,
    compile_tiles: bool = False,
    shard: tuple[str, int] | None = None,
) -> torch.Tensor:
    """The loss of ``F.linear(hidden, weight)`` for a ``DTensor`` weight sharded over the
    vocabulary (``Shard(0)`` on a 1-D mesh, uneven shards included), with hidden states and
    targets replicated over that mesh (plain tensors or ``Replicate`` DTensors); called by
    :func:`tile_pass.linear_cross_entropy`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise NotImplementedError(
            "tile_pass: a DTensor LM-head weight must be sharded over the vocabulary (placements "
            f"(Shard(0),)) on a 1-D tensor-parallel mesh; got {tuple(weight.placements)} on a "
            f"{mesh.ndim}-D mesh. "
            "Pass the tensor-parallel sub-mesh's weight (mesh['tp'])."
        )
    if reduction not in ("mean", "sum"):
        raise NotImplementedError("tile_pass: a vocabulary-sharded head takes reduction 'mean' or 'sum'")
    for name, value in (("input", hidden), ("target", target)):
        if isinstance(value, DTensor) and tuple(value.placements) != (Replicate(),):
            raise NotImplementedError(f"tile_pass: {name} must be replicated over the tensor-parallel mesh")
    hidden = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    target = target.to_local() if isinstance(target, DTensor) else target
    if shard is None:  # (group name, first row): the pass gives them, read before tracing
        shard = (
            mesh.get_group().group_name,
            shard_rows(weight.shape[0], mesh.size(), mesh.get_local_rank())[0],
        )
    group_name, vocab_start = shard
    local = weight.to_local()
    grad_on = torch.is_grad_enabled()
    loss, _, _ = _vocab_parallel_ce(
        hidden, local, target, group_name=group_name, vocab_start=int(vocab_start),
        vocab_size=int(weight.shape[0]), ignore_index=ignore_index, label_smoothing=float(label_smoothing),
        mean=reduction == "mean", upcast=upcast, tile_tokens=tile_tokens.tokens,
        auto_tile=tile_tokens.automatic, compile_tiles=compile_tiles,
        need_hidden=grad_on and hidden.requires_grad, need_weight=grad_on and local.requires_grad,
    )  # fmt: skip
    return loss


# ------------------------------------------------------- row-wise regions over a shard
#
# A row-wise region (``tile_pass._region``) of a vocabulary-sharded head runs on this rank's
# ``[tile, V_r]`` logits. Elementwise steps are local; each step that reduces, normalises or
# indexes over the vocabulary is replaced by its group-wide form below, built from the same
# two collectives as the cross entropy above (a max that is only a shift, and
# ``_group_sum``). The matcher makes the replacement (``shard_step``); the tile function is
# then traced and differentiated as for a single device.


class _IntoShard(torch.autograd.Function):
    """A per-token value, the same on every rank, entering this rank's ``[tile, V_r]`` rows.

    Each rank's rows give only their share of the value's gradient, so the shares are summed
    across the group: the derivative of a broadcast, as ``_group_sum``'s is that of a sum.
    (Uses of the value by the per-token computation, which every rank runs whole, already
    give the whole gradient and do not pass through here.)"""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Glue, not a loss formula: the derivative of the broadcast (the ranks' shares of a
        # replicated value's gradient, summed), the counterpart of _group_sum's. The loss's
        # gradient is autograd's through the user's steps; the float64 tests cover it
        # (tests/test_tensor_parallel.py::test_row_wise_regions_of_a_sharded_head_are_tiled_and_exact).
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group_name), None


def into_shard(value: torch.Tensor, group_name: str) -> torch.Tensor:
    return _IntoShard.apply(value, group_name)


def _group_lse(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``logsumexp(x, -1, keepdim=True)`` over the whole vocabulary, in float32 or wider."""
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    peak = funcol.all_reduce(wide.detach().amax(-1, keepdim=True), "max", group_name)
    return _group_sum((wide - peak).exp().sum(-1, keepdim=True), group_name).log() + peak


def shard_logsumexp(x: torch.Tensor, dim: int, keepdim: bool, *, group_name: str) -> torch.Tensor:
    lse = _group_lse(x, group_name).to(x.dtype)
    return lse if keepdim else lse.squeeze(-1)


def shard_sum(x, dim, keepdim=False, *, group_name: str, dtype=None):
    return _group_sum(x.sum(-1, keepdim=keepdim, dtype=dtype), group_name)


def shard_mean(x, dim, keepdim=False, *, group_name: str, vocab_size: int, dtype=None):
    return shard_sum(x, dim, keepdim, group_name=group_name, dtype=dtype) / vocab_size


def shard_log_softmax(x, dim, *, group_name: str, dtype=None):
    x = x if dtype is None else x.to(dtype)
    lse = into_shard(_group_lse(x, group_name), group_name)
    return ((x.float() if x.dtype != torch.float64 else x) - lse).to(x.dtype)


def shard_softmax(x, dim, *, group_name: str, dtype=None):
    x = x if dtype is None else x.to(dtype)
    wide = x if x.dtype == torch.float64 else x.float()
    return (wide - into_shard(_group_lse(x, group_name), group_name)).exp().to(x.dtype)


def _owned_gather(x: torch.Tensor, index: torch.Tensor, vocab_start: int, group_name: str) -> torch.Tensor:
    """``x.gather(-1, index)`` over the whole vocabulary: the rank holding the id contributes it."""
    rows = x.shape[-1]
    local = index - vocab_start
    owned = (local >= 0) & (local < rows)
    picked = x.gather(-1, local.clamp(0, rows - 1))
    return _group_sum(torch.where(owned, picked, torch.zeros_like(picked)), group_name)


def shard_gather(x, dim, index, *, group_name: str, vocab_start: int):
    return _owned_gather(x, index, vocab_start, group_name)


def shard_cross_entropy(x, target, *, group_name, vocab_start, vocab_size, ignore_index, reduction,
                        label_smoothing=0.0):  # fmt: skip
    """Per-token cross entropy (``reduction='none'``, as region steps take it)."""
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    lse = _group_lse(wide, group_name).squeeze(-1)
    index = torch.where(target == ignore_index, 0, target).unsqueeze(-1)
    losses = lse - _owned_gather(wide, index, vocab_start, group_name).squeeze(-1)
    if label_smoothing:
        mean_logit = _group_sum(wide.sum(-1), group_name) / vocab_size
        losses = (1 - label_smoothing) * losses + label_smoothing * (lse - mean_logit)
    return torch.where(target != ignore_index, losses, 0.0).to(x.dtype)


def shard_nll_loss(x, target, *, group_name, vocab_start, ignore_index, reduction):
    index = torch.where(target == ignore_index, 0, target).unsqueeze(-1)
    picked = _owned_gather(x, index, vocab_start, group_name).squeeze(-1)
    return torch.where(target != ignore_index, -picked, torch.zeros_like(picked))


_METHOD_STEPS = {"sum": shard_sum, "mean": shard_mean, "logsumexp": shard_logsumexp}
_FUNCTION_STEPS = {
    F.log_softmax: shard_log_softmax,
    F.softmax: shard_softmax,
    torch.gather: shard_gather,
    F.cross_entropy: shard_cross_entropy,
    F.nll_loss: shard_nll_loss,
}


def shard_elementwise(target, op: str, replicated: tuple[int, ...], group_name: str, *args, **kwargs):
    """An elementwise step of the rows whose operands at ``replicated`` are per-token values
    computed from the logits: those enter the shard through :func:`into_shard`."""
    args = [into_shard(a, group_name) if i in replicated else a for i, a in enumerate(args)]
    if op == "call_method":
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


def shard_step(step, group_name: str, vocab_start: int, vocab_size: int):
    """The group-wide form of a region step over the vocabulary, or ``None`` where there is no
    such form here (the caller declines the region, naming the op)."""
    from tile_pass._region import Step

    kwargs = dict(step.kwargs)
    if step.op == "call_method":
        function = _METHOD_STEPS.get(step.target)
    else:
        function = _FUNCTION_STEPS.get(step.target)
    if function is None or "weight" in kwargs:
        return None
    shard = {"group_name": group_name}
    if function in (shard_gather, shard_cross_entropy, shard_nll_loss):
        shard["vocab_start"] = vocab_start
    if function in (shard_mean, shard_cross_entropy):
        shard["vocab_size"] = vocab_size
    return Step("call_function", function, step.args, tuple({**kwargs, **shard}.items()), step.autocast,
                step.source)  # fmt: skip


def run_sharded_region(hidden, weight, bias, token_inputs, row_inputs, reduce_inputs, *, program: str,
                       tile_tokens: int, compile_tiles: bool):  # fmt: skip
    """What the rewritten graph calls for a region of a vocabulary-sharded head: the region op
    on this rank's local pieces, its outputs (every one per token, hence the same on every
    rank) returned as replicated DTensors, as ``loss_parallel`` returns them."""
    from torch.distributed.tensor import DTensor, Replicate

    from tile_pass.tiled_region import run_region

    mesh = weight.device_mesh

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    token_inputs, row_inputs, reduce_inputs = (
        [local(t) for t in inputs] for inputs in (token_inputs, row_inputs, reduce_inputs)
    )
    outputs = run_region(
        local(hidden), weight.to_local(), None, token_inputs, row_inputs, reduce_inputs,
        program=program, tile_tokens=tile_tokens, compile_tiles=compile_tiles,
    )  # fmt: skip
    return [DTensor.from_local(out, mesh, [Replicate()], run_check=False) for out in outputs]
