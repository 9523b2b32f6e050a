"""Tiles that hold the tokens a nonlinear loss couples, and the gradient that makes them pay.

For a scalar loss that is nonlinear in the region's outputs (``ReductionProgram.linear`` is
false), :func:`coupled_tiles` orders the tokens so that each group
:func:`tile_pass.program._token_groups.token_groups` found (a chosen sequence and its rejected
partner) lies in one tile, and packs whole groups into tiles. Each such tile evaluates
``d loss / d output`` at its own outputs inside the traced tile function, through
``tile_pass::tile_tangents`` (the loss and the batch come from the running loop, so the traced
tile holds no batch size): the tile's outputs are placed among zeros at their tokens and the
reduction's derived gradient (:func:`tile_pass.program._token_weights.token_weights`) is read
back at those tokens. The values at the other tokens do not matter, because no token of the
tile is coupled to them. The tile then forms its share of every gradient in forward, with the
logits it has: three GEMMs per token, as for a linear loss.

Where groups are too large for a tile's memory, or the analysis cannot tell the groups, the
caller runs the tiles twice instead (outputs first, then the gradient at them): four GEMMs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch

from tile_pass.plan._plan import TilePlan
from tile_pass.program import _region
from tile_pass.program._operands import RegionOperands
from tile_pass.program._token_groups import token_groups
from tile_pass.program._token_weights import token_weights

#: a group of coupled tokens may grow a tile to this many bytes of the tile's ``[tile, V]``
#: buffers (the byte model's), or to twice the planned tile, whichever is more
COUPLED_TILE_BYTES = 256 * 2**20


class CoupledTiles(NamedTuple):
    """The token order and tile bounds a coupled loop runs."""

    order: torch.Tensor  # int64: the tokens the tiles run, each group's together
    bounds: tuple[tuple[int, int], ...]  # (start, count) in ``order``, whole groups each
    tile: int  # the tiles' rows: the plan's, or a padded size that holds the largest group


def coupled_tiles(
    program: _region.RowProgram,
    outputs: list[torch.Tensor],
    operands: RegionOperands,
    rows: torch.Tensor | None,
    tile_plan: TilePlan,
) -> CoupledTiles | None:
    """Tiles of whole coupled groups over ``rows`` (all tokens when ``None``), about the plan's
    tile each (its :meth:`~TilePlan.group_tile`); ``None`` when the groups are not known or one
    is too large for a tile."""
    groups = token_groups(program, outputs, operands)
    if groups is None:
        return None
    num_tokens = outputs[0].shape[0]
    tokens = torch.arange(num_tokens) if rows is None else rows.cpu()
    if tokens.numel() == 0:
        return None
    of_token = groups[tokens]
    # each group in the order of its first token, its tokens ascending
    _, inverse = torch.unique(of_token, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), num_tokens, dtype=torch.int64)
    first.scatter_reduce_(0, inverse, tokens, reduce="amin")
    order_key = first[inverse] * (num_tokens + 1) + tokens
    order = tokens[torch.argsort(order_key)]
    sizes = torch.bincount(inverse)
    cap = tile_plan.group_tile(int(sizes.max()), COUPLED_TILE_BYTES)
    if cap is None:
        return None
    bounds, start, count = [], 0, 0
    for size in sizes[torch.argsort(first)].tolist():
        if count + size > cap:
            bounds.append((start, count))
            start, count = start + count, 0
        count += size
    bounds.append((start, count))
    device = rows.device if rows is not None else outputs[0].device
    return CoupledTiles(order.to(device), tuple(bounds), cap)


def positions(picked: torch.Tensor, size: int) -> torch.Tensor:
    """A tile's tokens, padded to ``size`` with ``-1`` (padding rows: no token, zero tangent)."""
    out = torch.full((size,), -1, dtype=torch.int64, device=picked.device)
    out[: picked.numel()] = picked
    return out


class _Loop(NamedTuple):
    """What every tile of the running coupled loop shares, kept out of the traced tile function
    (whose key then holds no batch size: a new sequence length traces and compiles nothing)."""

    program: _region.RowProgram
    num_tokens: int
    operands: RegionOperands  # the loss's: its ``reduce`` group, the hidden states' token dims


_running = threading.local()


@contextlib.contextmanager
def running(program: _region.RowProgram, num_tokens: int, operands: RegionOperands):
    """While a coupled loop's tiles run on this thread: what ``tile_pass::tile_tangents`` reads."""
    outer = getattr(_running, "loop", None)
    _running.loop = _Loop(program, num_tokens, operands)
    try:
        yield
    finally:
        _running.loop = outer


@torch.library.custom_op("tile_pass::tile_tangents", mutates_args=())
def _tile_tangents(
    outputs: list[torch.Tensor], positions: torch.Tensor, which: list[int]
) -> list[torch.Tensor]:
    """``d loss / d output`` at a tile's tokens (``positions``; ``-1``: a padding row, zero), for
    outputs ``which``, from the tile's ``outputs`` alone: they are placed among zeros at their
    tokens and the loss's derived gradient read back there. Exact when the tile holds every
    token its tokens are coupled to (:func:`coupled_tiles`). The loss and the batch are the
    running loop's (:func:`running`)."""
    loop = getattr(_running, "loop", None)
    if loop is None:
        raise RuntimeError("tile_pass::tile_tangents runs only inside a coupled tile loop")
    num_tokens = loop.num_tokens
    # padding rows write to one spare row past the tokens and read a zero tangent: no boolean
    # indexing, which would wait for the device
    real = positions >= 0
    rows = torch.where(real, positions, num_tokens)
    full = []
    for out in outputs:
        whole = out.new_zeros((num_tokens + 1, *out.shape[1:]))
        whole.index_copy_(0, rows, out)
        full.append(whole[:num_tokens])
    weights = token_weights(loop.program, full, loop.operands)
    tangents = []
    for i in which:
        if i not in weights:
            tangents.append(torch.zeros_like(outputs[i]))
            continue
        weight = weights[i].expand(full[i].shape)
        picked = weight.index_select(0, positions.clamp(min=0)).to(outputs[i].dtype)
        tangents.append(torch.where(real.view(-1, *[1] * (picked.dim() - 1)), picked, 0))
    return tangents


@_tile_tangents.register_fake
def _(outputs, positions, which):
    return [torch.empty_like(outputs[i]) for i in which]
