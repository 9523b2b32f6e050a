"""The weight-gradient schedule for a tile loop: how the tiles sum the head's weight gradient.

For half-precision weights the tiles add their ``[V, H]`` contributions into a float32 sum,
rounded once at the end into the model dtype, as one eager GEMM with float32 accumulation
would round. Held as one float32 tensor, that sum plus the returned gradient is 6 bytes per
weight (at Llama-3-8B's head, 3 GiB); the *split* schedule holds it as two 16-bit planes, 4
bytes per weight at the peak (the run-time arithmetic is :mod:`tile_pass.tiles._split_planes`).
A batch that runs as one tile needs no sum (*direct*).

This module only plans: the schedule, the tile it implies, and the bytes each holds.
"""

from __future__ import annotations

import enum

import torch

from tile_pass import _settings
from tile_pass.plan._tiling import MIN_AUTO_TILE, TileSize, padded_rows

#: Rows of a ``[V, H]`` plane handled at a time: bounds the int32/float32 temporaries of the
#: eager split-plane arithmetic and the product block of
#: :func:`tile_pass.tiles._split_planes.split_accumulate_mm_`.
BLOCK_BYTES = 8 * 1024 * 1024
#: A product block is at most 1/16 of the plane (and no smaller than 1 MiB): a small head's
#: block then holds little next to its planes, while every block costs a GEMM call on a strided
#: slice (fewer, larger blocks are faster: 2 MiB blocks of a 128256 x 1024 head take 0.45 s
#: more per step than 8 MiB ones on a 2-core Xeon).
_PRODUCT_BLOCKS = 16
_MIN_PRODUCT_BLOCK = 1024 * 1024


def product_block_rows(rows: int, row_bytes: int) -> int:
    """Rows of the weight-gradient product formed at a time, for a ``[rows, H]`` weight whose
    product rows take ``row_bytes`` each."""
    block = min(BLOCK_BYTES, max(_MIN_PRODUCT_BLOCK, rows * row_bytes // _PRODUCT_BLOCKS))
    return max(1, block // max(1, row_bytes))


class WeightGradSchedule(enum.Enum):
    """How the tiles form the weight gradient."""

    FLOAT32 = "float32"  #: summed across tiles in one ``acc_dtype`` tensor
    SPLIT = "split"  #: summed across tiles in two 16-bit planes of a float32 sum
    DIRECT = "direct"  #: formed by the only tile's GEMM and returned as it is


def schedule_for(weight_dtype: torch.dtype, acc_dtype: torch.dtype = torch.float32) -> WeightGradSchedule:
    """``SPLIT`` for 16-bit weights summed in float32 (it holds 4 bytes per weight instead of 6
    and moves as many bytes per add), ``FLOAT32`` otherwise (the sum is the gradient's own
    dtype, or float64). ``TILE_PASS_WEIGHT_GRAD_SUM`` overrides it for 16-bit weights."""
    if weight_dtype not in (torch.bfloat16, torch.float16) or acc_dtype != torch.float32:
        return WeightGradSchedule.FLOAT32
    chosen = _settings.current().weight_grad_sum
    return WeightGradSchedule.SPLIT if chosen == "auto" else WeightGradSchedule(chosen)


def bytes_per_weight(schedule: WeightGradSchedule, weight_dtype: torch.dtype) -> int:
    """Bytes per weight the weight-gradient sum and the returned gradient hold at the end of
    the tile loop (what ``explain`` and the byte model report)."""
    itemsize = weight_dtype.itemsize
    if schedule is WeightGradSchedule.DIRECT:  # the only tile's gradient is the returned one
        return itemsize
    if schedule is WeightGradSchedule.SPLIT:
        return 4
    acc = max(4, itemsize)
    return acc + (itemsize if itemsize != acc else 0)


#: automatic tiles that are shrunk to fit the half-of-unfused bound stay multiples of this and
#: no smaller than :data:`tile_pass.plan._tiling.MIN_AUTO_TILE`
_TILE_STEP = 64


def plan(
    num_tokens: int,
    tile: int,
    size: TileSize,
    weight_shape: tuple[int, int],
    weight_dtype: torch.dtype,
    acc_dtype: torch.dtype,
    tile_bytes_per_token: int,
    batch_tokens: int | None = None,
) -> tuple[int, WeightGradSchedule]:
    """The tile and the weight-gradient schedule for a batch of ``num_tokens`` run in tiles of
    ``tile`` (:func:`tile_pass.plan._tiling.effective_tile` of the ``size`` asked for).

    For half-precision weights (under the split schedule), a batch that runs as one tile needs
    no sum across tiles: the tile's own GEMM forms the weight gradient with float32
    accumulation and rounds it once, as eager does (``direct``). Float32 weights keep their
    in-place sum, which is the gradient itself.
    With automatic tiles (``size.automatic``) a half-precision batch also runs as one tile
    when that holds fewer bytes than the split sum's low plane plus the smaller tiles:
    ``P * per_token < 2 * V * H + tile * per_token`` (``P``: the batch padded by
    :func:`tile_pass.plan._tiling.padded_rows`). That is the small batches, where the logits are
    small next to the head; the budget bounds the tiles of the split schedule, and this one
    tile holds less than they do with the plane they need, so it may exceed the budget. Under
    the split schedule the automatic tile is no smaller than it need be: each tile reads and
    writes both planes once, so a tile of a quarter of a small batch grows (by powers of two,
    to at least two tiles, within the budget) until it holds half the low plane, where the
    planes still dominate the bytes.

    Then, given the batch's token count (``batch_tokens``, labelled or not), the tile shrinks
    (in steps of 64 tokens, to no fewer than 256) until the step holds at most half of what the
    unfused step would (:func:`held_bytes` against :func:`unfused_bytes`), where such a tile
    exists: from a few thousand tokens the planes leave room for a tile under that bound.
    """
    schedule = schedule_for(weight_dtype, acc_dtype)
    if schedule is not WeightGradSchedule.SPLIT:  # float32 weights: the sum is the gradient; or asked for
        return tile, schedule
    if num_tokens <= tile:
        return tile, WeightGradSchedule.DIRECT
    if not size.automatic:
        return tile, schedule
    padded = padded_rows(num_tokens)
    low_plane = 2 * weight_shape[0] * weight_shape[1]
    if padded * tile_bytes_per_token < low_plane + tile * tile_bytes_per_token:
        return padded, WeightGradSchedule.DIRECT
    # every tile costs one pass over the planes (10 bytes per weight): the tile grows, within
    # the budget and to at least two tiles, until it holds half the low plane
    cap = min(size.tokens, low_plane // 2 // max(1, tile_bytes_per_token))
    while tile * 2 <= cap and tile * 2 <= num_tokens // 2:
        tile *= 2
    if batch_tokens is not None:
        tile = _within_half_of_unfused(tile, batch_tokens, weight_shape, weight_dtype, tile_bytes_per_token)
    return tile, schedule


def unfused_bytes(
    batch_tokens: int, weight_shape: tuple[int, int], itemsize: int, tile_bytes_per_token: int
) -> int:
    """What the unfused step holds at its peak: the logits of every token (in the tiles' dtype,
    ``tile_bytes_per_token`` per token) and the returned weight and hidden gradients."""
    vocab, hidden = weight_shape
    return batch_tokens * tile_bytes_per_token + (vocab + batch_tokens) * hidden * itemsize


def held_bytes(
    tile: int, batch_tokens: int, weight_shape: tuple[int, int], itemsize: int, tile_bytes_per_token: int
) -> int:
    """What the split schedule holds at its peak: the returned gradients (the high plane is the
    weight's), the low plane, one tile's buffers, one block of the weight-gradient product and
    the tile's hidden rows and their gradient."""
    vocab, hidden = weight_shape
    returned = (vocab + batch_tokens) * hidden * itemsize
    product_block = product_block_rows(vocab, hidden * itemsize) * hidden * itemsize
    tile_buffers = tile * tile_bytes_per_token + product_block + 2 * tile * hidden * itemsize
    return returned + 2 * vocab * hidden + tile_buffers


def _within_half_of_unfused(tile, batch_tokens, weight_shape, weight_dtype, tile_bytes_per_token) -> int:
    itemsize = weight_dtype.itemsize
    bound = unfused_bytes(batch_tokens, weight_shape, itemsize, tile_bytes_per_token) // 2
    shrunk = tile
    while (
        shrunk > MIN_AUTO_TILE
        and held_bytes(shrunk, batch_tokens, weight_shape, itemsize, tile_bytes_per_token) > bound
    ):
        shrunk = max(MIN_AUTO_TILE, (shrunk - 1) // _TILE_STEP * _TILE_STEP)
    fits = held_bytes(shrunk, batch_tokens, weight_shape, itemsize, tile_bytes_per_token) <= bound
    return shrunk if fits else tile
