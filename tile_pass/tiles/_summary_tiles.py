"""Coupled groups longer than a tile, their gradient still formed in forward: per-summary sums.

A nonlinear loss whose groups of coupled tokens (a DPO pair) do not fit one tile ran the tiles
twice: the outputs first, then the gradient at them (four GEMMs per token). Where the loss reads
the outputs only through summaries linear in them, one per group
(:func:`tile_pass.program._token_summaries.token_summaries`), ``d loss / d output_t`` is
``g * u_t`` with ``u`` known before the tiles run and ``g``, one scalar per group, known once the
group's last tile has run. So the groups run one after another, each in tiles of its own tokens
with the tangent ``u``: each tile forms its share of the gradients in forward (three GEMMs per
token) into the group's own weight-gradient sum, and when the group is done, ``g`` (derived by
autograd from the loss's graph) scales that sum into the weight gradient and the group's rows
of the hidden-state gradient. One group's sum is open at a time: one ``[V, H]`` buffer beside the
weight gradient (none for the first group, whose sum is scaled in place).

Refused (the caller runs the tiles twice) where a per-token or row-shared input needs a
gradient, an output is more than one value per token, the sum would be rounded to a half
precision weight's dtype before its scale, the head is sharded, or the accumulators would move
more bytes than the second pass over the tiles they replace (:func:`accumulation_pays`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tile_pass._logging import log
from tile_pass.program import _region
from tile_pass.program._operands import RegionOperands, no_gradient
from tile_pass.program._token_summaries import TokenSummaries
from tile_pass.tiles import _tile_buffers


def accumulation_pays(group_sizes: list[int], tile: int, weight: torch.Tensor, bytes_per_token: int) -> bool:
    """Whether the per-group sums move fewer bytes than the two-pass fallback's second pass:
    each group after the first zeroes its ``[V, H]`` sum, and adds it, scaled, into the weight
    gradient (four passes over ``V * H`` accumulator elements); the second pass reads the head
    and writes and reads each tile's ``[tile, V]`` buffers once more per tile."""
    vocab, width = weight.shape
    acc_bytes = torch.promote_types(torch.float32, weight.dtype).itemsize
    accumulators = max(len(group_sizes) - 1, 0) * 4 * vocab * width * acc_bytes
    num_tiles = sum(-(-size // tile) for size in group_sizes)
    second_pass = num_tiles * (vocab * width * weight.element_size() + tile * bytes_per_token)
    return accumulators <= second_pass


def refusal(program: _region.RowProgram, weight: torch.Tensor, need: RegionOperands[bool]) -> str | None:
    """Why the per-summary schedule cannot run this loop, or ``None``."""
    if any(need.flat()[3:]):
        return "an input beside the head needs a gradient"
    if any(_region.row_part(out.layout, program.vocab_size) != () for out in program.outputs):
        return "an output holds more than one value per token"
    if need.weight and torch.promote_types(torch.float32, weight.dtype) != weight.dtype:
        return "a half-precision weight's per-group sums would be rounded before their scale"
    if program.shard is not None:
        return "the head is sharded"
    return None


def summary_tiles(
    run_tiles: Callable,
    head: tuple,
    summaries: TokenSummaries,
    given: RegionOperands,
    need: RegionOperands[bool],
    rows: torch.Tensor | None,
    zero_outputs: list[torch.Tensor],
) -> tuple[list[torch.Tensor], RegionOperands]:
    """The loop of :func:`tile_pass.tiles._tile_loop.run_tiles`'s results, group by group
    (``head``: its leading arguments, the program, the call and the operands as the tiles take
    them); ``given``: the op's operands, as the loss reads them; ``rows``: the tokens to run
    (``None``: all)."""
    program, _, operands = head
    hidden, weight, bias = operands.hidden, operands.weight, operands.bias
    num_tokens = hidden.shape[0]
    diff = [i for i, out in enumerate(program.outputs) if out.differentiable]
    unit = summaries.unit_tangents(zero_outputs, given, diff)
    tokens = torch.arange(num_tokens) if rows is None else rows.cpu()
    of_token = summaries.groups[tokens]
    summed = torch.isin(of_token, summaries.summed_groups)
    outputs = [torch.zeros(num_tokens, dtype=out.dtype, device=hidden.device) for out in program.outputs]
    grad_hidden = _tile_buffers.zeros(hidden.shape, hidden.dtype, hidden.device) if need.hidden else None
    grad_weight = grad_bias = None
    device = hidden.device

    def keep(loop_outputs, picked):
        for into, value in zip(outputs, loop_outputs, strict=True):
            into.index_copy_(0, picked, value.index_select(0, picked))

    with _tile_buffers.across_loops():  # one logits buffer for every group's tiles
        groups = torch.unique(of_token[summed]).tolist()
        # groups in the order of their first token
        groups.sort(key=lambda g: int(tokens[of_token == g][0]))
        for group in groups:
            picked = tokens[of_token == group].to(device)
            group_outputs, group_grads = run_tiles(*head, unit, need, rows=picked)
            keep(group_outputs, picked)
            scale = summaries.group_gradients(outputs, given)[group]
            if need.hidden:
                rows = group_grads.hidden.index_select(0, picked) * scale.to(hidden.dtype)
                grad_hidden.index_copy_(0, picked, rows)
            grad_weight = _scaled_into(grad_weight, group_grads.weight, scale)
            grad_bias = _scaled_into(grad_bias, group_grads.bias, scale)
            del group_outputs, group_grads
        rest = tokens[~summed].to(device)
        if rest.numel():  # tokens no summary reads: their outputs only
            keep(run_tiles(*head, {}, no_gradient(operands.counts), rows=rest)[0], rest)
    log.debug("%s: %d group(s) of coupled tokens in per-summary sums, three GEMMs per token",
              program.key, len(groups))  # fmt: skip
    if need.weight and grad_weight is None:
        grad_weight = _tile_buffers.zeros(weight.shape, weight.dtype, weight.device)
    if need.bias and grad_bias is None:
        grad_bias = bias.new_zeros(bias.shape, dtype=torch.promote_types(torch.float32, hidden.dtype))
    grads = operands.map(lambda _: None)._replace(hidden=grad_hidden, weight=grad_weight, bias=grad_bias)
    return outputs, grads


def _scaled_into(total: torch.Tensor | None, group_sum: torch.Tensor | None, scale: torch.Tensor):
    """``total + scale * group_sum`` in place (the first group's sum scaled in place)."""
    if group_sum is None:
        return total
    scale = scale.to(group_sum.dtype)
    if total is None:
        return group_sum.mul_(scale)
    return total.addcmul_(group_sum, scale)
