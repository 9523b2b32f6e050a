"""The one tile loop: every tile of a region once, the traced tile function on each.

Every region op (:mod:`tile_pass.tiles.tiled_region`) runs its tiles here. :func:`run_tiles`
reads as its schedule: plan the loop, allocate what it writes, then per tile take its rows,
run the tile function (:mod:`tile_pass.tiles._tile_function`) and store its rows; finish the
sums. What may be left out of it is decided before it (:func:`skipped_rows`), on the CPU only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import torch

from tile_pass import _settings
from tile_pass._caches import BoundedCache
from tile_pass.plan import _plan
from tile_pass.plan._plan import RegionCall, TilePlan, plan_tiles
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program._operands import GroupKind, RegionOperands
from tile_pass.program._region import RowProgram
from tile_pass.tiles import _split_planes, _tile_buffers, _tile_function
from tile_pass.tiles._coupled_tiles import CoupledTiles, positions, running
from tile_pass.tiles._tile_kernel import TILE_KERNEL_CACHE_SIZE, TileInputs, TileKernelKey
from tile_pass.tiles._tile_passes.onednn_gemms import onednn_gemms_apply
from tile_pass.tiles._tile_results import TileResults


def check_indices(program: RowProgram, tokens: tuple[torch.Tensor, ...]) -> None:
    """Raise as eager does for an index outside the vocabulary, where that costs no host sync:
    on CPU a compiled tile would index out of bounds (and abort); on an accelerator the
    tiles' device-side checks stand, as eager's do. ``tokens``: the per-token operands."""
    for position, message, ignore_index in program.index_checks:
        index = tokens[position]
        if index.device.type != "cpu" or index.numel() == 0:
            continue
        vocab_size = program.shard[2] if program.shard is not None else program.vocab_size
        if _in_vocabulary(index, vocab_size, ignore_index):
            continue
        bad = (index < 0) | (index >= vocab_size)
        if ignore_index is not None:
            bad &= index != ignore_index
        if bad.any():
            error = IndexError if message.startswith("Target") else RuntimeError
            raise error(message.format(int(index[bad][0])))


def _in_vocabulary(index: torch.Tensor, vocab_size: int, ignore_index: int | None) -> bool:
    """Whether every index is in ``[0, vocab_size)`` or is ``ignore_index``: the smallest and
    largest index, the ignored ones counted as 0 (three small ops each call, where finding the
    bad ones takes five; those are found only when this says there are some)."""
    if vocab_size == 0 or index.dtype not in _INDEX_DTYPES:
        return False
    if ignore_index is not None:
        index = index.masked_fill(index == ignore_index, 0)
    low, high = torch.aminmax(index)
    return int(low) >= 0 and int(high) < vocab_size


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _zero_weight(weight: torch.Tensor, num_tokens: int) -> torch.Tensor | bool:
    """Per token, whether its token weight is zero over its whole row part (see _uniform)."""
    value = _uniform(weight)
    if value is not None:
        return value == 0
    return weight == 0 if weight.dim() == 1 else (weight.reshape(num_tokens, -1) == 0).all(-1)


def _finite_weight(weight: torch.Tensor, num_tokens: int) -> torch.Tensor | bool:
    """Per token, whether its token weight is finite over its whole row part (see _uniform)."""
    value = _uniform(weight)
    if value is not None:
        return math.isfinite(value)
    flags = torch.isfinite(weight if weight.dim() == 1 else weight.reshape(num_tokens, -1))
    return flags if weight.dim() == 1 else flags.all(-1)


def _uniform(weight: torch.Tensor) -> float | None:
    """The one value of a weight broadcast to every token (a mean's ``1 / count``), else ``None``:
    a flag of it then stands for every token, one element read instead of a pass over them."""
    if weight.numel() and not any(weight.stride()):
        return weight.as_strided((), ()).item()
    return None


def _either(a: torch.Tensor | bool, b: torch.Tensor | bool) -> torch.Tensor | bool:
    """``a | b`` of per-token flags, where a ``bool`` stands for every token (no op for one)."""
    if a is False or b is True:
        return b
    if b is False or a is True:
        return a
    return a | b


def _both(a: torch.Tensor | bool, b: torch.Tensor | bool) -> torch.Tensor | bool:
    """``a & b`` of per-token flags, as :func:`_either`."""
    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    return a & b


def skipped_rows(program: RowProgram, operands: RegionOperands, weights: dict | None, values: bool):
    """The tokens the tiles must run, or ``None`` for all of them: on the CPU (finding them on an
    accelerator would synchronise with the host), a token is left out where every output the
    caller needs is zero whatever its logits (``Output.zeros``: an ignored label, a zero mask)
    or reaches the loss with a zero token weight (``weights``, by output; only outputs read by
    the loss alone, or any output when ``values`` are not needed). Its outputs are then zero
    and it adds nothing to any gradient. A product with a zero mask or a zero weight is zero
    only where the logits are finite, so those skips also need finite hidden states there; and
    a zero output times a non-finite token weight (a mean over no labelled token) is NaN in
    eager's gradient, so such a token runs. ``operands.hidden``: flat over the tokens."""
    hidden = operands.hidden
    if hidden.device.type != "cpu" or hidden.shape[0] == 0:
        return None
    skip, exact = None, True
    for index, out in enumerate(program.outputs):
        if out.layout == "rows" or (not values and (weights is None or index not in weights)):
            if out.layout == "rows" and values:
                return None
            continue
        here = None
        if out.zeros is not None:
            here, exact_here = out.zeros.tokens(operands.tokens)
            exact = exact and exact_here
        if weights is not None and index in weights and (out.only_loss or not values):
            flag = _zero_weight(weights[index], hidden.shape[0])
            here, exact = (flag if here is None else _either(here, flag)), False
        if here is None:
            return None
        skip = here if skip is None else _both(skip, here)
    if skip is not None and weights:
        for weight in weights.values():  # out of place: ``skip`` may be a caller's mask
            skip = _both(skip, _finite_weight(weight, hidden.shape[0]))
    if isinstance(skip, bool):  # flags of broadcast weights only: the same for every token
        skip = torch.full((hidden.shape[0],), skip, dtype=torch.bool, device=hidden.device)
    if skip is None or not skip.any():
        return None
    if not exact and not torch.isfinite(hidden[skip]).all():
        return None  # eager's loss is not finite there, so the tokens stay in
    return (~skip).nonzero().squeeze(1)


def _kernel_key(program: RowProgram, call: RegionCall, tile_plan: TilePlan, operands: RegionOperands,
                tangents, need: RegionOperands[bool]) -> TileKernelKey:  # fmt: skip
    """The traced tile function this loop runs (its full-size tiles): per-token operands by
    their row part, the others whole; the tiles take no ``reduce`` group."""
    parts = operands.in_tiles().map(lambda t: (tuple(t.shape), t.dtype))
    hidden = operands.hidden
    return TileKernelKey(
        program=program.key,
        tile=tile_plan.tile,
        vocab_size=program.vocab_size,
        operands=parts._replace(hidden=(tuple(hidden.shape[1:]), hidden.dtype)).with_kind(
            GroupKind.PER_TOKEN, lambda part: (part[0][1:], part[1])
        ),
        tangents=tuple(sorted(tangents)) if need.any() else (),
        device=hidden.device,
        need=need.in_tiles(),
        acc_dtype=torch.promote_types(torch.float32, hidden.dtype),  # float64 in, float64 sums: exact checks
        compiled=call.compile_tiles,
        onednn=onednn_gemms_apply(hidden.device),
        weight_grad=tile_plan.schedule,
    )


def _tile_rows(operands: RegionOperands, tangents, start: int, count: int, size: int, rows):
    """One tile's operands, its per-token ones at ``size`` rows: rows ``start:start+count`` of
    each, or with ``rows`` those rows gathered (one gather per input); padded by a repeat of a
    real row, with zero tangents. Returns the gathered rows (``None`` without ``rows``), the
    tile's operands (no ``reduce`` group) and its tangents."""
    if rows is None:
        stop = start + count
        return (
            None,
            operands.in_tiles()
            ._replace(hidden=_tile_of(operands.hidden, start, stop, size))
            .with_kind(GroupKind.PER_TOKEN, lambda t: _tile_of(t, start, stop, size)),
            tuple(_tile_of(t, start, stop, size, zeros=True) for t in tangents),
        )
    picked = rows[start : start + count]
    gather, slots = _tile_of(picked, 0, count, size), itertools.count()
    return (
        picked,
        operands.in_tiles()
        ._replace(hidden=operands.hidden.index_select(0, gather))
        .with_kind(GroupKind.PER_TOKEN, lambda t: _tile_buffers.gathered(t, gather, next(slots))),
        tuple(_tile_of(t.index_select(0, picked), 0, count, size, zeros=True) for t in tangents),
    )


def _tile_of(t: torch.Tensor, start: int, stop: int, size: int, zeros: bool = False) -> torch.Tensor:
    """Rows ``start:stop`` of ``t``, padded to ``size`` rows. Padding rows repeat a real row
    (finite wherever the data is) and get a zero tangent (``zeros``), so they add exactly
    nothing to any gradient sum."""
    if start or stop != t.shape[0]:  # the whole tensor is its own tile: no slice to dispatch
        t = t[start:stop]
    if t.shape[0] == size:
        return t
    missing = size - t.shape[0]
    pad = t.new_zeros((missing, *t.shape[1:])) if zeros else t[:1].expand(missing, *t.shape[1:])
    return torch.cat([t, pad])


@_tile_buffers.shared()
def run_tiles(
    program: RowProgram,
    call: RegionCall,
    operands: RegionOperands,
    tangents: dict[int, torch.Tensor],
    need: RegionOperands[bool],
    keep_outputs: bool = True,
    rows: torch.Tensor | None = None,
    coupled: CoupledTiles | None = None,
    loss_operands: RegionOperands | None = None,
) -> tuple:
    """Every tile once; returns ``(outputs, gradients)`` (see :meth:`TileResults.finish`): each
    output flat over the tokens, the gradients of ``sum(tangent * output)`` by operand.
    ``operands.hidden`` is flat over the tokens. With ``rows`` (see :func:`skipped_rows`) only
    those tokens run, each tile gathering its rows; the others' outputs and per-token gradients
    are zero. With ``coupled`` (tiles of whole coupled groups), the tiles run in its order and
    bounds and evaluate the tangents of the differentiable outputs themselves, from the loss's
    ``loss_operands`` (the op's, the hidden states as the graph shapes them)."""
    operands, tangents = _as_tiles_take(program, operands, tangents)
    rows, loop_plan = _loop_plan(program, call, operands, tangents, need, rows, coupled)
    key = loop_plan.key
    num_tokens = operands.hidden.shape[0] if rows is None else rows.numel()
    out = TileResults.allocate(program, key, operands, num_tokens, keep_outputs, rows)
    split = need.weight and key.weight_grad is WeightGradSchedule.SPLIT
    direct = need.weight and key.weight_grad is WeightGradSchedule.DIRECT
    tangent_list = [tangents[i] for i in key.tangents] if coupled is None else []
    tokens = operands.hidden.shape[0]
    loop = contextlib.nullcontext() if coupled is None else running(program, tokens, loss_operands)
    with loop:
        for start, count, size in loop_plan.tiles:
            kernel = loop_plan.kernel(size)
            picked, tile_operands, tangent_tiles = _tile_rows(
                operands, tangent_list, start, count, size, rows
            )
            inputs = TileInputs(
                operands=tile_operands,
                tangents=tangent_tiles,
                weight_grad_sum=out.weight_grad_sum,
                bias_grad_sum=out.bias_sum,
                whole_grad_sums=out.whole_sums,
                coupled=() if coupled is None else (positions(picked, size),),
            )
            last = split and start + count == num_tokens  # the last add of a split sum rounds it
            with _split_planes.last_add(out.weight_grad_sum[0]) if last else contextlib.nullcontext():
                result = list(kernel(*inputs.flat()))
            if direct:
                out.grad_weight = result.pop()
            out.store(result, start, count, picked, len(program.outputs))
            del inputs, result, tile_operands, tangent_tiles  # before the next tile's are made
    return out.finish(program, call.compile_tiles, operands)


def _as_tiles_take(program: RowProgram, operands: RegionOperands, tangents: dict):
    """The operands and tangents as the traced tiles take them: contiguous (a derived token
    weight can be a broadcast scalar), a half-precision bias added after the matmul upcast (see
    ``run_program``: its gradient then is not rounded once per tile)."""
    bias = operands.bias
    if program.bias_added and bias is not None and bias.dtype in (torch.float16, torch.bfloat16):
        bias = bias.float()
    tangents = {i: t.contiguous() for i, t in tangents.items()}
    return operands._replace(bias=bias).with_kind(GroupKind.PER_TOKEN, lambda t: t.contiguous()), tangents


@dataclasses.dataclass(frozen=True)
class _LoopPlan:
    """What a tile loop decides from the program, the plan's constants, the sizes, dtypes and
    devices and what it differentiates, and from nothing else: made once per such signature
    (:func:`_loop_plan`), so a step with the same shapes pays a dictionary lookup for it."""

    tile_plan: TilePlan
    key: TileKernelKey  # the full-size tiles' traced function
    tiles: tuple[tuple[int, int, int], ...]  # (first row, rows, the traced tile's rows: padded)
    kernels: dict = dataclasses.field(default_factory=dict, compare=False)  # by tile rows, on first use

    def kernel(self, size: int):
        """The per-tile function of ``size`` rows (traced once per process, see traced_once)."""
        kernel = self.kernels.get(size)
        if kernel is None:
            key = self.key if size == self.key.tile else dataclasses.replace(self.key, tile=size)
            kernel = self.kernels[size] = _tile_function.per_tile(_tile_function.tile_kernel(key))
        return kernel


def _loop_plan(program, call, operands: RegionOperands, tangents, need, rows, coupled):
    """``(rows, loop plan)`` of one loop: the plan's tiles in token order, or a coupled loop's
    whole groups in its own order (its kernel evaluating its tangents). Only the count of the
    rows reaches a plan in token order (not which tokens were skipped): it is kept per signature."""
    head = (program, call, operands, tangents, need)
    if coupled is not None:
        rows, loop_plan = coupled.order, _coupled_loop(*head, coupled)
    else:
        hidden, weight, bias = operands.hidden, operands.weight, operands.bias
        num_tokens = hidden.shape[0] if rows is None else rows.numel()
        signature = (
            program.key, call, num_tokens, hidden.shape, hidden.dtype, hidden.device, weight.shape,
            weight.dtype, weight.device, None if bias is None else bias.dtype,
            tuple((t.shape[1:], t.dtype) for t in operands.of_kind(GroupKind.PER_TOKEN)),
            tuple((t.shape, t.dtype) for t in operands.in_tiles().of_kind(GroupKind.WHOLE)),
            tuple(sorted(tangents)), need, _settings.current(),
        )  # fmt: skip
        loop_plan = cached(_loop_plans, signature, lambda: _ordered_loop(*head, num_tokens))
    _plan.ran(loop_plan.tile_plan)
    return rows, loop_plan


def _ordered_loop(program, call, operands: RegionOperands, tangents, need, num_tokens: int) -> _LoopPlan:
    """Tiles of the plan's size over ``num_tokens`` rows, in order, the last one padded."""
    hidden, weight = operands.hidden, operands.weight
    tile_plan = plan_tiles(
        num_tokens, hidden.shape[0], call.tile, weight.shape, weight.dtype, weight.device, call.compile_tiles,
        need.weight,
    )  # fmt: skip
    key = _kernel_key(program, call, tile_plan, operands, tangents, need)
    bounds = [(start, min(key.tile, num_tokens - start)) for start in range(0, num_tokens, key.tile)]
    return _LoopPlan(tile_plan, key, _padded(tile_plan, bounds))


def _coupled_loop(program, call, operands: RegionOperands, tangents, need, tiles: CoupledTiles) -> _LoopPlan:
    """The tiles of whole coupled groups ``tiles``, in its order (its kernel evaluating its tangents)."""
    hidden, weight = operands.hidden, operands.weight
    tile_plan = plan_tiles(
        tiles.order.numel(), hidden.shape[0], call.tile, weight.shape, weight.dtype, weight.device,
        call.compile_tiles, need.weight,
    )  # fmt: skip
    tile_plan = tile_plan.in_groups(tiles.tile, len(tiles.bounds))
    key = _kernel_key(program, call, tile_plan, operands, tangents, need)
    diff = tuple(i for i, out in enumerate(program.outputs) if out.differentiable)
    key = dataclasses.replace(key, tangents=diff if need.any() else (), coupled=True)
    return _LoopPlan(tile_plan, key, _padded(tile_plan, tiles.bounds))


def _padded(tile_plan: TilePlan, bounds) -> tuple[tuple[int, int, int], ...]:
    """``(start, count)`` tiles with the rows each one's traced function takes: a short tile padded."""
    return tuple((start, count, tile_plan.rows_for(count)) for start, count in bounds)


def cached(cache: BoundedCache, key, make):
    """``cache[key]``, made by ``make()`` where missing (two threads may both make it: either
    result serves, as both are made from the same key)."""
    value = cache.get(key)
    return value if value is not None else cache.put(key, make())


#: the loops' plans by signature (see _loop_plan)
_loop_plans = BoundedCache("tile loop plans", TILE_KERNEL_CACHE_SIZE)
