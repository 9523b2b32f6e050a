"""What the region ops return, and where the tile loop writes it.

A custom op returns one ``list[Tensor]``: :class:`RegionResult` names its parts (the scalar
loss, the gradients the caller needs, the outputs) and :func:`unflatten` reads them back. The
gradients are a :class:`~tile_pass.program._operands.RegionOperands`, by group as the inputs
are: only the needed ones cross the op boundary, and ``need.picked`` puts them back in place.
:class:`TileResults` is the loop's side: the buffers each tile writes its rows into, and the
sums across tiles, finished once the last tile ran.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from tile_pass.plan._weight_grad import WeightGradSchedule
from tile_pass.program import _region
from tile_pass.program._operands import GroupKind, RegionOperands, filled
from tile_pass.program._region import RowProgram
from tile_pass.tiles import _split_planes, _tile_buffers
from tile_pass.tiles._tile_kernel import TileKernelKey
from tile_pass.tiles._tile_passes.split_accumulation import finish_split


class RegionResult(NamedTuple):
    """A region op's flat list of tensors, by name: what :meth:`flat` lays out and
    :func:`unflatten` reads back (a custom op returns one ``list[Tensor]``)."""

    loss: torch.Tensor | None
    grads: list[torch.Tensor]  # the needed ones, in RegionOperands.flat order
    outputs: list[torch.Tensor]

    def flat(self) -> list[torch.Tensor]:
        return [*([self.loss] if self.loss is not None else []), *self.grads, *self.outputs]


def unflatten(flat: list[torch.Tensor], need: RegionOperands[bool], loss: bool) -> RegionResult:
    """Read a region op's result: ``[loss?, *needed grads, *outputs]``."""
    head, num_grads = (1 if loss else 0), sum(need.flat())
    return RegionResult(flat[0] if loss else None, list(flat[head : head + num_grads]),
                        list(flat[head + num_grads :]))  # fmt: skip


def grads_as_returned(operands: RegionOperands, grads: RegionOperands, need: RegionOperands[bool]) -> list:
    """The needed gradients an op returns, in :meth:`RegionOperands.flat` order and in their
    inputs' shapes and dtypes (the hidden states' as the graph shapes them; a shared input's is
    summed over the tiles in float32 or float64)."""
    return [
        g.reshape(t.shape).to(t.dtype)
        for t, g, n in zip(operands.flat(), grads.flat(), need.flat(), strict=True)
        if n
    ]


def fake_grads(operands: RegionOperands, need: RegionOperands[bool]) -> list[torch.Tensor]:
    """As :func:`grads_as_returned` returns them: contiguous, whatever the inputs' layout (a
    transposed weight's gradient is the contiguous ``[V, H]`` sum the tiles form)."""
    return [t.new_empty(t.shape) for t, n in zip(operands.flat(), need.flat(), strict=True) if n]


def zero_outputs(program: RowProgram, num_tokens: int, device: torch.device) -> list[torch.Tensor]:
    """Zeros of the outputs' shapes and dtypes, one broadcast element each: a returned logits
    output would otherwise cost a whole ``[N, V]`` buffer only to stand for "any value"."""
    return [
        torch.zeros((), dtype=out.dtype, device=device).expand(
            num_tokens, *_region.row_part(out.layout, program.vocab_size)
        )
        for out in program.outputs
    ]


def fake_outputs(program: RowProgram, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The outputs' shapes and dtypes for ``hidden``'s tokens (flat)."""
    return [
        hidden.new_empty(
            (hidden.shape[0], *_region.row_part(out.layout, program.vocab_size)), dtype=out.dtype
        )
        for out in program.outputs
    ]


@dataclasses.dataclass
class TileResults:
    """What a loop writes, tile by tile: the outputs and per-token gradients at the tiles' rows,
    and the sums across tiles (the weight's under its schedule, the bias's, the shared inputs')."""

    outputs: list[torch.Tensor] | None
    grad_hidden: torch.Tensor | None  # at every token (a whole tile's own, set by store)
    #: the per-token groups' gradients at every token, flat in group order, ``None`` where not needed
    per_token: list[torch.Tensor | None]
    weight_grad_sum: tuple[torch.Tensor, ...]  # FLOAT32: the sum; SPLIT: its two 16-bit planes
    grad_weight: torch.Tensor | None  # DIRECT: the one tile's own
    bias_sum: torch.Tensor | None
    whole_sums: tuple[torch.Tensor, ...]  # the whole groups' gradients, summed across the tiles
    need: RegionOperands[bool]
    whole: bool  # one unpadded tile: its hidden gradient is final, no buffer to copy it into

    @staticmethod
    def allocate(
        program, key: TileKernelKey, operands: RegionOperands, num_tokens: int, keep_outputs: bool, rows
    ) -> TileResults:
        make = _tile_buffers.empty if rows is None else _tile_buffers.zeros  # skipped rows stay zero
        hidden, weight, need, acc = operands.hidden, operands.weight, key.need, key.acc_dtype
        vocab = program.vocab_size
        outputs = [
            make((hidden.shape[0], *_region.row_part(out.layout, vocab)), out.dtype, hidden.device)
            for out in program.outputs
        ] if keep_outputs else None  # fmt: skip
        whole = rows is None and num_tokens == key.tile
        per_token = [
            _tile_buffers.zeros(t.shape, t.dtype, t.device) if n else None
            for t, n in zip(
                operands.of_kind(GroupKind.PER_TOKEN), need.of_kind(GroupKind.PER_TOKEN), strict=True
            )
        ]
        weight_grad_sum, grad_weight = (), None
        schedule = key.weight_grad if need.weight else None
        if schedule is WeightGradSchedule.SPLIT:  # the float32 sum in two 16-bit planes: 4 bytes per weight
            weight_grad_sum = _split_planes.unwritten_planes(weight.shape, weight.device)
        elif schedule is WeightGradSchedule.DIRECT:  # the only tile forms it (none when no token runs)
            if not num_tokens:
                grad_weight = _tile_buffers.zeros(weight.shape, weight.dtype, weight.device)
        elif need.weight:
            weight_grad_sum = (_tile_buffers.zeros(weight.shape, acc, weight.device),)
        return TileResults(
            outputs=outputs,
            grad_hidden=make(hidden.shape, hidden.dtype, hidden.device)
            if need.hidden and not whole
            else None,
            per_token=per_token,
            weight_grad_sum=weight_grad_sum,
            grad_weight=grad_weight,
            bias_sum=weight.new_zeros((program.vocab_size,), dtype=acc) if need.bias else None,
            whole_sums=tuple(
                s.new_zeros(s.shape, dtype=acc)
                for s, n in zip(operands.of_kind(GroupKind.WHOLE), need.of_kind(GroupKind.WHOLE), strict=True)
                if n
            ),
            need=need,
            whole=whole,
        )

    def store(self, result: list, start: int, count: int, picked, num_outputs: int) -> None:
        """One tile's results at its rows (``picked``: the rows a gathered tile ran): its outputs,
        then its per-token gradients (:func:`~tile_pass.tiles._tile_function._joint`'s order)."""

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
        grads = iter(result[num_outputs:])
        if self.need.hidden:
            if self.whole:
                self.grad_hidden = next(grads)
            else:
                put(self.grad_hidden, next(grads))
        for into in self.per_token:
            if into is not None:
                put(into, next(grads))

    def finish(self, program: RowProgram, compile_tiles: bool, operands: RegionOperands) -> tuple:
        """``(outputs, gradients)``: the outputs flat over the tokens (``None`` unless kept), the
        gradients of ``sum(tangent * output)`` by operand (``None`` where not needed)."""
        need, weight, hidden = self.need, operands.weight, operands.hidden
        grad_weight = self.grad_weight
        if need.weight and len(self.weight_grad_sum) == 2:  # rounded once into the weight dtype
            planes = _split_planes.settle(*self.weight_grad_sum)
            grad_weight = finish_split(*planes, weight.dtype, compile_tiles)
        elif self.weight_grad_sum:
            grad_weight = self.weight_grad_sum[0]
        grad_hidden = self.grad_hidden
        if need.hidden and grad_hidden is None:  # no token ran
            grad_hidden = _tile_buffers.zeros(hidden.shape, hidden.dtype, hidden.device)
        if need.hidden and program.shard is not None:  # each rank holds its shard's share
            group = torch.distributed.distributed_c10d._resolve_process_group(program.shard[0])
            torch.distributed.all_reduce(grad_hidden, group=group)
        whole_sums = iter(self.whole_sums)
        grads = operands.map(lambda _: None)._replace(
            hidden=grad_hidden, weight=grad_weight, bias=self.bias_sum
        )
        grads = filled(grads, GroupKind.PER_TOKEN, self.per_token)
        whole = (next(whole_sums) if n else None for n in need.of_kind(GroupKind.WHOLE))
        grads = filled(grads, GroupKind.WHOLE, whole)
        return self.outputs, grads
