"""Everything distributed: a vocabulary-sharded (tensor-parallel) LM head's region.

Each rank of the tensor-parallel group holds rows ``[start, start + V_r)`` of the head and
runs the region's row-wise program (``tile_pass.program._region``) on its own ``[tile, V_r]``
logits, one tile of tokens at a time, in the one tile loop (``tile_pass.tiles.tiled_region``).
Elementwise steps are local; each step that reduces, normalises or indexes over the
vocabulary is replaced by its group-wide form here (the op's ``sharded`` fact), built from two
collectives of ``[tile]`` values: a max that is only a shift, and :func:`_group_sum`. No
rank ever holds more than a tile of its shard's logits.

The gradient is derived, not written: the tile function is traced by ``make_fx`` with the
collectives in it (functional collectives), and differentiated by ``autograd.grad``. A
group-wide sum enters the function as ``local + stop_gradient(global - local)``: its value
is the global sum and its derivative with respect to this rank's logits is the derivative of
this rank's share, which is the exact derivative of the global loss with respect to them.
Each rank's hidden-state gradient is its shard's share; one all-reduce over ``[N, H]`` after
the tiles sums the shares, as the replicated hidden states require (``tiled_region``).

Two ways in: a Dynamo graph whose example values are DTensors (torchtitan's
``ColwiseParallel(output_layouts=Shard(-1))``; the matcher reads the shard from them, and the
rewritten graph's ``run_region`` runs on the local shards: :func:`on_local_shards`), and
:func:`tile_pass.linear_cross_entropy` with a ``Shard(0)`` weight (:func:`local_head` unwraps
it; its textbook region is matched with the shard given explicitly, :data:`VOCAB_SHARD_META`).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

#: ``node.meta`` key of a graph's LM-head weight holding ``(process group name, this rank's
#: first row, its rows)``: the matcher builds the sharded program of that head. The weight's
#: example value is the whole ``[V, H]`` head; at run time the graph takes this rank's rows.
VOCAB_SHARD_META = "tile_pass_vocab_shard"


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


def shard_kl_div(x, target, *, group_name, reduction, log_target=False):
    """``kl_div`` as region steps take it (``reduction='none'``, the row sum a step of its own):
    elementwise, so each rank's columns alone; the row sum after it is group-wide."""
    if reduction != "none":
        raise ValueError(f"a region's kl_div step is per element, not reduction={reduction!r}")
    return F.kl_div(x, target, reduction="none", log_target=log_target)


def shard_elementwise(target, op: str, replicated: tuple[int, ...], group_name: str, *args, **kwargs):
    """An elementwise step of the rows whose operands at ``replicated`` are per-token values
    computed from the logits: those enter the shard through :func:`into_shard`."""
    args = [into_shard(a, group_name) if i in replicated else a for i, a in enumerate(args)]
    if op == "call_method":
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


def on_local_shards(run, hidden, weight, bias, token_inputs, row_inputs, reduce_inputs):
    """``run`` (the region op's entry) for a vocabulary-sharded DTensor head: on this rank's
    local pieces, its outputs (every one per token, hence the same on every rank) returned as
    replicated DTensors, as ``loss_parallel`` returns them."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = weight.device_mesh

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    token_inputs, row_inputs, reduce_inputs = (
        [local(t) for t in inputs] for inputs in (token_inputs, row_inputs, reduce_inputs)
    )
    outputs = run(local(hidden), weight.to_local(), None, token_inputs, row_inputs, reduce_inputs)
    return [DTensor.from_local(out, mesh, [Replicate()], run_check=False) for out in outputs]


def local_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, int, int]]:
    """``(hidden, weight, target, shard)``: this rank's plain pieces of
    :func:`tile_pass.linear_cross_entropy`'s vocabulary-sharded head (a ``Shard(0)`` DTensor
    weight on a 1-D mesh, uneven shards included) and replicated hidden states and targets
    (plain tensors or ``Replicate`` DTensors), with the shard for :data:`VOCAB_SHARD_META`.

    The functional API traces its textbook loss on the whole head's shapes, marks the weight
    with the shard, and runs the rewritten graph on plain local tensors: the matcher builds the
    same sharded program as for a DTensor graph (one matcher, one program, one tile loop), and
    no DTensor op is left in the graph, so Dynamo inlines it as the unsharded one
    (``fullgraph=True``, ``dynamic=True``). Tracing on fake DTensors instead would need
    ``loss_parallel()`` to propagate the examples, which has no form for every option.
    ``to_local`` makes the weight's gradient its ``Shard(0)`` DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise NotImplementedError(
            "tile_pass: a DTensor LM-head weight must be sharded over the vocabulary (placements "
            f"(Shard(0),)) on a 1-D tensor-parallel mesh; got {tuple(weight.placements)} on a "
            f"{mesh.ndim}-D mesh. Pass the tensor-parallel sub-mesh's weight (mesh['tp'])."
        )
    unsupported = {"linear_bias": bias, "weight (class weights)": class_weights}
    given = [name for name, value in unsupported.items() if value is not None]
    if given or target.is_floating_point():
        what = ", ".join(given) or "class-probability targets"
        raise NotImplementedError(
            f"tile_pass: a vocabulary-sharded head does not take {what} yet (the sharded program has no "
            "[V] or [tokens, V] operand); pass the whole head (linear_weight.full_tensor()) instead"
        )
    for name, value in (("input", hidden), ("target", target)):
        if isinstance(value, DTensor) and tuple(value.placements) != (Replicate(),):
            raise NotImplementedError(
                f"tile_pass: {name} must be replicated over the tensor-parallel mesh; got "
                f"{tuple(value.placements)} (redistribute it to [Replicate()])"
            )
    hidden, target = (t.to_local() if isinstance(t, DTensor) else t for t in (hidden, target))
    start, rows = shard_rows(operator.index(weight.shape[0]), mesh.size(), mesh.get_local_rank())
    return hidden, weight.to_local(), target, (mesh.get_group().group_name, start, rows)
