"""A region's row-wise program, run tile by tile, with its gradient derived.

The one tile loop: every rewritten region and :func:`tile_pass.linear_cross_entropy` (whose
region is the textbook loss, :mod:`tile_pass._textbook`) run here. The tile function is the
user's own row-wise subgraph (a :class:`~tile_pass.program._region.RowProgram`), with several per-token
outputs (losses, log-probabilities, log-sum-exps, entropies, ``argmax``), and rows
returned to the caller. One pass over the tiles computes every output: one logits GEMM per
tile, however many consumers the logits had.

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

The tiles' gradient comes from ``torch.autograd.grad`` of the program traced by ``make_fx``,
never from a formula written here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from tile_pass import _distributed, _settings
from tile_pass._caches import BoundedCache
from tile_pass._logging import log
from tile_pass.plan import _plan
from tile_pass.plan._plan import RegionCall, TilePlan, plan_tiles
from tile_pass.plan._tiling import TileSize, effective_tile
from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program import _region
from tile_pass.program._region import RowProgram
from tile_pass.program._token_summaries import token_summaries
from tile_pass.program._token_weights import token_weights
from tile_pass.tiles import _split_planes, _tile_buffers
from tile_pass.tiles._coupled_tiles import CoupledTiles, coupled_tiles, positions, running
from tile_pass.tiles._higher_order import anchors, refuse_higher_order, scaled_by_upstream
from tile_pass.tiles._summary_tiles import accumulation_pays, refusal, summary_tiles
from tile_pass.tiles._tile_kernel import (
    TILE_KERNEL_CACHE_SIZE,
    TensorSpec,
    TileInputs,
    TileKernelKey,
    differentiable,
    trace_fake,
    traced_once,
)
from tile_pass.tiles._tile_passes import finish_tile_graph
from tile_pass.tiles._tile_passes.onednn_gemms import onednn_gemms_apply
from tile_pass.tiles._tile_passes.split_accumulation import finish_split


def _input_spec(key: TileKernelKey, program: RowProgram) -> TileInputs:
    """The shapes and dtypes of a tile's inputs, as the tile loop passes them."""
    T, H, V = key.tile, key.hidden_size, program.vocab_size
    sum_dtypes = {
        WeightGradSchedule.SPLIT: (torch.int16, torch.int16),
        WeightGradSchedule.FLOAT32: (key.acc_dtype,),
    }
    return TileInputs(
        hidden=TensorSpec((T, H), key.hidden_dtype),
        weight=TensorSpec((V, H), key.weight_dtype),
        bias=None if key.bias_dtype is None else TensorSpec((V,), key.bias_dtype),
        token_inputs=tuple(TensorSpec((T, *part), dtype) for part, dtype in key.token_inputs),
        row_inputs=tuple(TensorSpec(shape, dtype) for shape, dtype in key.row_inputs),
        tangents=tuple(
            TensorSpec((T, *_region.row_part(program.outputs[i].layout, V)), program.outputs[i].dtype)
            for i in (key.tangents if not key.coupled else ())
        ),
        weight_grad_sum=tuple(
            TensorSpec((V, H), d) for d in sum_dtypes.get(key.weight_grad, ()) if key.need_weight
        ),
        bias_grad_sum=TensorSpec((V,), key.acc_dtype) if key.need_bias else None,
        row_grad_sums=tuple(
            TensorSpec(shape, key.acc_dtype)
            for (shape, _), need in zip(
                key.row_inputs, key.need_rows or (False,) * len(key.row_inputs), strict=True
            )
            if need
        ),
        coupled=(TensorSpec((T,), torch.int64),) if key.coupled else (),
    )  # fmt: skip


def _joint(key: TileKernelKey, program: RowProgram):
    """``TileInputs -> (*outputs, grad hidden?, grad weight?)``: the program's outputs and the
    gradients of ``sum(tangent * output)``, the weight's and the bias's added into their sums
    (the weight's returned under the ``DIRECT`` schedule)."""
    schedule = key.weight_grad if key.need_weight else None

    need_rows = key.need_rows or (False,) * len(key.row_inputs)
    need_tokens = key.need_tokens or (False,) * len(key.token_inputs)

    def joint(inputs: TileInputs):
        with torch.enable_grad():
            (hidden, weight, bias, *rest), wanted = differentiable(
                (inputs.hidden, inputs.weight, inputs.bias, *inputs.row_inputs, *inputs.token_inputs),
                (key.need_hidden, key.need_weight, key.need_bias, *need_rows, *need_tokens),
            )
            row_inputs, token_inputs = rest[: len(need_rows)], rest[len(need_rows) :]
            outputs = _region.run_program(program, hidden, weight, bias, token_inputs, row_inputs)
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
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted, strict=True)]
        grad_hidden = grads.pop(0) if key.need_hidden else None
        grad_weight = grads.pop(0) if key.need_weight else None
        if schedule is WeightGradSchedule.SPLIT:
            torch.ops.tile_pass.split_accumulate_(*inputs.weight_grad_sum, grad_weight)
        elif schedule is WeightGradSchedule.FLOAT32:
            inputs.weight_grad_sum[0].add_(grad_weight)
        if key.need_bias:
            inputs.bias_grad_sum.add_(grads.pop(0))
        for row_sum in inputs.row_grad_sums:
            row_sum.add_(grads.pop(0))
        result = [out.detach() for out in outputs]
        result += [grad_hidden] if grad_hidden is not None else []
        result += grads  # the per-token inputs' gradients, this tile's rows
        return (*result, grad_weight) if schedule is WeightGradSchedule.DIRECT else tuple(result)

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


def _program_kernel(key: TileKernelKey):
    return traced_once(key, _trace_program_kernel)


def _per_tile(kernel):
    """What the loop calls once per tile: a traced GraphModule's forward, without nn.Module's
    call machinery (5 us a tile)."""
    return kernel.forward if isinstance(kernel, torch.fx.GraphModule) else kernel


def _check_indices(program: RowProgram, token_inputs: list[torch.Tensor]) -> None:
    """Raise as eager does for an index outside the vocabulary, where that costs no host sync:
    on CPU a compiled tile would index out of bounds (and abort); on an accelerator the
    tiles' device-side checks stand, as eager's do."""
    for position, message, ignore_index in program.index_checks:
        index = token_inputs[position]
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


def _skipped_rows(program: RowProgram, token_inputs, hidden, weights: dict | None, values: bool):
    """The tokens the tiles must run, or ``None`` for all of them: on the CPU (finding them on an
    accelerator would synchronise with the host), a token is left out where every output the
    caller needs is zero whatever its logits (``Output.zeros``: an ignored label, a zero mask)
    or reaches the loss with a zero token weight (``weights``, by output; only outputs read by
    the loss alone, or any output when ``values`` are not needed). Its outputs are then zero
    and it adds nothing to any gradient. A product with a zero mask or a zero weight is zero
    only where the logits are finite, so those skips also need finite hidden states there; and
    a zero output times a non-finite token weight (a mean over no labelled token) is NaN in
    eager's gradient, so such a token runs."""
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
            here, exact_here = out.zeros.tokens(token_inputs)
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


class _Need(NamedTuple):
    """Which inputs a loop differentiates: the head's three, then one flag per row-shared and
    per-token input. Crosses the op boundary flat (:meth:`flat`), as one ``list[bool]``."""

    hidden: bool
    weight: bool
    bias: bool
    rows: tuple[bool, ...]
    tokens: tuple[bool, ...]

    @staticmethod
    def of(flags, num_rows: int, num_tokens: int) -> _Need:
        flags = tuple(flags) or (False,) * (3 + num_rows + num_tokens)
        return _Need(*flags[:3], flags[3 : 3 + num_rows], flags[3 + num_rows :])

    def flat(self) -> list[bool]:
        return [self.hidden, self.weight, self.bias, *self.rows, *self.tokens]

    def any(self) -> bool:
        return self.hidden or self.weight or self.bias or any(self.rows) or any(self.tokens)


NO_GRADIENT = _Need(False, False, False, (), ())


def _kernel_key(program, call, tile_plan, hidden, weight, bias, token_inputs, row_inputs, tangents, need):
    """The traced tile function this loop runs (its full-size tiles)."""
    return TileKernelKey(
        program=program.key,
        tile=tile_plan.tile,
        hidden_size=hidden.shape[1],
        vocab_size=program.vocab_size,
        hidden_dtype=hidden.dtype,
        weight_dtype=weight.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        token_inputs=tuple((tuple(t.shape[1:]), t.dtype) for t in token_inputs),
        row_inputs=tuple((tuple(r.shape), r.dtype) for r in row_inputs),
        tangents=tuple(sorted(tangents)) if need.any() else (),
        device=hidden.device,
        need_hidden=need.hidden,
        need_weight=need.weight,
        need_bias=need.bias,
        acc_dtype=torch.promote_types(torch.float32, hidden.dtype),  # float64 in, float64 sums: exact checks
        compiled=call.compile_tiles,
        onednn=onednn_gemms_apply(hidden.device),
        weight_grad=tile_plan.schedule,
        need_rows=need.rows if any(need.rows) else (),
        need_tokens=need.tokens if any(need.tokens) else (),
    )


@dataclasses.dataclass
class _Results:
    """What a loop writes, tile by tile: the outputs and per-token gradients at the tiles' rows,
    and the sums across tiles (the weight's under its schedule, the bias's, the row inputs')."""

    outputs: list[torch.Tensor] | None
    grad_hidden: torch.Tensor | None
    weight_grad_sum: tuple[torch.Tensor, ...]  # FLOAT32: the sum; SPLIT: its two 16-bit planes
    grad_weight: torch.Tensor | None  # DIRECT: the one tile's own
    bias_sum: torch.Tensor | None
    row_sums: tuple[torch.Tensor, ...]
    token_grads: list[torch.Tensor | None]

    @staticmethod
    def allocate(
        program, key, hidden, weight, token_inputs, row_inputs, need, num_tokens, keep_outputs, rows
    ):
        make = _tile_buffers.empty if rows is None else _tile_buffers.zeros  # skipped rows stay zero
        device, acc = hidden.device, key.acc_dtype
        outputs = [
            make((hidden.shape[0], *_region.row_part(out.layout, program.vocab_size)), out.dtype, device)
            for out in program.outputs
        ] if keep_outputs else None  # fmt: skip
        whole = rows is None and num_tokens == key.tile  # one unpadded tile: its hidden gradient is final
        grad_hidden = make(hidden.shape, hidden.dtype, device) if need.hidden and not whole else None
        weight_grad_sum, grad_weight = (), None
        schedule = key.weight_grad if need.weight else None
        if schedule is WeightGradSchedule.SPLIT:  # the float32 sum in two 16-bit planes: 4 bytes per weight
            weight_grad_sum = _split_planes.unwritten_planes(weight.shape, weight.device)
        elif schedule is WeightGradSchedule.DIRECT:  # the only tile forms it (none when no token runs)
            if not num_tokens:
                grad_weight = _tile_buffers.zeros(weight.shape, weight.dtype, weight.device)
        elif need.weight:
            weight_grad_sum = (_tile_buffers.zeros(weight.shape, acc, weight.device),)
        return _Results(
            outputs=outputs,
            grad_hidden=grad_hidden,
            weight_grad_sum=weight_grad_sum,
            grad_weight=grad_weight,
            bias_sum=weight.new_zeros((program.vocab_size,), dtype=acc) if need.bias else None,
            row_sums=tuple(
                r.new_zeros(r.shape, dtype=acc) for r, n in zip(row_inputs, need.rows, strict=True) if n
            ),
            token_grads=[
                _tile_buffers.zeros(t.shape, t.dtype, t.device) if n else None
                for t, n in zip(token_inputs, need.tokens, strict=True)
            ],
        )

    def store(self, result: list, start: int, count: int, picked, num_outputs: int, need: _Need, whole: bool):
        """One tile's results at its rows (``picked``: the rows a gathered tile ran)."""

        def put(into, value):  # one copy; a slice only where rows differ (a padded tile, a part)
            if value.shape[0] != count:
                value = value[:count]
            if picked is not None:
                into.index_copy_(0, picked, value)
            elif count == into.shape[0]:  # the only tile
                into.copy_(value)
            else:
                into[start : start + count] = value

        if self.outputs is not None:
            for out, value in zip(self.outputs, result, strict=False):
                put(out, value)
        if need.hidden:
            if whole:
                self.grad_hidden = result[num_outputs]
            else:
                put(self.grad_hidden, result[num_outputs])
        token_results = iter(result[num_outputs + need.hidden :])
        for grad_sum in (g for g in self.token_grads if g is not None):
            put(grad_sum, next(token_results))

    def finish(self, program, call, hidden, weight, need: _Need):
        """(outputs, grad hidden, grad weight, grad bias, row input grads, token input grads)."""
        grad_weight = self.grad_weight
        if need.weight and len(self.weight_grad_sum) == 2:  # rounded once into the weight dtype
            planes = _split_planes.settle(*self.weight_grad_sum)
            grad_weight = finish_split(*planes, weight.dtype, call.compile_tiles)
        elif self.weight_grad_sum:
            grad_weight = self.weight_grad_sum[0]
        grad_hidden = self.grad_hidden
        if need.hidden and grad_hidden is None:  # no token ran
            grad_hidden = _tile_buffers.zeros(hidden.shape, hidden.dtype, hidden.device)
        if need.hidden and program.shard is not None:  # each rank holds its shard's share
            group = torch.distributed.distributed_c10d._resolve_process_group(program.shard[0])
            torch.distributed.all_reduce(grad_hidden, group=group)
        row_sums = iter(self.row_sums)
        row_grads = [next(row_sums) if n else None for n in need.rows]
        return self.outputs, grad_hidden, grad_weight, self.bias_sum, row_grads, self.token_grads


def _tile_rows(hidden, token_inputs, tangents, start: int, count: int, size: int, rows):
    """One tile's per-token tensors, ``size`` rows: rows ``start:start+count`` of each, or with
    ``rows`` those rows gathered (one gather per input); padded by a repeat of a real row, with
    zero tangents. Returns them with the gathered rows (``None`` without ``rows``)."""
    if rows is None:
        stop = start + count
        return (
            None,
            _tile_of(hidden, start, stop, size),
            tuple(_tile_of(t, start, stop, size) for t in token_inputs),
            tuple(_tile_of(t, start, stop, size, zeros=True) for t in tangents),
        )
    picked = rows[start : start + count]
    gather = _tile_of(picked, 0, count, size)
    return (
        picked,
        hidden.index_select(0, gather),
        tuple(_tile_buffers.gathered(t, gather, slot) for slot, t in enumerate(token_inputs)),
        tuple(_tile_of(t.index_select(0, picked), 0, count, size, zeros=True) for t in tangents),
    )


@_tile_buffers.shared()
def _run_tiles(
    program: RowProgram,
    call: RegionCall,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_inputs: list[torch.Tensor],
    row_inputs: list[torch.Tensor],
    tangents: dict[int, torch.Tensor],
    need: _Need,
    keep_outputs: bool = True,
    rows: torch.Tensor | None = None,
    coupled: tuple[CoupledTiles, list[torch.Tensor]] | None = None,
):
    """Every tile once; returns (outputs, grad hidden, grad weight, grad bias, row input grads,
    token input grads): each output flat over the tokens, the gradients of
    ``sum(tangent * output)`` (or ``None``). With ``rows`` (see :func:`_skipped_rows`) only those
    tokens run, each tile gathering its rows; the others' outputs and per-token gradients are zero.
    With ``coupled`` (tiles of whole coupled groups and the loss's inputs), the tiles run in its
    order and bounds and evaluate the tangents of the differentiable outputs themselves."""
    need = need._replace(
        rows=need.rows or (False,) * len(row_inputs), tokens=need.tokens or (False,) * len(token_inputs)
    )
    if program.bias_added and bias is not None and bias.dtype in (torch.float16, torch.bfloat16):
        bias = bias.float()  # see run_program: its gradient then is not rounded once per tile
    # the traced tiles assume contiguous slices; a derived token weight can be a broadcast scalar
    tangents = {i: t.contiguous() for i, t in tangents.items()}
    token_inputs = [t.contiguous() for t in token_inputs]
    rows, loop_plan = _loop_plan(
        program, call, hidden, weight, bias, token_inputs, row_inputs, tangents, need, rows, coupled
    )
    key = loop_plan.key
    num_tokens = hidden.shape[0] if rows is None else rows.numel()
    tile = key.tile
    out = _Results.allocate(program, key, hidden, weight, token_inputs, row_inputs, need, num_tokens,
                            keep_outputs, rows)  # fmt: skip
    split = need.weight and key.weight_grad is WeightGradSchedule.SPLIT
    direct = need.weight and key.weight_grad is WeightGradSchedule.DIRECT
    whole = rows is None and num_tokens == tile
    row_inputs = tuple(row_inputs)
    tangent_list = [tangents[i] for i in key.tangents] if coupled is None else []
    loop = contextlib.nullcontext() if coupled is None else running(program, hidden.shape[0], coupled[1])
    with loop:
        for start, count, size in loop_plan.tiles:
            kernel = loop_plan.kernel(size)
            picked, hidden_tile, token_tiles, tangent_tiles = _tile_rows(
                hidden, token_inputs, tangent_list, start, count, size, rows
            )
            inputs = TileInputs(
                hidden=hidden_tile,
                weight=weight,
                bias=bias,
                token_inputs=token_tiles,
                row_inputs=row_inputs,
                tangents=tangent_tiles,
                weight_grad_sum=out.weight_grad_sum,
                bias_grad_sum=out.bias_sum,
                row_grad_sums=out.row_sums,
                coupled=() if coupled is None else (positions(picked, size),),
            )
            last = split and start + count == num_tokens  # the last add of a split sum rounds it
            with _split_planes.last_add(out.weight_grad_sum[0]) if last else contextlib.nullcontext():
                result = list(kernel(*inputs.flat()))
            if direct:
                out.grad_weight = result.pop()
            out.store(result, start, count, picked, len(program.outputs), need, whole)
            del inputs, result, hidden_tile, token_tiles, tangent_tiles  # before the next tile's are made
    return out.finish(program, call, hidden, weight, need)


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
            kernel = self.kernels[size] = _per_tile(_program_kernel(key))
        return kernel


def _loop_plan(program, call, hidden, weight, bias, token_inputs, row_inputs, tangents, need, rows, coupled):
    """``(rows, loop plan)`` of one loop: the plan's tiles in token order, or a coupled loop's
    whole groups in its own order (its kernel evaluating its tangents). Only the count of the
    rows reaches a plan in token order (not which tokens were skipped): it is kept per signature."""
    head = (program, call, hidden, weight, bias, token_inputs, row_inputs, tangents, need)
    if coupled is not None:
        rows, loop_plan = coupled[0].order, _coupled_loop(*head, coupled[0])
    else:
        num_tokens = hidden.shape[0] if rows is None else rows.numel()
        signature = (
            program.key, call, num_tokens, hidden.shape, hidden.dtype, hidden.device, weight.shape,
            weight.dtype, weight.device, None if bias is None else bias.dtype,
            tuple((t.shape[1:], t.dtype) for t in token_inputs),
            tuple((r.shape, r.dtype) for r in row_inputs), tuple(sorted(tangents)), need, _settings.current(),
        )  # fmt: skip
        loop_plan = _cached(_loop_plans, signature, lambda: _ordered_loop(*head, num_tokens))
    _plan.ran(loop_plan.tile_plan)
    return rows, loop_plan


def _ordered_loop(program, call, hidden, weight, bias, token_inputs, row_inputs, tangents, need, num_tokens):
    """Tiles of the plan's size over ``num_tokens`` rows, in order, the last one padded."""
    tile_plan = plan_tiles(
        num_tokens, hidden.shape[0], call.tile, weight.shape, weight.dtype, weight.device, call.compile_tiles,
        need.weight,
    )  # fmt: skip
    key = _kernel_key(
        program, call, tile_plan, hidden, weight, bias, token_inputs, row_inputs, tangents, need
    )
    bounds = [(start, min(key.tile, num_tokens - start)) for start in range(0, num_tokens, key.tile)]
    return _LoopPlan(tile_plan, key, _padded(bounds, key.tile))


def _coupled_loop(program, call, hidden, weight, bias, token_inputs, row_inputs, tangents, need, tiles):
    """The tiles of whole coupled groups ``tiles`` (a :class:`CoupledTiles`)."""
    tile_plan = plan_tiles(
        tiles.order.numel(), hidden.shape[0], call.tile, weight.shape, weight.dtype, weight.device,
        call.compile_tiles, need.weight,
    )  # fmt: skip
    tile_plan = dataclasses.replace(tile_plan, tile=tiles.tile, coupled=len(tiles.bounds))
    key = _kernel_key(
        program, call, tile_plan, hidden, weight, bias, token_inputs, row_inputs, tangents, need
    )
    diff = tuple(i for i, out in enumerate(program.outputs) if out.differentiable)
    key = dataclasses.replace(key, tangents=diff if need.any() else (), coupled=True)
    return _LoopPlan(tile_plan, key, _padded(tiles.bounds, key.tile))


def _padded(bounds, tile: int) -> tuple[tuple[int, int, int], ...]:
    """``(start, count)`` tiles with the rows each one's traced function takes: a short tile padded."""
    return tuple(
        (start, count, tile if count == tile else effective_tile(count, TileSize(tile)))
        for start, count in bounds
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


def _zero_outputs(program: RowProgram, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Zeros of the outputs' shapes and dtypes, one broadcast element each: a returned logits
    output would otherwise cost a whole ``[N, V]`` buffer only to stand for "any value"."""
    return [
        torch.zeros((), dtype=out.dtype, device=hidden.device).expand(
            hidden.shape[0], *_region.row_part(out.layout, program.vocab_size)
        )
        for out in program.outputs
    ]


def _fake_outputs(program: RowProgram, hidden: torch.Tensor) -> list[torch.Tensor]:
    return [
        hidden.new_empty(
            (hidden.shape[0], *_region.row_part(out.layout, program.vocab_size)), dtype=out.dtype
        )
        for out in program.outputs
    ]


class RegionResult(NamedTuple):
    """A region op's flat list of tensors, by name: what :func:`_flat_result` lays out and
    :func:`unflatten` reads back (a custom op returns one ``list[Tensor]``)."""

    loss: torch.Tensor | None
    grads: list[torch.Tensor]  # hidden, weight, bias, then per row input, then per token input
    outputs: list[torch.Tensor]


def unflatten(flat: list[torch.Tensor], num_grads: int, loss: bool) -> RegionResult:
    """Read a region op's result: ``[loss?, *grads(num_grads), *outputs]``."""
    head = 1 if loss else 0
    return RegionResult(flat[0] if loss else None, list(flat[head : head + num_grads]),
                        list(flat[head + num_grads :]))  # fmt: skip


def _flat_result(result: RegionResult) -> list[torch.Tensor]:
    return [*([result.loss] if result.loss is not None else []), *result.grads, *result.outputs]


def _grads_as_returned(hidden, weight, bias, token_inputs, row_inputs, grads) -> list[torch.Tensor]:
    """The gradients an op returns, one per input in :class:`_Need` order, in the inputs' dtypes
    (a row input's is summed over the tiles in float32 or float64); an empty tensor where one is
    not needed (a custom op returns tensors)."""
    grad_h, grad_w, grad_b, row_grads, token_grads = grads
    inputs = [hidden, weight, bias, *row_inputs, *token_inputs]
    given = [grad_h, grad_w, grad_b, *row_grads, *token_grads]
    return [
        g.to(t.dtype)
        if g is not None and g.dtype != t.dtype
        else g
        if g is not None
        else weight.new_empty((0,))
        for t, g in zip(inputs, given, strict=True)
    ]


def _fake_grads(hidden, weight, bias, token_inputs, row_inputs, need: _Need) -> list[torch.Tensor]:
    """As :func:`_grads_as_returned` returns them: contiguous, whatever the inputs' layout (a
    transposed weight's gradient is the contiguous ``[V, H]`` sum the tiles form)."""
    inputs = [hidden, weight, bias, *row_inputs, *token_inputs]
    return [
        t.new_empty(t.shape) if n else weight.new_empty((0,))
        for t, n in zip(inputs, need.flat(), strict=True)
    ]


def _resolved(call: str) -> tuple[RegionCall, RowProgram]:
    """The record an op's ``call`` key stands for, and its region's program: parsed once per key
    (the ops' implementations run here each call; :func:`run_region`, which Dynamo may trace,
    parses its key itself)."""
    return _cached(_calls, call, lambda: _parsed(call))


def _parsed(call: str) -> tuple[RegionCall, RowProgram]:
    plan = RegionCall.parse(call)
    return plan, _region.lookup(plan.program)


def _cached(cache: BoundedCache, key, make):
    """``cache[key]``, made by ``make()`` where missing (two threads may both make it: either
    result serves, as both are made from the same key)."""
    value = cache.get(key)
    return value if value is not None else cache.put(key, make())


#: what the per-call path decides once per key (see _resolved, _loop_plan)
_calls = BoundedCache("region calls", TILE_KERNEL_CACHE_SIZE)
_loop_plans = BoundedCache("tile loop plans", TILE_KERNEL_CACHE_SIZE)


def _need(need: list[bool], row_inputs, token_inputs) -> _Need:
    return _Need.of(need, len(row_inputs), len(token_inputs))


# ------------------------------------------------------------------------- scalar loss


@torch.library.custom_op("tile_pass::row_region_loss", mutates_args=())
def _row_region_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_inputs: list[torch.Tensor],
    row_inputs: list[torch.Tensor],
    reduce_inputs: list[torch.Tensor],
    *,
    call: str,
    need: list[bool],
) -> list[torch.Tensor]:
    """``[loss, *grads, *outputs]`` (see :class:`RegionResult`): the gradients of the loss at
    unit upstream gradient, one per input in :class:`_Need` order (empty where not needed), the
    outputs flat over the tokens."""
    plan, region = _resolved(call)
    _check_indices(region, token_inputs)
    need = _need(need, row_inputs, token_inputs)
    if region.reduction.linear:
        # the token weights: d loss / d output, independent of the outputs (a linear reduction)
        tangents = token_weights(region, _zero_outputs(region, hidden), reduce_inputs)
        rows = _skipped_rows(region, token_inputs, hidden, tangents, values=True)
        outputs, *grads = _run_tiles(
            region, plan, hidden, weight, bias, token_inputs, row_inputs, tangents, need, rows=rows
        )
    else:
        outputs, *grads = _nonlinear_loss_tiles(
            region, plan, hidden, weight, bias, token_inputs, row_inputs, reduce_inputs, need
        )
    with _region.dispatch_as_caller():
        loss = _region.run_reduction(region.reduction, outputs, reduce_inputs, hidden.device.type)
    grads = _grads_as_returned(hidden, weight, bias, token_inputs, row_inputs, grads)
    return _flat_result(RegionResult(loss, grads, outputs))


def _nonlinear_loss_tiles(region, plan, hidden, weight, bias, token_inputs, row_inputs, reduce_inputs, need):
    """The tiles of a loss nonlinear in the outputs: whole coupled groups per tile where their
    sizes allow, each tile evaluating ``d loss / d output`` at its own outputs (three GEMMs per
    token); otherwise the outputs first and the gradient at them in a second pass (four)."""
    head = (region, plan, hidden, weight, bias, token_inputs, row_inputs)
    rows = _skipped_rows(region, token_inputs, hidden, None, values=True)
    if not need.any():
        return _run_tiles(*head, {}, NO_GRADIENT, rows=rows)
    num_rows = hidden.shape[0] if rows is None else rows.numel()
    tile_plan = plan_tiles(
        num_rows, hidden.shape[0], plan.tile, weight.shape, weight.dtype, weight.device, plan.compile_tiles,
        need.weight,
    )  # fmt: skip
    shapes = _zero_outputs(region, hidden)
    tiles = coupled_tiles(region, shapes, reduce_inputs, rows, tile_plan.tile, tile_plan.bytes_per_token)
    how = "tiles of whole coupled groups" if tiles is not None else "groups no tile holds"
    log.debug("%s: a loss nonlinear in the outputs, %s", region.key, how)
    if tiles is not None:
        result = _run_tiles(*head, {}, need, coupled=(tiles, list(reduce_inputs)))
        if rows is None or _finite_where_skipped(region, result[0], reduce_inputs, rows):
            return result
        # a token left out reaches the loss with a non-finite weight: in eager its gradient is
        # NaN (zero times NaN), so every token runs
        tiles = coupled_tiles(region, shapes, reduce_inputs, None, tile_plan.tile, tile_plan.bytes_per_token)
        return _run_tiles(*head, {}, need, coupled=(tiles, list(reduce_inputs)))
    result = _summed_groups(head, shapes, reduce_inputs, need, rows, tile_plan)
    if result is not None:
        return result
    outputs, *_ = _run_tiles(*head, {}, NO_GRADIENT, rows=rows)
    tangents = token_weights(region, outputs, reduce_inputs)
    rows = _skipped_rows(region, token_inputs, hidden, tangents, values=False)
    _, *grads = _run_tiles(*head, tangents, need, keep_outputs=False, rows=rows)
    return (outputs, *grads)


def _summed_groups(head, shapes, reduce_inputs, need, rows, tile_plan):
    """Groups longer than a tile in per-summary sums (:mod:`tile_pass.tiles._summary_tiles`),
    three GEMMs per token, or ``None`` where the loss or the loop does not admit them."""
    region, _, hidden, weight = head[:4]
    summaries = token_summaries(region, shapes, reduce_inputs)
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
    result = summary_tiles(_run_tiles, head, summaries, reduce_inputs, need, rows, shapes, NO_GRADIENT)
    if rows is None or _finite_where_skipped(region, result[0], reduce_inputs, rows):
        return result
    # a token left out reaches the loss with a non-finite weight (eager's gradient is NaN there)
    return summary_tiles(_run_tiles, head, summaries, reduce_inputs, need, None, shapes, NO_GRADIENT)


def _finite_where_skipped(region, outputs, reduce_inputs, rows) -> bool:
    """Whether ``d loss / d output`` is finite at every token the tiles left out."""
    skipped = torch.ones(outputs[0].shape[0], dtype=torch.bool, device=outputs[0].device)
    skipped[rows] = False
    weights = token_weights(region, outputs, reduce_inputs)
    return all(bool(torch.isfinite(w.expand(outputs[i].shape)[skipped]).all()) for i, w in weights.items())


@_row_region_loss.register_fake
def _(hidden, weight, bias, token_inputs, row_inputs, reduce_inputs, *, call, need):
    region = _resolved(call)[1]
    loss = hidden.new_empty((), dtype=region.reduction.dtype)
    grads = _fake_grads(hidden, weight, bias, token_inputs, row_inputs, _need(need, row_inputs, token_inputs))
    return _flat_result(RegionResult(loss, grads, _fake_outputs(region, hidden)))


def _loss_setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, bias, token_inputs, row_inputs, reduce_inputs = inputs
    ctx.need = _need(keyword_only_inputs["need"], row_inputs, token_inputs)
    ctx.counts = (len(token_inputs), len(row_inputs), len(reduce_inputs))
    ctx.call = keyword_only_inputs["call"]
    region = _resolved(ctx.call)[1]
    result = unflatten(output, len(ctx.need.flat()), loss=True)
    # outputs read outside the loss too (a metric of the logits): differentiable, their gradient
    # the tiles' re-run in backward, only where one arrives
    ctx.diff = [i for i, out in enumerate(region.outputs) if out.differentiable]
    ctx.free = [i for i in ctx.diff if not region.outputs[i].only_loss]
    kept = (hidden, weight, bias, *token_inputs, *row_inputs) if ctx.free else ()
    ctx.num_kept = len(kept)
    ctx.save_for_backward(*result.grads, *kept, *anchors(hidden, weight, bias, *row_inputs, *token_inputs))
    ctx.mark_non_differentiable(*(o for i, o in enumerate(result.outputs) if i not in ctx.free))
    ctx.set_materialize_grads(False)


def _loss_vjp(ctx, grads):
    # Glue, not a gradient formula: the gradients were derived in forward at unit upstream
    # gradient; the loss is a scalar, so the chain rule scales them by the incoming gradient.
    saved = ctx.saved_tensors
    need = ctx.need.flat()
    num_grads = len(need)
    loss_grads, kept = saved[:num_grads], saved[num_grads : num_grads + ctx.num_kept]
    anchored = saved[num_grads + ctx.num_kept :]
    tokens, rows, reduce = ctx.counts
    if grads[0] is not None:
        scaled = scaled_by_upstream(loss_grads, grads[0], need, anchored)
    else:
        refuse_higher_order()
        scaled = [None] * num_grads
    outputs = grads[1 + num_grads :]
    arrived = [i for i in ctx.free if outputs[i] is not None]
    if arrived:  # the outputs' own gradients: a re-run of the tiles, as the per-token op's backward
        hidden, weight, bias, *rest = kept
        token_inputs, row_inputs = list(rest[:tokens]), list(rest[tokens:])
        zeros = _zero_outputs(_resolved(ctx.call)[1], hidden)
        tangents = [outputs[i] if i in arrived else zeros[i] for i in ctx.diff]
        more = _row_region_backward(
            tangents, hidden, weight, bias, token_inputs, row_inputs, call=ctx.call, need=need
        )
        scaled = [
            (a if b is None or not n else b if a is None else a + b)
            for a, b, n in zip(scaled, more, need, strict=True)
        ]
    row_grads, token_grads = scaled[3 : 3 + rows], scaled[3 + rows :]
    return (*scaled[:3], list(token_grads), list(row_grads), [None] * reduce)


_row_region_loss.register_autograd(_loss_vjp, setup_context=_loss_setup_context)


# --------------------------------------------------------------------- per-token outputs


@torch.library.custom_op("tile_pass::row_region", mutates_args=())
def _row_region(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_inputs: list[torch.Tensor],
    row_inputs: list[torch.Tensor],
    *,
    call: str,
) -> list[torch.Tensor]:
    """The outputs, flat over the tokens; nothing is differentiated in forward."""
    plan, region = _resolved(call)
    _check_indices(region, token_inputs)
    rows = _skipped_rows(region, token_inputs, hidden, None, values=True)
    outputs, *_ = _run_tiles(
        region, plan, hidden, weight, bias, token_inputs, row_inputs, {}, NO_GRADIENT, rows=rows
    )
    return outputs


@_row_region.register_fake
def _(hidden, weight, bias, token_inputs, row_inputs, *, call):
    return _fake_outputs(_resolved(call)[1], hidden)


@torch.library.custom_op("tile_pass::row_region_backward", mutates_args=())
def _row_region_backward(
    tangents: list[torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_inputs: list[torch.Tensor],
    row_inputs: list[torch.Tensor],
    *,
    call: str,
    need: list[bool],
) -> list[torch.Tensor]:
    """The vector-Jacobian product for the differentiable outputs' ``tangents`` (in order): one
    gradient per input in :class:`_Need` order."""
    plan, region = _resolved(call)
    diff = [i for i, out in enumerate(region.outputs) if out.differentiable]
    tangents = dict(zip(diff, tangents, strict=True))
    rows = _skipped_rows(region, token_inputs, hidden, tangents, values=False)
    _, *grads = _run_tiles(
        region, plan, hidden, weight, bias, token_inputs, row_inputs, tangents,
        _need(need, row_inputs, token_inputs), keep_outputs=False, rows=rows,
    )  # fmt: skip
    return _grads_as_returned(hidden, weight, bias, token_inputs, row_inputs, grads)


@_row_region_backward.register_fake
def _(tangents, hidden, weight, bias, token_inputs, row_inputs, *, call, need):
    return _fake_grads(hidden, weight, bias, token_inputs, row_inputs, _need(need, row_inputs, token_inputs))


def _region_setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, bias, token_inputs, row_inputs = inputs
    ctx.call = keyword_only_inputs["call"]
    ctx.counts = (len(token_inputs), len(row_inputs))
    ctx.input_needs = (
        tuple(r.requires_grad for r in row_inputs),
        tuple(t.requires_grad for t in token_inputs),
    )
    ctx.save_for_backward(hidden, weight, bias, *token_inputs, *row_inputs)
    ctx.region = region = _resolved(ctx.call)[1]
    ctx.diff = [i for i, out in enumerate(region.outputs) if out.differentiable]
    ctx.mark_non_differentiable(*[o for i, o in enumerate(output) if i not in ctx.diff])


def _region_vjp(ctx, grads):
    # The incoming per-token gradients become the tangents of a re-run of the tiles, whose
    # gradient is derived (see _joint): an exact vector-Jacobian product.
    refuse_higher_order()
    hidden, weight, bias, *rest = ctx.saved_tensors
    token_inputs, row_inputs = rest[: ctx.counts[0]], rest[ctx.counts[0] :]
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need = _Need(need_h, need_w, need_b and bias is not None, *ctx.input_needs)
    zeros = _zero_outputs(ctx.region, hidden)  # for the outputs whose gradient is unused
    tangents = [grads[i] if grads[i] is not None else zeros[i] for i in ctx.diff]
    result = _row_region_backward(
        tangents, hidden, weight, bias, list(token_inputs), list(row_inputs), call=ctx.call, need=need.flat()
    )
    grad_h, grad_w, grad_b, *input_grads = (
        g if n else None for g, n in zip(result, need.flat(), strict=True)
    )
    rows = ctx.counts[1]
    return grad_h, grad_w, grad_b, input_grads[rows:], input_grads[:rows]


_row_region.register_autograd(_region_vjp, setup_context=_region_setup_context)


def run_region(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_inputs: list[torch.Tensor],
    row_inputs: list[torch.Tensor],
    reduce_inputs: list[torch.Tensor],
    *,
    call: str,
) -> list[torch.Tensor]:
    """What the rewritten graph calls: the region's outputs (flat over the tokens), preceded
    by its scalar loss when the program has one. ``call``: a :class:`RegionCall`'s key. A
    vocabulary-sharded DTensor head runs the same op on this rank's local pieces."""
    if hasattr(weight, "device_mesh"):  # a DTensor head
        return _distributed.on_local_shards(
            functools.partial(run_region, call=call), hidden, weight, bias, token_inputs, row_inputs,
            reduce_inputs,
        )  # fmt: skip
    hidden = hidden.flatten(0, -2) if hidden.dim() > 1 else hidden.unsqueeze(0)
    region = _region.lookup(RegionCall.parse(call).program)
    if region.reduction is None:
        return _row_region(hidden, weight, bias, token_inputs, row_inputs, call=call)
    grad_on = torch.is_grad_enabled()
    need = _Need(
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
        tuple(grad_on and r.requires_grad for r in row_inputs),
        tuple(grad_on and t.requires_grad for t in token_inputs),
    )
    flat = _row_region_loss(
        hidden, weight, bias, token_inputs, row_inputs, reduce_inputs, call=call,
        need=need.flat() if need.any() else [],
    )  # fmt: skip
    result = unflatten(flat, 3 + len(row_inputs) + len(token_inputs), loss=True)
    return [result.loss, *result.outputs]
